"""Host-tier lever: kvpilot's ``CachePolicy`` for vLLM's CPU offload tier, whose eviction order a policy decides.

How it reaches vLLM (vllm 0.33.0): the native offloading connector's CPU manager
(``v1/kv_offload/cpu/manager.py``) builds its cache policy by name from the connector's extra config,
``eviction_policy`` and ``cache_policy_module_path`` (``cpu/spec.py``, ``cpu/policies/factory.py``), with no
vLLM change: :func:`connector_extra_config` gives both (serving: ``--kv-offloading-size G
--kv-transfer-config '{"kv_connector_extra_config": {"eviction_policy": "KVPilotCachePolicy",
"cache_policy_module_path": "serving_hook.host_tier"}}'``; the simulator sets them for every engine with a
tier). :class:`KVPilotCachePolicy` is vLLM's own ``LRUCachePolicy`` plus, once the hook binds a
:class:`HostTierLever` to it (:func:`bind`, when the policy sets ``Policy.uses_host_eviction``), an owner
for each chunk: the session (else the request) that stored it or last reused it. When the manager's
``prepare_store`` needs room (``evict(n, protected)``), the lever asks the policy's
:meth:`~policy.interface.Policy.evict_host` for an order over the tier's owners and the storing one (at most once
per engine step and storing owner, under the step's budget, :meth:`~serving_hook.guard.Guard.decide`), and the
chunks of the listed owners go first, each
owner's deepest chunk first; unlisted chunks keep LRU order behind them. Unbound (or ``None`` from the
policy, an exception, an overrun) it is exactly LRU.

**Skipping a store.** ``CachePolicy.insert`` cannot decline a chunk, and a tier with free chunks stores
everything (write-through). Only a full tier can refuse: ``evict`` returns ``None`` when the storing
request's own owner comes before enough room is found in the policy's order (Belady's bypass), and vLLM then
skips that store this step (``prepare_store`` returns ``None``; the connector counts an allocation failure,
logs a warning and offers the blocks again next step). Counted in ``bypassed``.

**Not reachable through this seam** (docs/results/2026-12-03-memory-binds.md describes the upstream
change): declining a store while the tier has room (an ``admit(keys, req_context)`` in ``CachePolicy``, or
``insert`` allowed to decline), and dropping a session's host copy at once (a ``CachePolicy`` cannot free
chunks; the manager owns the chunk pool). Dropping is approximated by listing the owner first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, Optional

from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

from policy.interface import CachedPrefix, EvictionDecision, OwnerState, RequestMeta
from serving_hook.lever import Lever
from serving_hook.translate import owner as owner_key

__all__ = ["KVPilotCachePolicy", "HostTierLever", "connector_extra_config", "find_cache_policy", "bind"]

CACHE_POLICY_NAME = "KVPilotCachePolicy"
CACHE_POLICY_MODULE = "serving_hook.host_tier"
#: vLLM's connector logs a warning for every store the cache policy refuses (an allocation failure to it).
_CONNECTOR_LOGGER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
#: Owners whose meta and last use the lever keeps before it forgets those with nothing in the tier and no request.
MAX_OWNERS = 1 << 16
# enum members as plain names (an Enum class attribute costs ~0.1 µs to read; these run per owner)
_RUNNING, _WAITING, _PAUSED, _FINISHED = (OwnerState.RUNNING, OwnerState.WAITING, OwnerState.PAUSED_TOOL,
                                          OwnerState.FINISHED)


class _BypassLogFilter(logging.Filter):
    """Drops vLLM's "cannot store chunks" warning right after a store kvpilot skipped (counted instead)."""

    pending = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if _BypassLogFilter.pending and "cannot store chunks" in str(record.msg):
            _BypassLogFilter.pending -= 1
            return False
        return True


_FILTER = _BypassLogFilter()
#: Storers in a step (stores that asked its order for room) from which the next step's order ranks every running
#: session at once (see HostTierLever.order).
WIDE_AFTER_STORERS = 3
_perf = time.perf_counter


