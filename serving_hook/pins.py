"""Pins with a TTL, and demotion, over vLLM's ``BlockPool``: the retention lever's mechanism.

vLLM 0.33 (``vllm/v1/core/block_pool.py``) keeps every block with ref count 0
in a doubly linked free list (``FreeKVCacheBlockQueue``). A freed block that
still carries a hash stays there as prefix cache until it reaches the head and
is handed out again (``get_new_blocks`` -> ``_maybe_evict_cached_block``).
``free_blocks`` appends freed hashed blocks at the tail, so eviction is LRU.

* **Protect** = ``BlockPool.touch(blocks)``: one more reference per block,
  which takes it off the free list (a hard pin). The adapter releases it with
  ``BlockPool.free_blocks`` (back to the tail, still cached) when the TTL
  expires, when the policy says so, under pressure (before vLLM would preempt
  a running request: see :mod:`serving_hook.preemption`), or when the prefix cache
  is reset. Pinned blocks count as used, so the adapter caps them at
  ``max_pinned_blocks`` distinct blocks.
* **Demote** = take the prefix's exclusive tail (its free cached blocks that
  no other cached chain goes through, :func:`serving_hook.block_pool.exclusive_tail`) off the free
  list and put it back at its head, deepest block first, so those blocks are
  the next to be evicted. They can still be hit until they are reused.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from vllm.v1.core.block_pool import BlockPool

from serving_hook.block_pool import cached_length, exclusive_tail


@dataclass
class Pin:
    """One pinned prefix: its blocks (each holding one reference of the pin) and when the pin ends."""

    prefix_id: str
    blocks: list  # KVCacheBlock, prefix order
    expires_at: float
    protected_at: float


class BlockPoolAdapter:
    """Pins (with TTL) and demotion for prefixes, over one vLLM ``BlockPool``."""

    def __init__(self, pool: BlockPool, max_pinned_blocks: int) -> None:
        self.pool = pool
        self.max_pinned_blocks = max(0, int(max_pinned_blocks))
        self.pins: dict[str, Pin] = {}
        self._pin_refs: dict[int, int] = {}  # block_id -> pins holding it
        self._expiry: list[tuple[float, int, str]] = []  # heap of (expires_at, seq, prefix_id)
        self._seq = 0
        # counters (monotonic)
        self.num_protected = 0
        self.num_refused = 0
        self.num_released_expired = 0
        self.num_released_policy = 0
        self.num_released_pressure = 0
        self.num_demoted_blocks = 0

    # ------------------------------------------------------------------ state
    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by pins."""
        return len(self._pin_refs)

    def __len__(self) -> int:
        return len(self.pins)

    @staticmethod
    def still_cached(block: Any, block_hash: Any) -> bool:
        """True when ``block`` still holds the cache entry it had when freed."""
        return not block.is_null and block_hash is not None and block.block_hash == block_hash

    # ---------------------------------------------------------------- protect
    def protect(self, prefix_id: str, blocks: Sequence[Any], hashes: Sequence[Any], ttl_s: float, now: float) -> int:
        """Pin ``blocks`` (those still cached) until ``now + ttl_s``.

        Protecting a prefix that is already pinned renews its TTL. Returns
        the number of blocks pinned (0 when refused by the cap or nothing was
        still cached).
        """
        expires = now + float(ttl_s)
        pin = self.pins.get(prefix_id)
        if pin is not None:
            pin.expires_at = expires
            self._push_expiry(expires, prefix_id)
            return len(pin.blocks)
        # Keep the contiguous prefix only: a hole makes the blocks after it unreachable.
        n = 0
        for b, h in zip(blocks, hashes):
            if not self.still_cached(b, h):
                break
            n += 1
        live = list(blocks[:n])
        if not live:
            return 0
        new_distinct = sum(1 for b in live if b.block_id not in self._pin_refs)
        if self.num_pinned_blocks + new_distinct > self.max_pinned_blocks:
            self.num_refused += 1
            return 0
        self.pool.touch(live)
        for b in live:
            self._pin_refs[b.block_id] = self._pin_refs.get(b.block_id, 0) + 1
        self.pins[prefix_id] = Pin(prefix_id, live, expires, now)
        self._push_expiry(expires, prefix_id)
        self.num_protected += 1
        return len(live)

    def _push_expiry(self, expires: float, prefix_id: str) -> None:
        self._seq += 1
        heapq.heappush(self._expiry, (expires, self._seq, prefix_id))

    # ---------------------------------------------------------------- release
    def release(self, prefix_id: str) -> int:
        """Unpin one prefix; its blocks go back to the free-list tail (still cached)."""
        pin = self.pins.pop(prefix_id, None)
        if pin is None:
            return 0
        for b in pin.blocks:
            c = self._pin_refs.get(b.block_id, 0) - 1
            if c <= 0:
                self._pin_refs.pop(b.block_id, None)
            else:
                self._pin_refs[b.block_id] = c
        # Deepest block first, as vLLM frees a request's blocks.
        self.pool.free_blocks(reversed(pin.blocks))
        return len(pin.blocks)

    def release_expired(self, now: float) -> list[str]:
        """Unpin every prefix whose TTL has ended; their ids."""
        released: list[str] = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, _, pid = heapq.heappop(heap)
            pin = self.pins.get(pid)
            if pin is not None and pin.expires_at <= now:
                self.release(pid)
                released.append(pid)
        self.num_released_expired += len(released)
        return released

    def release_policy(self, prefix_ids: Iterable[str]) -> list[str]:
        """Unpin the named prefixes (those pinned); their ids."""
        released = [pid for pid in prefix_ids if self.release(pid)]
        self.num_released_policy += len(released)
        return released

    def release_one_for_pressure(self) -> Optional[str]:
        """Release the pin that expires soonest; its prefix id, or None when none is left."""
        if not self.pins:
            return None
        pid = min(self.pins.values(), key=lambda p: (p.expires_at, p.protected_at)).prefix_id
        self.release(pid)
        self.num_released_pressure += 1
        return pid

    def release_all(self) -> int:
        """Unpin every prefix (before a prefix-cache reset); how many there were."""
        n = len(self.pins)
        for pid in list(self.pins):
            self.release(pid)
        self._expiry.clear()
        return n

    # ----------------------------------------------------------------- demote
    def demote(self, blocks: Sequence[Any], hashes: Sequence[Any]) -> int:
        """Move the prefix's :func:`exclusive_tail` to the head of the free list, deepest block first."""
        queue = self.pool.free_block_queue
        moved = exclusive_tail(self.pool, blocks, cached_length(blocks, hashes))
        for b in moved:
            queue.remove(b)
        if moved:
            queue.prepend_n(moved)
        self.num_demoted_blocks += len(moved)
        return len(moved)
