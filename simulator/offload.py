"""The CPU offload tier's worker side: the transfers vLLM's native KV offloading asks for, on a priced host link.

A replica built with an offload tier runs vLLM's real ``OffloadingConnector`` (scheduler side, with its
CPU manager and LRU): it decides which blocks are stored to host memory and which of a request's blocks
are loaded back instead of recomputed, and it puts a request whose blocks are loading in
``WAITING_FOR_REMOTE_KVS`` until the worker reports the load. vLLM's worker side copies GPU tensors; this
class plays it with no tensors (:func:`simulator.engine.transfer_jobs` reads each step's jobs): each job
takes ``blocks x block bytes`` over the host link at :meth:`~simulator.cost_model.CostModel.host_transfer_s`,
one job after another per direction (PCIe is full duplex: loads and stores do not share time), and is
reported finished (:func:`simulator.engine.connector_output`) at the end of the first step that ends after
its transfer does, as vLLM's worker reports it from ``get_finished`` after a forward pass.

Overlap with compute, as vLLM does it:

* stores (GPU to host) are asynchronous: they run beside the forward passes and cost the step nothing;
* asynchronous loads (vLLM's default) cost the step nothing either: only their request waits, while the
  others compute; the load ends ``transfer`` seconds after the link is free;
* a synchronous load (``sync``: its request runs in this very step) and the wait for ``jobs_to_flush``
  (stores whose GPU blocks vLLM is about to reuse) block the step: their time is added to it
  (:attr:`OffloadWorker.blocking_s`).

Not modelled: the HBM bandwidth that transfers take from the forward pass (a DMA over PCIe reads HBM at
1-2 % of its bandwidth), and the CPU copies of vLLM's own worker.
"""

from __future__ import annotations

import heapq
from typing import Any

from simulator import engine
from simulator.cost_model import CostModel

__all__ = ["OffloadWorker"]


class OffloadWorker:
    """One replica's host link: the offloading connector's jobs, their finish times, and their counters."""

    __slots__ = ("block_bytes", "blocking_s", "cost", "load_blocks", "load_free_at", "loads", "pending",
                 "store_blocks", "store_free_at", "stores")

    def __init__(self, cost: CostModel, block_bytes: int) -> None:
        self.cost = cost
        self.block_bytes = block_bytes  # bytes of one block of the simulated model
        self.load_free_at = 0.0  # when the host-to-GPU direction finishes its queued jobs
        self.store_free_at = 0.0
        #: heap of (finish time, job id, request id, is_load, sync, bytes, seconds)
        self.pending: list[tuple[float, int, str, bool, bool, int, float]] = []
        self.loads = self.stores = 0
        self.load_blocks = self.store_blocks = 0
        self.blocking_s = 0.0  # step time spent waiting on transfers (synchronous loads, flushes)

    def submit(self, scheduler_output: Any, now: float) -> float:
        """Queue the jobs of a step that starts at ``now``; the seconds the step waits for transfers."""
        jobs, flush = engine.transfer_jobs(scheduler_output)
        wait_until = now
        if flush:
            wait_until = max([wait_until] + [p[0] for p in self.pending if p[1] in flush])
        for jid, rid, blocks, is_load, sync in jobs:
            nbytes = blocks * self.block_bytes
            seconds = self.cost.host_transfer_s(nbytes)
            if is_load:
                start = max(self.load_free_at, now)
                end = self.load_free_at = start + seconds
                self.loads += 1
                self.load_blocks += blocks
                if sync:
                    wait_until = max(wait_until, end)
            else:
                start = max(self.store_free_at, now)
                end = self.store_free_at = start + seconds
                self.stores += 1
                self.store_blocks += blocks
            heapq.heappush(self.pending, (end, jid, rid, is_load, sync, nbytes, seconds))
        blocked = wait_until - now
        self.blocking_s += blocked
        return blocked

    def finished(self, until: float) -> Any:
        """vLLM's ``KVConnectorOutput`` for the jobs finished by ``until`` (None when none did)."""
        pending = self.pending
        if not pending or pending[0][0] > until:
            return None
        done = []
        loaded: set[str] = set()
        while pending and pending[0][0] <= until:
            _, jid, rid, is_load, sync, nbytes, seconds = heapq.heappop(pending)
            done.append((jid, is_load, nbytes, seconds))
            if is_load and not sync:
                loaded.add(rid)
        return engine.connector_output(loaded, done)

    @property
    def busy(self) -> bool:
        """Some transfer has not been reported yet."""
        return bool(self.pending)

    @property
    def load_bytes(self) -> int:
        return self.load_blocks * self.block_bytes

    @property
    def store_bytes(self) -> int:
        return self.store_blocks * self.block_bytes
