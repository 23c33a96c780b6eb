"""Eviction lever: when an allocation is about to evict cached blocks, which cached prefixes go first.

Retention decides when blocks are freed; the eviction lever decides at the
moment vLLM evicts, comparing every cached prefix (KVFlow, Marconi, LRB,
Belady). With ``Policy.uses_eviction``, the scheduler's ``_free_blocks`` notes
each finished request's prefix in a :class:`CachedPrefixIndex`, and the pool
(class-swapped, :mod:`serving_hook.block_pool`) calls
:meth:`EvictionLever.before_evict` from ``get_new_blocks`` (``block_pool.py``
L706) when the blocks it is about to pop include a cached one. The policy's
``evict()`` then orders the cached prefixes whose blocks are free, and the
lever moves the listed ones to the head of the free list before vLLM pops. At
most once per step, budgeted and failure-isolated like the other calls;
logged as a ``retain`` decision with action ``evict``.

Design and costs (line numbers of vllm 0.33.0):

* *Where vLLM evicts.* Every block the KV-cache manager takes comes from
  ``BlockPool.get_new_blocks`` (``v1/core/block_pool.py`` L706): it pops the
  first ``n`` blocks of the free list (``FreeKVCacheBlockQueue.popleft_n``,
  ``v1/core/kv_cache_utils.py`` L347, called at L721) and strips the hash of
  each (``_maybe_evict_cached_block``, L729 / L769): a popped block that
  carried a hash is an eviction. Its callers are the single-type managers'
  ``allocate_new_blocks`` (``single_type_kv_cache_manager.py`` L395, L406;
  L365 for external hits), reached from ``KVCacheManager.allocate_slots``
  after the request's own cache hits were taken off the free list
  (``touch``, ``kv_cache_manager.py`` L595 -> ``block_pool.py`` L792). So at
  ``get_new_blocks`` the free list holds exactly the evictable blocks, in
  the order vLLM will evict them.
* *The hook.* :class:`~serving_hook.block_pool.CountingBlockPool` (installed
  by class swap, see :func:`~serving_hook.block_pool.install_eviction_counter`)
  overrides ``get_new_blocks``. When its ``kvpilot_eviction_hook`` is set, it
  walks the first ``n`` free blocks (the ones about to be popped, the same
  walk ``popleft_n`` does) and, only if one of them carries a hash, calls
  ``hook(n)`` before vLLM's own ``get_new_blocks``. The lever's hook
  (:meth:`EvictionLever.before_evict`) clears ``kvpilot_eviction_hook`` when
  it runs and sets it again at the next ``schedule()``
  (:meth:`EvictionLever.rearm`): at most one policy call per engine step, and
  no walk at all for the rest of the step. The order the policy gave stays in
  the free list for the rest of the step.
* *Candidates.* :class:`CachedPrefixIndex` keeps the prefixes of finished
  requests (noted when the scheduler's ``_free_blocks`` frees them), in the
  order they were freed (LRU). An entry is dropped when its first block no
  longer holds the hash it had (evicted and reused: the rest of the chain
  can no longer hit); a prefix is offered only while its deepest still-cached
  block is free (``ref_cnt == 0``; otherwise a running request holds the whole
  chain and there is no tail to move). The index is bounded (oldest entries
  go first). It keeps each entry's cached length from the pool's log of
  blocks that lost their hash, so a scan does not walk the chains.
* *Applying the order.* :class:`EvictionPlan` takes the listed prefixes'
  *exclusive tails* off the free list (``FreeKVCacheBlockQueue.remove``,
  ``kv_cache_utils.py`` L391) and puts them back at its head (``prepend_n``,
  L438), first-listed prefix first and each tail's deepest block first,
  *behind* the run of hash-less free blocks at the head (vLLM puts freed
  hash-less blocks there, ``free_blocks`` L845, and hands them out before
  evicting anything). It places the first tails when the policy answers and
  the next ones when a later allocation of the same step reaches past them
  (:meth:`EvictionPlan.cover`), so a step moves about the blocks it takes,
  not every cached block. The exclusive tail
  (:func:`~serving_hook.block_pool.exclusive_tail`) is the run of free cached
  blocks at the end of the chain that no other cached chain goes through: the
  pool keeps the prefix tree of the cached blocks
  (``cache_full_blocks`` links each newly hashed block to the block before it
  in its request; a link goes when either block loses its hash), and the
  walk up from the deepest block stops at a branch point, at a block another
  chain extends, or at a block in use. So a prefix ranked first never takes a
  hot prefix's shared head with it; those blocks keep their LRU place.
  Unlisted cached blocks keep their LRU order (``free_blocks`` appends at the
  tail, L847). The free-block count does not change, so vLLM's own check
  (``get_new_blocks`` L718) still holds.
* *Cost.* Off (the default, or a policy without ``uses_eviction``): no class
  swap in passthrough mode; otherwise one attribute test per
  ``get_new_blocks`` and two dict updates per newly cached block (the tree).
  On: a walk of ``n`` blocks per allocation (until the first evicting one in
  a step, then while the step's plan has tails left); once per step, one scan
  of the index (O(entries + blocks that lost their hash since the last
  scan)), the policy call (under the step budget,
  :meth:`~serving_hook.guard.Guard.decide`), and list surgery on about as many
  blocks as the step takes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Iterable, Optional, Sequence

from vllm.v1.core.block_pool import BlockPool

from policy.interface import CachedPrefix, EvictionDecision, OwnerState, Policy
from serving_hook.block_pool import CountingBlockPool, cached_length, exclusive_tail, takes_cached
from serving_hook.guard import Guard
from serving_hook.lever import Lever
from serving_hook.rows import Rows
from serving_hook.translate import EngineView, Freed, Translator, hashes64

_perf = time.perf_counter


class CachedPrefixIndex:
    """Finished requests' prefixes whose blocks may still be cached, in the order they were freed.

    Entries are objects with ``blocks`` and ``hashes`` (the blocks' hashes at
    free time), keyed by prefix id. Re-adding an id moves it to the end (most
    recent). Dead entries (first block evicted) are dropped when
    :meth:`candidates` scans past them, and when the index outgrows
    ``max_entries`` (then, if needed, the oldest entries go too).

    Each entry's cached length is kept up to date without walking its blocks:
    a :class:`CountingBlockPool` logs the ids of the blocks that lose their hash
    (``kvpilot_dropped``), and the index knows which entries hold each block at
    which position. A drop cuts the entries that hold the block; a cut entry
    then checks, from its cut onwards, whether its blocks hold their hashes again
    (vLLM can cache the same content into the same block). So :meth:`candidates`
    costs O(entries + blocks dropped since the last call), not O(cached blocks).
    """

    def __init__(self, max_entries: int, pool: Optional[BlockPool] = None) -> None:
        self.max_entries = max(16, int(max_entries))
        self.entries: dict[str, Any] = {}
        self._known: dict[str, int] = {}  # prefix id -> leading blocks known to hold their hashes
        self._ids: dict[str, tuple[int, ...]] = {}  # prefix id -> its blocks' ids
        self._holders: dict[int, dict[str, int]] = {}  # block id -> {prefix id: position}
        self._dropped: Optional[list[int]] = None
        if isinstance(pool, CountingBlockPool):
            pool.kvpilot_dropped = self._dropped = []
        self.num_dropped_dead = 0
        self.num_dropped_full = 0

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, prefix_id: str, entry: Any) -> None:
        if prefix_id in self.entries:
            self._forget(prefix_id)
        self._refresh()  # drops logged before this entry's blocks were hashed must not cut it
        ids = tuple(b.block_id for b in entry.blocks)
        self.entries[prefix_id] = entry
        self._ids[prefix_id] = ids
        self._known[prefix_id] = cached_length(entry.blocks, entry.hashes) if self._dropped is not None else 0
        holders = self._holders
        for pos, bid in enumerate(ids):
            h = holders.get(bid)
            if h is None:
                holders[bid] = {prefix_id: pos}
            else:
                h[prefix_id] = pos
        if len(self.entries) > self.max_entries:
            self._shrink()

    def clear(self) -> None:
        self.entries.clear()
        self._known.clear()
        self._ids.clear()
        self._holders.clear()
        if self._dropped is not None:
            self._dropped.clear()

    def block_ids(self, prefix_id: str) -> tuple[int, ...]:
        """The ids of all the blocks the prefix had when freed (cut them at its cached length)."""
        return self._ids[prefix_id]

    def _forget(self, prefix_id: str) -> None:
        del self.entries[prefix_id]
        del self._known[prefix_id]
        holders = self._holders
        for bid in self._ids.pop(prefix_id):
            h = holders.get(bid)
            if h is not None:
                h.pop(prefix_id, None)
                if not h:
                    del holders[bid]

    def _refresh(self) -> None:
        """Cut the entries holding blocks that lost their hash since the last call."""
        dropped = self._dropped
        if not dropped:
            return
        holders, known = self._holders, self._known
        for bid in dropped:
            h = holders.get(bid)
            if h:
                for pid, pos in h.items():
                    if pos < known[pid]:
                        known[pid] = pos
        dropped.clear()

    def _length(self, prefix_id: str, entry: Any) -> int:
        """The entry's current cached length (exact: see the class docstring)."""
        if self._dropped is None:  # no drop log (a plain BlockPool): walk the chain
            return cached_length(entry.blocks, entry.hashes)
        n = self._known[prefix_id]
        blocks, hashes = entry.blocks, entry.hashes
        end = len(blocks)
        if n < end and blocks[n].block_hash == hashes[n]:  # cached again since the cut
            while n < end and blocks[n].block_hash == hashes[n]:
                n += 1
            self._known[prefix_id] = n
        return n

    def _shrink(self) -> None:
        self._refresh()
        dead = [pid for pid, e in self.entries.items() if self._length(pid, e) == 0]
        for pid in dead:
            self._forget(pid)
        self.num_dropped_dead += len(dead)
        target = (self.max_entries * 3) // 4
        if len(self.entries) > target:
            old = list(self.entries)[: len(self.entries) - target]
            for pid in old:
                self._forget(pid)
            self.num_dropped_full += len(old)

    def candidates(self, limit: Optional[int] = None) -> list[tuple[str, Any, int]]:
        """``(prefix_id, entry, n_cached)`` of the prefixes whose deepest cached block is free, oldest first.

        ``n_cached`` is the number of leading blocks still cached. A prefix
        whose deepest cached block is in use (a running request holds the
        whole chain) has no tail the lever could move, and is left out. At most
        ``limit`` are returned (all when ``None``); the scan stops there.
        """
        self._refresh()
        out: list[tuple[str, Any, int]] = []
        dead: list[str] = []
        length = self._length
        for pid, e in self.entries.items():
            n = length(pid, e)
            if n == 0:
                dead.append(pid)
                continue
            if e.blocks[n - 1].ref_cnt == 0:
                out.append((pid, e, n))
                if limit is not None and len(out) >= limit:
                    break
        for pid in dead:
            self._forget(pid)
        self.num_dropped_dead += len(dead)
        return out


