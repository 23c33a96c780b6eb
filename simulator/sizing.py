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

from simulator.tokens import VLLM_BLOCK_SIZE

if TYPE_CHECKING:
    from simulator.workload import PreparedWorkload

NULL_BLOCKS = 1  # vLLM's block pool keeps block 0 as the null block


def blocks_for_fraction(workload: PreparedWorkload, fraction: float) -> int:
    """vLLM ``num_blocks`` for a replica holding ``fraction`` of the largest step's (or the trace's) need
    (:attr:`PreparedWorkload.kv_need`, computed once per workload)."""
    if not fraction > 0:
        raise ValueError(f"kv fraction must be > 0, got {fraction}")
    return math.ceil(fraction * workload.kv_need) + NULL_BLOCKS


def min_blocks_for(workload: PreparedWorkload, vllm_block_size: int = VLLM_BLOCK_SIZE) -> int:
    """vLLM ``num_blocks`` the largest single request needs at full length (prompt + output)."""
    return -(-workload.largest_request // vllm_block_size) + NULL_BLOCKS
