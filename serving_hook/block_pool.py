"""The pool mechanism under the retention and eviction levers: kvpilot's subclass of vLLM's ``BlockPool``.

vLLM 0.33 (``vllm/v1/core/block_pool.py``) keeps every block with ref count 0
in a doubly linked free list (``FreeKVCacheBlockQueue``). A freed block that
still carries a hash stays there as prefix cache until it reaches the head and
is handed out again (``get_new_blocks`` -> ``_maybe_evict_cached_block``).
``free_blocks`` appends freed hashed blocks at the tail, so eviction is LRU.

The pool's class is swapped (:func:`install_eviction_counter`; only the hook's
non-passthrough mode installs it) for :class:`CountingBlockPool`, which

* counts evictions: its ``_maybe_evict_cached_block`` counts the blocks that
  lose their hash when handed out again;
* carries the eviction lever's entry point (``kvpilot_eviction_hook``, called
  from ``get_new_blocks`` when an allocation evicts, :func:`takes_cached`) and
  applies the step's eviction order as blocks are taken (``kvpilot_plan``);
* keeps the prefix tree of the cached blocks, from which
  :func:`exclusive_tail` tells a prefix's own tail from blocks that other
  cached chains go through (what demotion, :mod:`serving_hook.pins`, and the
  eviction order, :mod:`serving_hook.eviction`, move).

None of it changes what vLLM does. The levers that use it, and how, are
described in :mod:`serving_hook.retention` and :mod:`serving_hook.eviction`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol, Sequence

from vllm.v1.core.block_pool import BlockPool


class StepPlan(Protocol):
    """This step's eviction order (:class:`serving_hook.eviction.EvictionPlan`), as the pool drives it."""

    done: bool  # every listed tail is placed: the pool drops the plan

    def cover(self, n: int) -> None:
        """Make sure the first ``n`` free blocks evict in the plan's order."""


class CountingBlockPool(BlockPool):
    """``BlockPool`` that counts prefix-cache evictions (set by class swap).

    It also carries the eviction lever's entry point: with
    ``kvpilot_eviction_hook`` set, ``get_new_blocks(n)`` calls ``hook(n)``
    first when one of the ``n`` blocks it is about to pop still holds a hash.
    And it keeps the prefix tree of the cached blocks (``kvpilot_children``:
    block id -> ids of the cached blocks that follow it in some request), so
    :func:`exclusive_tail` can tell a prefix's own tail from blocks other cached
    chains go through. Neither changes what vLLM does.
    """

    kvpilot_evictions: int = 0
    kvpilot_eviction_hook: Optional[Callable[[int], None]] = None
    kvpilot_plan: Optional[StepPlan] = None  # this step's eviction order, applied as blocks are taken
    kvpilot_plan_error: Optional[Callable[[BaseException], None]] = None  # told when placing the plan fails
    kvpilot_dropped: Optional[list[int]] = None  # ids of blocks that lost their hash (kept for CachedPrefixIndex)
    kvpilot_tree: bool = True  # keep the prefix tree (only the levers that move blocks need it)
    kvpilot_children: dict[int, set[int]]
    kvpilot_parent: dict[int, int]

    def _maybe_evict_cached_block(self, block) -> bool:  # noqa: D401 - vLLM override
        evicted = super()._maybe_evict_cached_block(block)
        if evicted:
            self.kvpilot_evictions += 1
        return evicted

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id, block_mask=None) -> None:  # vLLM override (block_pool.py L230)
        super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                  kv_cache_group_id, block_mask)
        if not self.kvpilot_tree:
            return
        parent, children = self.kvpilot_parent, self.kvpilot_children
        for i in range(max(num_cached_blocks, 1), num_full_blocks):
            b, p = blocks[i], blocks[i - 1]
            if b.is_null or p.is_null or b.block_hash is None or parent.get(b.block_id) == p.block_id:
                continue
            self._kvp_unlink_parent(b.block_id)
            parent[b.block_id] = p.block_id
            kids = children.get(p.block_id)
            if kids is None:
                children[p.block_id] = {b.block_id}
            else:
                kids.add(b.block_id)

    def _remove_cached_block_hashes(self, block):  # vLLM override (block_pool.py L630): every path that drops a hash
        bid = block.block_id
        dropped = self.kvpilot_dropped
        if dropped is not None and block.block_hash is not None:
            dropped.append(bid)
        if bid in self.kvpilot_parent:
            self._kvp_unlink_parent(bid)
        kids = self.kvpilot_children.pop(bid, None)
        if kids:
            for c in kids:
                self.kvpilot_parent.pop(c, None)
        return super()._remove_cached_block_hashes(block)

    def _kvp_unlink_parent(self, bid: int) -> None:
        p = self.kvpilot_parent.pop(bid, None)
        if p is not None:
            kids = self.kvpilot_children.get(p)
            if kids is not None:
                kids.discard(bid)
                if not kids:
                    del self.kvpilot_children[p]

    def reset_prefix_cache(self) -> bool:  # vLLM override: no hash is left, nor any link
        ok = super().reset_prefix_cache()
        if ok:
            self.kvpilot_children.clear()
            self.kvpilot_parent.clear()
            self.kvpilot_plan = None
        return ok

    def get_new_blocks(self, num_blocks: int):  # vLLM override (block_pool.py L706)
        if num_blocks > 0 and self.enable_caching:
            hook = self.kvpilot_eviction_hook
            if hook is not None and takes_cached(self.free_block_queue, num_blocks):  # this allocation evicts
                try:
                    hook(num_blocks)
                except Exception:  # the hook handles its own errors; never break vLLM
                    pass
            plan = self.kvpilot_plan
            if plan is not None:
                try:
                    plan.cover(num_blocks)
                except Exception as e:  # never break vLLM: LRU for the rest of the step
                    plan.done = True
                    if self.kvpilot_plan_error is not None:
                        self.kvpilot_plan_error(e)
                if plan.done:
                    self.kvpilot_plan = None
        return super().get_new_blocks(num_blocks)


