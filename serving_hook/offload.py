"""The CPU offload tier as the hook sees it: vLLM's native KV offloading (``--kv-offloading-size``).

vLLM 0.33's ``OffloadingConnector`` (``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``)
stores every full block a request computes to host memory as it is computed (write-through, asynchronous;
the last blocks at the step after the request finishes), keeps them in an LRU (or ARC) of
``kv_offloading_size`` GiB, and, when a waiting request's prefix is found there beyond what the GPU cache
holds, loads it back (``get_num_new_matched_tokens``; the request waits in ``WAITING_FOR_REMOTE_KVS``
until the worker reports the load) instead of recomputing it. vLLM has no per-request control of what is
stored, so the retention lever's ``OFFLOAD`` action does not start a copy: it lets the GPU copy go first
(demotes it, :mod:`serving_hook.retention`), and the tier's copy serves the session's return.

This module gives the policies the tier's size and load price (``EngineState.num_offload_blocks`` /
``offload_load_s_per_block``: a block's bytes over ``KVPILOT_HOST_LINK_GBPS``) and the ``steps`` telemetry
its transfers per step, in blocks and bytes.
"""

from __future__ import annotations

import mmap
from typing import Any

__all__ = ["OffloadTier", "block_bytes", "tier_of"]


class OffloadTier:
    """Capacity (blocks), block size (bytes) and load price (seconds per block) of a scheduler's CPU tier."""

    __slots__ = ("block_bytes", "blocks", "load_s_per_block")

    def __init__(self, blocks: int, block_bytes: int, load_s_per_block: float) -> None:
        self.blocks = blocks
        self.block_bytes = block_bytes
        self.load_s_per_block = load_s_per_block

    @staticmethod
    def step_blocks(scheduler_output: Any) -> tuple[int, int]:
        """``(blocks loaded, blocks stored)`` by the transfer jobs of one ``schedule()`` output."""
        meta = scheduler_output.kv_connector_metadata
        # getattr: VLLM_USE_SIMPLE_KV_OFFLOAD swaps in SimpleCPUOffloadConnector, whose metadata has no jobs
        load_jobs = getattr(meta, "load_jobs", None)
        if not load_jobs and not getattr(meta, "store_jobs", None):
            return 0, 0
        loaded = sum(len(j.dst_spec.block_ids) for j in load_jobs.values()) if load_jobs else 0
        stored = sum(len(j.src_spec.block_ids) for j in meta.store_jobs.values())
        return loaded, stored


def block_bytes(kv_cache_config: Any) -> int:
    """Bytes one block takes across every layer (page-aligned, as vLLM's CPU tier allocates it)."""
    raw = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv_cache_config.kv_cache_groups)
    return -(-raw // mmap.PAGESIZE) * mmap.PAGESIZE


def tier_of(sched: Any, kv_block_bytes: int | None, host_link_gbps: float) -> OffloadTier | None:
    """The scheduler's CPU offload tier, or None when vLLM runs without native offloading.

    ``kv_block_bytes``: the bytes of one block that transfers are priced and counted by (None: vLLM's own, from
    its KV-cache config; the simulator gives its simulated model's)."""
    size_gib = sched.cache_config.kv_offloading_size
    if size_gib is None or sched.connector is None or sched.cache_config.kv_offloading_backend != "native":
        return None
    vllm_bytes = block_bytes(sched.kv_cache_config)
    blocks = int(size_gib * 2**30 // vllm_bytes) if vllm_bytes else 0
    nbytes = vllm_bytes if kv_block_bytes is None else kv_block_bytes
    return OffloadTier(blocks, nbytes, nbytes / (host_link_gbps * 1e9))