def connector_extra_config() -> dict[str, str]:
    """The offloading connector's extra config that makes vLLM load :class:`KVPilotCachePolicy`."""
    return {"eviction_policy": CACHE_POLICY_NAME, "cache_policy_module_path": CACHE_POLICY_MODULE}


class KVPilotCachePolicy(LRUCachePolicy):
    """vLLM's LRU host-tier policy, whose eviction order (and store bypass) a bound :class:`HostTierLever` decides."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.kvpilot_lever: Optional[HostTierLever] = None
        self.owner: dict[Any, str] = {}  # chunk key -> owner
        self.owned: dict[str, dict[Any, None]] = {}  # owner -> its chunk keys, in prefix order (an ordered set)
        self.storer: Optional[str] = None  # owner of the request whose store asks for room
        self._rid: Optional[str] = None  # the last inserting request and its owner (inserts come in runs)
        self._rid_owner = ""

    # ---------------------------------------------------------- ownership
    def _own(self, keys: Iterable[Any], owner: str) -> None:
        own, owned = self.owner, self.owned
        mine = owned.get(owner)
        if mine is None:
            mine = owned[owner] = {}
        for k in keys:
            old = own.get(k)
            if old == owner or k not in self.chunks:
                continue
            if old is not None:
                prev = owned.get(old)
                if prev is not None:
                    prev.pop(k, None)
                    if not prev:
                        del owned[old]
            own[k] = owner
            mine[k] = None
        if not mine:
            del owned[owner]

    def _forget(self, key: Any) -> None:
        old = self.owner.pop(key, None)
        if old is not None:
            mine = self.owned.get(old)
            if mine is not None:
                mine.pop(key, None)
                if not mine:
                    del self.owned[old]

    # ------------------------------------------------- CachePolicy overrides
    def insert(self, key: Any, chunk: Any, req_context: Any) -> None:
        super().insert(key, chunk, req_context)
        lever = self.kvpilot_lever
        if lever is None:
            return
        rid = req_context.req_id
        if rid != self._rid:
            self._rid, self._rid_owner = rid, lever.owner_of(rid)
        owner = self._rid_owner
        if self.owner.get(key) is None:  # a new chunk (the common case): no previous owner to leave
            self.owner[key] = owner
            mine = self.owned.get(owner)
            if mine is None:
                mine = self.owned[owner] = {}
            mine[key] = None
        else:
            self._own((key,), owner)

    def remove(self, key: Any) -> None:
        super().remove(key)
        self._forget(key)

    def on_store_miss(self, keys: Iterable[Any], req_context: Any) -> None:
        super().on_store_miss(keys, req_context)
        lever = self.kvpilot_lever
        if lever is None:
            self.storer = None
            return
        t0 = _perf()
        self.storer = lever.used(req_context.req_id)
        lever.stats.side_time_s += _perf() - t0

    def on_request_finished(self, key_groups: Sequence[Sequence[Any]], insertion_only_keys: set,
                            reused_keys: set, req_context: Any) -> None:
        super().on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)
        lever = self.kvpilot_lever
        if lever is not None and reused_keys:  # what it reused is its session's now
            t0 = _perf()
            self._own((k for g in key_groups for k in g if k in reused_keys), lever.used(req_context.req_id))
            lever.stats.side_time_s += _perf() - t0

    def clear(self) -> None:
        super().clear()
        self.owner.clear()
        self.owned.clear()

    def evict(self, n: int, protected: set) -> Optional[list]:
        lever = self.kvpilot_lever
        if n == 0 or lever is None:
            return super().evict(n, protected)
        t0 = _perf()
        try:
            return self._evict_in_order(lever, n, protected)
        except Exception as e:  # never into vLLM's store planning: LRU for this eviction (an order it cannot read
            # raises while picking, before anything is evicted)
            lever.guard.internal_error("evict_host", e)
            return self._evict_lru(n, protected)
        finally:  # the hook's time inside vLLM's schedule() (its store planning), as the GPU eviction lever's
            lever.guard.inner_s += _perf() - t0

    def _evict_in_order(self, lever: HostTierLever, n: int, protected: set) -> Optional[list]:
        """``n`` chunks, the listed owners' first (deepest first), then LRU; None: skip the store (bypass).

        An owner listed twice counts once; an id that is not hashable raises before anything is evicted."""
        _BypassLogFilter.pending = 0  # a skip whose warning never came (its level off) must not hide a real one
        order = lever.order(self, n, self.storer)
        if order is None:
            return self._evict_lru(n, protected)
        storer = self.storer
        evictable, owned = self._evictable, self.owned
        picked: list = []
        seen: set = set()
        for o in order:
            if o in seen:
                continue
            seen.add(o)
            if o == storer:
                lever.stats.host_bypassed += 1
                _BypassLogFilter.pending = 1  # the connector warns next; not a failure
                return None  # keeping what the tier holds is worth more than this store
            for k in reversed(owned.get(o, ())):  # deepest chunk first
                if k in evictable and k not in protected:
                    picked.append(k)
                    if len(picked) == n:
                        break
            if len(picked) == n:
                break
        rest: list = []
        if len(picked) < n:
            got = self._evict_lru(n - len(picked), protected.union(picked))
            if got is None:
                return None
            rest = got
        out = []
        chunks, ranks = self.chunks, self._ranks
        for k in picked:
            evictable.remove(k)
            out.append((k, chunks.pop(k)))
            del ranks[k]
            self._forget(k)
        self._maybe_compact_heap()
        lever.stats.host_evicted_listed += len(picked)
        return out + rest


    def _evict_lru(self, n: int, protected: set) -> Optional[list]:
        """vLLM's LRU eviction of ``n`` chunks; their owners forget them (an owner's tier blocks stay true)."""
        got = super().evict(n, protected)
        if got:
            for k, _ in got:
                self._forget(k)
        return got


class HostTierLever(Lever):
    """Builds the host-tier candidates for the policy's ``evict_host`` and keeps its order for the step."""

    def __init__(self, *parts: Any) -> None:
        super().__init__(*parts)
        self.metas: dict[str, RequestMeta] = {}  # owner -> the meta of its latest request
        self.last_used: dict[str, float] = {}
        self._req_owner: dict[str, str] = {}  # request id -> owner (kept while the tier may still see it)
        self._step = -1
        self._order: Optional[list] = None
        self._ranked: set = set()  # the owners the step's order ranked
        self._listed: list[CachedPrefix] = []  # their candidates
        self._running: dict[str, RequestMeta] = {}  # the step's running owners (their requests' metas)
        self._stale: dict[str, float] = {}  # owner -> its last use the step's order saw, where used() changed it
        self._storers: set = set()  # the owners whose stores asked the step's order for room
        self._late = 0  # the step's running storers its first order did not rank
        self._wide = False  # rank every running session at the step's first eviction (see order)
        self._owned_prefixes: dict[str, CachedPrefix] = {}  # see _prefixes
        self._running_prefixes: dict[str, CachedPrefix] = {}  # see _running_candidates

    def owner_of(self, req_id: str) -> str:
        """The owner of what ``req_id`` stores or reuses: its session, else itself (meta noted for later)."""
        owner = self._req_owner.get(req_id)
        if owner is None:
            info = self.tr.infos.get(req_id)
            if info is None:
                return req_id
            meta = info.meta
            owner = owner_key(meta, req_id)
            self._req_owner[req_id] = owner
            self.metas[owner] = meta
            if len(self._req_owner) > 100_000:  # bound it: the oldest requests are long gone
                for r in list(self._req_owner)[:50_000]:
                    del self._req_owner[r]
        else:
            info = self.tr.infos.get(req_id)
            if info is not None:
                self.metas[owner] = info.meta
        return owner

    def used(self, req_id: str) -> str:
        """``req_id`` stores to or reused the tier now: its owner (the owner's last use is now)."""
        owner = self.owner_of(req_id)
        last = self.last_used
        if self._step == self.guard.step_no and owner not in self._stale:  # the step's order saw the value before
            self._stale[owner] = last.get(owner, 0.0)
        last[owner] = self.sched.kvpilot_clock()
        return owner

    def order(self, cp: KVPilotCachePolicy, n: int, storer: Optional[str]) -> Optional[list]:
        """The policy's owner order for this step, computed at the step's first eviction; a later finished storer it
        did not rank gets a fresh one; None: LRU.

        It is the order over the tier's owners and every running session (each a possible storer) as they stood
        then. Most of those sessions have nothing in the tier (measured at 128 running agent sessions: 60 tier
        owners, 70 such sessions), and in most steps one session stores, so the order ranks the tier's owners and
        the storer; a later running storer joins it, as it stood then, and a third brings in every running
        session. After a step with three storers or more every running session is ranked at once. For a policy
        whose order is a sort by a key of each owner alone (the learned policy's, the oracle's) the order is the
        same either way.
        """
        step = self.guard.step_no
        if step == self._step:
            if storer is None:
                return self._order
            self._storers.add(storer)
            if storer in self._ranked:
                return self._order
            if storer in self._running:  # a later running storer, as it stood at the step's first eviction
                self._late += 1
                late = self._running_candidates(self._stale, only=storer if self._late == 1 else None)
                return self._decide(self._listed + late, n)
            if storer not in self.metas:
                return self._order
        else:
            self._wide = len(self._storers) >= WIDE_AFTER_STORERS
            self._step = step
            self._storers = {storer} if storer is not None else set()
            self._late = 0
        self._stale = {}
        self._order = None
        try:
            prefixes = self._prefixes(cp, storer)
        except Exception as e:  # never into vLLM: LRU for this step
            self._listed, self._ranked = [], set()
            self.guard.internal_error("evict_host", e)
            return None
        return self._decide(prefixes, n)

    def _decide(self, prefixes: list[CachedPrefix], n: int) -> Optional[list]:
        """Ask the policy to order ``prefixes`` (the step's order from now on)."""
        self._listed = prefixes
        self._ranked = {p.prefix_id for p in prefixes}
        self._order = None
        if not prefixes:
            return None
        try:
            now = self.sched.kvpilot_clock()
            self.stats.host_evict_calls += 1
            dec = self.guard.decide("evict_host", self.policy.evict_host, EvictionDecision, prefixes, n,
                                    self.tr.state(now))
            if dec is not None and dec.order:
                self._order = list(dec.order)
        except Exception as e:  # never into vLLM: LRU for this step
            self.guard.internal_error("evict_host", e)
        return self._order

    def _prefixes(self, cp: KVPilotCachePolicy, storer: Optional[str]) -> list[CachedPrefix]:
        infos = self.tr.infos
        owned = cp.owned
        running = self.tr.running_owners()  # owner -> its running request's meta
        paused = self.tr.sessions
        live = self.tr.session_request
        metas, last = self.metas, self.last_used
        pos_of: Optional[dict[str, int]] = None  # request id -> place in the waiting queue (read when first needed)
        made, kept = self._owned_prefixes, {}
        for owner, keys in owned.items():
            meta = running.get(owner)
            pos = None
            if meta is not None:
                state = _RUNNING
            else:  # waiting (its session's live request is queued), paused on a tool, or finished
                rid = live.get(owner, owner)
                info = infos.get(rid)
                if info is not None and not info.running:
                    if pos_of is None:
                        pos_of = {r.request_id: i for i, r in enumerate(self.sched.waiting)}
                    pos = pos_of.get(rid)
                # the meta of the owner's last request that used the tier (a waiting owner's too: its next use is
                # the queued request's, which a hindsight look-up by request must not skip as the owner's own)
                meta = metas.get(owner) or (info.meta if pos is not None else None)
                if meta is None:
                    continue
                state = _WAITING if pos is not None else _PAUSED if owner in paused else _FINISHED
            # kept from step to step while the same (most owners: few change in a step)
            t, n = last.get(owner, 0.0), len(keys)
            p = made.get(owner)
            if (p is None or p.owner_state is not state or p.meta is not meta or p.last_used_s != t
                    or p.tier_blocks != n or p.queue_position != pos):
                p = CachedPrefix(owner, owner, state, meta, (), (), t, tier_blocks=n, queue_position=pos)
            kept[owner] = p
        self._owned_prefixes = kept
        out = list(kept.values())  # (in the tier's owner order)
        self._running = running
        if len(metas) > MAX_OWNERS:
            self._forget_owners(owned, running, paused, live, infos, storer)
        if self._wide:
            out += self._running_candidates({}, owned)
        elif storer is not None and storer in running:  # the storing owner (unless it has blocks in the tier)
            out += self._running_candidates({}, owned, only=storer)
        if storer is not None and storer not in running and storer not in owned and storer in metas:
            # a finished request storing its last blocks, nothing of it in the tier yet
            state = _PAUSED if storer in paused else _FINISHED
            out.append(CachedPrefix(storer, storer, state, metas[storer], (), (), last.get(storer, 0.0)))
        return out

    def _forget_owners(self, owned: dict, running: dict, paused: dict, live: dict, infos: dict,
                       storer: Optional[str]) -> None:
        """Forget the owners with nothing in the tier, no request running, waiting or paused on a tool, that are not
        storing now: one entry per owner that ever used the tier would grow without bound in a long-lived server."""
        keep = [o for o in self.metas
                if o in owned or o in running or o in paused or o in live or o in infos or o == storer]
        self.metas = {o: self.metas[o] for o in keep}
        self.last_used = {o: self.last_used[o] for o in keep if o in self.last_used}

    def _running_candidates(self, stale: dict[str, float], skip: Optional[dict] = None,
                            only: Optional[str] = None) -> list[CachedPrefix]:
        """The step's running owners not ranked yet (not in ``skip``, else not in the step's order; ``only``: that
        one alone), each with its last use as of the step's order (``stale``); their candidates are kept from step
        to step while their request and last use are the same (most of them: few turns end in a step)."""
        skip = self._ranked if skip is None else skip
        last = self.last_used
        made, out = self._running_prefixes, []
        for owner, meta in ((only, self._running[only]),) if only is not None else self._running.items():
            if owner not in skip:
                t = stale.get(owner)
                if t is None:
                    t = last.get(owner, 0.0)
                p = made.get(owner)
                if p is None or p.meta is not meta or p.last_used_s != t:
                    p = made[owner] = CachedPrefix(owner, owner, _RUNNING, meta, (), (), t)
                out.append(p)
        if len(made) > 4 * len(self._running) + 64:  # bound it: drop the owners no longer running
            self._running_prefixes = {o: p for o, p in made.items() if o in self._running}
        return out

    def forget_step(self) -> None:
        """A prefix-cache reset cleared the tier: the step's order is stale."""
        self._step = -1
        self._order = None


def find_cache_policy(sched: Any) -> Optional[KVPilotCachePolicy]:
    """The scheduler's host-tier :class:`KVPilotCachePolicy`, or None (no tier, or another cache policy)."""
    conn = getattr(sched, "connector", None)
    cs = getattr(conn, "connector_scheduler", None)
    manager = getattr(cs, "manager", None)
    policy = getattr(manager, "_policy", None)
    return policy if isinstance(policy, KVPilotCachePolicy) else None


def bind(sched: Any, *parts: Any) -> Optional[HostTierLever]:
    """Bind a new :class:`HostTierLever` to the scheduler's :class:`KVPilotCachePolicy`; None when there is none."""
    cp = find_cache_policy(sched)
    if cp is None:
        return None
    lever = HostTierLever(*parts)
    cp.kvpilot_lever = lever
    log = logging.getLogger(_CONNECTOR_LOGGER)
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    return lever