def takes_cached(queue: Any, n: int, placed: frozenset | set = frozenset()) -> bool:
    """Whether the first ``n`` blocks of the free list (the ones ``get_new_blocks(n)`` pops) include a cached
    block whose id is not in ``placed``: whether that allocation evicts (outside a plan's placed blocks)."""
    tail = queue.fake_free_list_tail
    b = queue.fake_free_list_head.next_free_block
    for _ in range(n):
        if b is None or b is tail:
            return False
        if b.block_hash is not None and b.block_id not in placed:
            return True
        b = b.next_free_block
    return False


def install_eviction_counter(pool: BlockPool) -> None:
    """Make ``pool`` count evictions (idempotent)."""
    if not isinstance(pool, CountingBlockPool):
        if type(pool) is not BlockPool:
            # A subclass we do not know: build a combined class on the fly.
            pool.__class__ = type(f"Counting{type(pool).__name__}", (CountingBlockPool, type(pool)), {})
        else:
            pool.__class__ = CountingBlockPool
        pool.kvpilot_evictions = 0
        pool.kvpilot_children = {}
        pool.kvpilot_parent = {}


def cached_length(blocks: Sequence[Any], hashes: Sequence[Any]) -> int:
    """How many leading blocks still hold the hashes they had when freed."""
    n = 0
    for b, h in zip(blocks, hashes):
        if b.is_null or h is None or b.block_hash != h:
            break
        n += 1
    return n


def exclusive_tail(pool: BlockPool, blocks: Sequence[Any], n: int) -> list:
    """The chain's free cached blocks that no other cached chain goes through, deepest first.

    ``n`` is the chain's :func:`cached_length` (its first ``n`` blocks still
    hold their hashes). Walks up from block ``n - 1`` and stops at the first block
    in use or with a cached child other than the chain's own next block (a
    branch point, or a block another chain extends): demoting it would cost
    the chains that share it. Without the pool's prefix tree (a plain
    ``BlockPool``) the chain counts as unshared.
    """
    children = getattr(pool, "kvpilot_children", None) or {}
    tail: list = []
    below = None  # id of the chain's block under the current one, when it is in the tail
    for i in range(n - 1, -1, -1):
        b = blocks[i]
        kids = children.get(b.block_id)
        if b.ref_cnt or b.prev_free_block is None or (kids and (below is None or len(kids) > 1 or below not in kids)):
            break
        tail.append(b)
        below = b.block_id
    return tail