#: Blocks an eviction plan moves at first (or the allocation's need, if larger); each later extension doubles it.
PLAN_FIRST_BLOCKS = 64
_PAUSED, _RUNNING = OwnerState.PAUSED_TOOL, OwnerState.RUNNING  # (plain names: an Enum attribute costs ~0.1 µs)


class EvictionPlan:
    """A policy's eviction order for one engine step, applied to the free list as vLLM takes blocks.

    The prefixes' exclusive tails (:func:`exclusive_tail`) go, in the given
    order and each deepest block first, right behind the hash-less free blocks
    at the head of the free list (those are handed out first and evict
    nothing). Moving every listed tail would cost O(cached blocks) per step, but
    a step takes only a few hundred blocks; so the plan moves the first tails
    (at least :data:`PLAN_FIRST_BLOCKS` blocks, or the allocation's need), and
    before each later allocation :meth:`cover` checks its first ``n`` free
    blocks: if one is a cached block the plan has not placed while listed tails
    are left, the next tails are placed right behind the ones still waiting. So
    every evicting allocation of the step takes blocks in the policy's order, as
    if all tails had been moved at once, except that a later tail is measured
    when it is placed (a block in use by then stays). Unlisted cached blocks
    keep their LRU order. The free-block count never changes: a placement
    measures its tails first and then only unlinks and relinks free blocks.
    """

    def __init__(self, pool: BlockPool, chains: Iterable[tuple[Sequence[Any], Sequence[Any], int]],
                 on_move: Optional[Callable[[int], None]] = None) -> None:
        self.pool = pool
        self._chains = iter(chains)  # (blocks, hashes, cached length when the order was given)
        self._fresh = True  # the cached lengths given still hold (nothing ran since)
        self._placed: set[int] = set()
        self._next = PLAN_FIRST_BLOCKS
        self._on_move = on_move
        self.done = False  # every listed tail is placed: LRU for the rest of the step
        self.moved = 0

    def cover(self, n: int) -> None:
        """Make sure the first ``n`` free blocks evict in the plan's order (place more tails if needed)."""
        if takes_cached(self.pool.free_block_queue, n, self._placed):
            self.place(n)

    def place(self, n: int) -> int:
        """Place the next tails behind the hash-less and already placed blocks at the head; how many moved.

        Enough for an allocation of ``n`` blocks, and at least the plan's next chunk (which doubles)."""
        pool = self.pool
        q = pool.free_block_queue
        tail = q.fake_free_list_tail
        placed = self._placed
        ahead = 0  # hash-less or placed blocks at the head
        b = q.fake_free_list_head.next_free_block
        while b is not None and b is not tail and (b.block_hash is None or b.block_id in placed):
            ahead += 1
            b = b.next_free_block
        want = max(n - ahead, self._next)
        self._next *= 2
        moved: list = []
        while len(moved) < want:
            chain = next(self._chains, None)
            if chain is None:
                self.done = True
                break
            blocks, hashes, length = chain
            if not self._fresh:
                length = cached_length(blocks, hashes)
            for blk in exclusive_tail(pool, blocks, length):
                if blk.block_id not in placed:
                    placed.add(blk.block_id)
                    moved.append(blk)
        self._fresh = False
        if moved:
            for blk in moved:
                q.remove(blk)
            head = q.popleft_n(ahead) if ahead else []
            q.prepend_n(moved)
            if head:
                q.prepend_n(head)
            self.moved += len(moved)
            if self._on_move is not None:
                self._on_move(len(moved))
        return len(moved)


