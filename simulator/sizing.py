"""KV pool sizing: ``--kv-fraction F`` as a share of the blocks a workload needs with nothing evicted.

The need of a set of requests is the number of distinct vLLM blocks that hold all of
them at once at full length (prompt + output tokens): the full blocks of every
stream (a session's turns and the requests scoring it share one growing context,
so a stream needs its longest prompt + output) counted once across streams (GRPO
siblings share their prompt), plus one partial tail block per stream. An RL
workload needs its largest step; a trace replay (every row has ``arrival_s``) its
whole trace. Returned sizes are vLLM ``num_blocks``: they include the one block
vLLM reserves as its null block.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from simulator.tokens import VLLM_BLOCK_SIZE, WorkloadTokens

if TYPE_CHECKING:
    from simulator.workload import PreparedWorkload

NULL_BLOCKS = 1  # vLLM's block pool keeps block 0 as the null block


def blocks_needed(tokens: WorkloadTokens, streams: np.ndarray, block_size: int = VLLM_BLOCK_SIZE) -> int:
    """Distinct blocks holding the given streams at once at full length (shared full blocks once)."""
    keys, in_prompts = tokens.stream_keys(streams, block_size)
    full = -(-tokens.stream_length[streams] // block_size)  # blocks of each stream, its partial tail included
    return int(np.unique(keys).size + (full - in_prompts).sum())  # blocks past the prompts are the stream's own


def workload_need(workload: PreparedWorkload) -> int:
    """Distinct vLLM blocks of the largest step (or the whole trace) at full length, nothing evicted."""
    tokens = workload.tokens
    streams = np.arange(len(tokens.stream_names))
    if workload.trace:
        return blocks_needed(tokens, streams)
    step_of_stream = np.zeros(streams.size, np.int64)
    step_of_stream[tokens.stream] = workload.step
    return max((blocks_needed(tokens, streams[step_of_stream == s]) for s in np.unique(step_of_stream)), default=0)


def blocks_for_fraction(workload: PreparedWorkload, fraction: float) -> int:
    """vLLM ``num_blocks`` for a replica holding ``fraction`` of the largest step's (or the trace's) need
    (:attr:`PreparedWorkload.kv_need`, computed once per workload)."""
    if not fraction > 0:
        raise ValueError(f"kv fraction must be > 0, got {fraction}")
    return math.ceil(fraction * workload.kv_need) + NULL_BLOCKS


def min_blocks_for(workload: PreparedWorkload, vllm_block_size: int = VLLM_BLOCK_SIZE) -> int:
    """vLLM ``num_blocks`` the largest single request needs at full length (prompt + output)."""
    return -(-workload.largest_request // vllm_block_size) + NULL_BLOCKS