def evict_first(pool: BlockPool, chains: Iterable[tuple[Sequence[Any], Sequence[Any], int]], need: int = 0,
                on_move: Optional[Callable[[int], None]] = None,
                on_error: Optional[Callable[[BaseException], None]] = None) -> int:
    """Start an :class:`EvictionPlan` for ``chains`` (``(blocks, hashes, cached_length)``, evict first first).

    Places the first tails now (enough for ``need`` blocks, and at least
    :data:`PLAN_FIRST_BLOCKS`); the pool's ``get_new_blocks`` places more when
    an allocation of the same step needs them (a plain ``BlockPool`` gets only
    this first placement). A later placement that fails drops the plan (LRU
    for the rest of the step) and is passed to ``on_error``. Returns the number
    of blocks moved now.
    """
    plan = EvictionPlan(pool, chains, on_move)
    moved = plan.place(need)
    if isinstance(pool, CountingBlockPool) and not plan.done:
        pool.kvpilot_plan = plan
        pool.kvpilot_plan_error = on_error
    return moved


class EvictionLever(Lever):
    """Asks the policy for an eviction order once per step, when vLLM is about to evict, and applies it."""

    def __init__(self, sched: EngineView, policy: Policy, guard: Guard, tr: Translator, rows: Rows) -> None:
        super().__init__(sched, policy, guard, tr, rows)
        pool = tr.pool
        self.pool = pool
        # Candidates are the freed prefixes still cached; the pool calls back before an evicting allocation.
        self.index = CachedPrefixIndex(max(4 * tr.num_blocks, 1024), pool)
        self.cap: Optional[int] = None
        self.set_cap(policy.max_eviction_candidates)
        self._offered: dict[str, tuple] = {}  # evict()'s last candidates: prefix id -> (Freed, CachedPrefix)
        self._hook = self.before_evict
        pool.kvpilot_eviction_hook = self._hook

    def set_cap(self, cap: Optional[int]) -> None:
        """The most candidates one ``evict()`` gets: the policy's ``max_eviction_candidates`` (None or <= 0: all)."""
        self.cap = int(cap) if cap is not None and int(cap) > 0 else None

    def note_freed(self, freed: Freed) -> None:
        """A finished request's cached blocks: a candidate while they stay cached."""
        self.index.add(freed.request_id, freed)

    def rearm(self) -> None:
        """At ``schedule()``: one ask again this step; the last step's order is spent."""
        pool = self.pool
        pool.kvpilot_eviction_hook = self._hook
        pool.kvpilot_plan = None

    def before_evict(self, num_blocks: int) -> None:
        """Called by the pool right before an allocation that evicts cached blocks.

        Disarms itself: the policy is asked at most once per engine step
        (``schedule()`` re-arms it); the order it gives stays in the free list
        for the rest of the step.
        """
        self.pool.kvpilot_eviction_hook = None
        t0 = _perf()
        try:
            self._evict(num_blocks)
        except Exception as e:
            self.guard.internal_error("evict", e)
        self.guard.inner_s += _perf() - t0

    def _count_moved(self, n: int) -> None:
        self.stats.evict_first_blocks += n

    def _plan_failed(self, e: BaseException) -> None:
        self.guard.internal_error("evict", e)

    def _evict(self, num_blocks: int) -> None:
        if self.guard.fallback:
            return  # this step already fell back to vLLM's behaviour (LRU)
        found = self.index.candidates(self.cap)
        if not found:
            return
        now = self.sched.kvpilot_clock()
        sessions = self.tr.sessions
        groups = self.tr.groups
        ids_of = self.index.block_ids
        last = self._offered  # the previous step's CachedPrefix objects, reused while unchanged
        offered: dict[str, tuple[Freed, CachedPrefix]] = {}
        prefixes: list[CachedPrefix] = []
        for pid, f, n in found:
            meta = f.meta
            state = f.owner_state
            if state is _PAUSED and sessions.get(meta.session_id) != (meta.turn or 0):
                state = _RUNNING  # the session's next turn has arrived
            g = groups.get(meta.group_id) if meta.group_id is not None else None
            pending = max(0, (meta.group_size or 0) - g[4]) if g is not None and meta.group_size else 0
            prev = last.get(pid)
            cp = prev[1] if prev is not None and prev[0] is f else None
            if cp is None or len(cp.block_ids) != n or cp.owner_state is not state or cp.group_pending != pending:
                h64 = hashes64(f)
                cp = CachedPrefix(
                    prefix_id=pid,
                    owner_request_id=f.request_id,
                    owner_state=state,
                    meta=meta,
                    block_ids=ids_of(pid)[:n],
                    block_hashes=h64[:n],
                    last_used_s=f.time_s,
                    group_pending=pending,
                )
            offered[pid] = (f, cp)
            prefixes.append(cp)
        self._offered = offered
        self.stats.eviction_calls += 1
        dec = self.guard.decide("evict", self.policy.evict, EvictionDecision, prefixes, num_blocks, self.tr.state(now))
        if dec is None:
            return
        by_id = {pid: (f, n) for pid, f, n in found}  # n: cached length, unchanged since candidates()
        chains = []
        seen: set = set()
        first = None
        for pid in dec.order or ():
            fn = by_id.get(pid)
            if fn is None or pid in seen:
                continue
            seen.add(pid)
            chains.append((fn[0].blocks, fn[0].hashes, fn[1]))
            if first is None:
                first = pid
        if chains and evict_first(self.pool, chains, num_blocks, self._count_moved, self._plan_failed):
            self.stats.eviction_orders += 1
        if self.rows.log_decisions:
            idx = next((i for i, cp in enumerate(prefixes) if cp.prefix_id == first), -1)
            self.rows.prefix_decision(now, prefixes, dec.predictions, idx, dec.propensity, "evict")
