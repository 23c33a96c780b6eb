"""Retention lever: which of a finished request's cached blocks are protected (pinned with a TTL) or demoted.

How it reaches vLLM (line numbers: ``vllm/v1/core/sched/scheduler.py`` of vllm 0.33.0): ``_free_blocks``
(L3064; finished requests only, not preemption) is overridden to note the request's hashed blocks before
vLLM frees them to the free-list tail (:meth:`RetentionLever.note_freed`). At the start of the next
``schedule()`` (nothing allocates in between), the policy decides (:meth:`RetentionLever.before_step`):
protect (pin with TTL via :class:`serving_hook.pins.BlockPoolAdapter`), demote (free-list head), offload
(with a CPU offload tier, :mod:`serving_hook.offload`: the tier already holds the blocks vLLM stored, so the
GPU copy is demoted and the tier serves the return; without one, keep) or keep.
Pins are released on expiry (checked at each ``schedule()``), on the policy's order, under pressure
(before vLLM would preempt a running request, :meth:`RetentionLever.release_one`: see
:mod:`serving_hook.preemption`), when nothing runs and the next waiting request does not fit (liveness),
and before ``reset_prefix_cache`` (L3184; ``block_pool.py`` L871 refuses to reset while blocks are held).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from policy.interface import CachedPrefix, OwnerState, Policy, RequestMeta, RetentionAction, RetentionDecision
from serving_hook.guard import Guard
from serving_hook.lever import Lever
from serving_hook.pins import BlockPoolAdapter
from serving_hook.rows import Rows
from serving_hook.translate import EngineView, Freed, Translator, hashes64, plain_hash


@dataclass(slots=True)
class PinInfo:
    """What the lever knows of a pinned prefix beyond its blocks (for the policy's next ``retain()``)."""

    meta: RequestMeta
    owner_state: OwnerState
    hashes: list
    last_used_s: float
    hits: int = 0
    hashes64: Optional[tuple] = None  # int64 hashes, computed once (retain() lists every pin each time)


class RetentionLever(Lever):
    """Asks the policy what to do with freed prefixes and pins, and keeps the pins."""

    def __init__(
        self, sched: EngineView, policy: Policy, guard: Guard, tr: Translator, rows: Rows, max_pinned_blocks: int
    ) -> None:
        super().__init__(sched, policy, guard, tr, rows)
        self.tier = tr.offload_blocks > 0  # a CPU offload tier holds what vLLM stored (serving_hook.offload)
        self.pins = BlockPoolAdapter(tr.pool, max_pinned_blocks)
        self.freed: list[Freed] = []  # freed since the last step, waiting for retain()
        self.pin_info: dict[str, PinInfo] = {}

    def note_freed(self, freed: Freed) -> None:
        """A finished request's cached blocks, for the next step's decision."""
        self.freed.append(freed)

    def before_step(self, now: float) -> None:
        """At ``schedule()``: release expired pins, then let the policy decide on what was freed."""
        for pid in self.pins.release_expired(now):
            self.pin_info.pop(pid, None)
        if self.freed:
            self._retain(now)

    def release_one(self) -> bool:
        """Release the pin that expires soonest (pressure); False when none is left."""
        pid = self.pins.release_one_for_pressure()
        if pid is None:
            return False
        self.pin_info.pop(pid, None)
        return True

    def release_all(self) -> None:
        """Release every pin and forget what was freed (before a prefix-cache reset)."""
        self.pins.release_all()
        self.pin_info.clear()
        self.freed.clear()

    def session_resumed(self, session_id: str) -> None:
        """The session's tool returned (its next turn arrived): its pinned prefixes' owner runs again."""
        for pi in self.pin_info.values():
            if pi.meta.session_id == session_id and pi.owner_state is OwnerState.PAUSED_TOOL:
                pi.owner_state = OwnerState.RUNNING

    def note_hits(self, heads: list, now: float) -> None:
        """Admitted requests hit the cache from these first blocks: count a hit on each pin that starts there."""
        pin_info = self.pin_info
        for h0 in heads:
            for pi in pin_info.values():
                if pi.hashes and plain_hash(pi.hashes[0]) == h0:
                    pi.hits += 1
                    pi.last_used_s = now

    def _retain(self, now: float) -> None:
        freed = self.freed
        self.freed = []
        pins = self.pins
        pin_info = self.pin_info
        groups = self.tr.groups
        prefixes: list[CachedPrefix] = []
        by_id: dict[str, tuple] = {}
        for f in freed:
            g = groups.get(f.meta.group_id) if f.meta.group_id is not None else None
            pending = max(0, (f.meta.group_size or 0) - g[4]) if g is not None and f.meta.group_size else 0
            cp = CachedPrefix(
                prefix_id=f.request_id,
                owner_request_id=f.request_id,
                owner_state=f.owner_state,
                meta=f.meta,
                block_ids=tuple(b.block_id for b in f.blocks),
                block_hashes=hashes64(f),
                last_used_s=f.time_s,
                group_pending=pending,
            )
            prefixes.append(cp)
            by_id[f.request_id] = ("freed", f)
        for pid, pin in pins.pins.items():
            if pid in by_id:
                continue
            pi = pin_info.get(pid)
            if pi is None:
                continue
            prefixes.append(
                CachedPrefix(
                    prefix_id=pid,
                    owner_request_id=pid,
                    owner_state=pi.owner_state,
                    meta=pi.meta,
                    block_ids=tuple(b.block_id for b in pin.blocks),
                    block_hashes=hashes64(pi)[: len(pin.blocks)],
                    last_used_s=pi.last_used_s,
                    hits=pi.hits,
                    protected_until_s=pin.expires_at,
                )
            )
            by_id[pid] = ("pinned", pin)
        dec = self.guard.decide("retain", self.policy.retain, RetentionDecision, prefixes, self.tr.state(now))
        if dec is None:
            return
        if dec.release:
            for pid in pins.release_policy(dec.release):
                pin_info.pop(pid, None)
        st = self.stats
        log = self.rows.log_decisions
        listed = {cp.prefix_id: cp for cp in prefixes} if log else None
        for pid, ret in (dec.actions or {}).items():
            entry = by_id.get(pid)
            if entry is None:
                continue
            action = ret.action
            if action is RetentionAction.PROTECT:
                if entry[0] == "freed":
                    f = entry[1]
                    n = pins.protect(pid, f.blocks, f.hashes, ret.ttl_s, now)
                    if n:
                        pin_info[pid] = PinInfo(f.meta, f.owner_state, f.hashes, f.time_s, hashes64=f.hashes64)
                        st.protected += 1
                else:
                    pins.protect(pid, (), (), ret.ttl_s, now)  # renew
            elif action is RetentionAction.OFFLOAD and not self.tier:
                st.offload_unavailable += 1  # no CPU tier: KEEP (a pin is released to vLLM's LRU)
                if entry[0] == "pinned":
                    pins.release_policy((pid,))
                    pin_info.pop(pid, None)
            elif action is RetentionAction.DEMOTE or action is RetentionAction.OFFLOAD:
                if action is RetentionAction.OFFLOAD:
                    st.offloaded += 1  # the tier holds its blocks: the GPU copy goes first
                if entry[0] == "pinned":
                    pin = entry[1]
                    blocks = list(pin.blocks)
                    hashes = [b.block_hash for b in blocks]
                    pins.release_policy((pid,))
                    pin_info.pop(pid, None)
                else:
                    blocks, hashes = entry[1].blocks, entry[1].hashes
                st.demoted_blocks += pins.demote(blocks, hashes)
            if log:
                ttl_s = ret.ttl_s if action is RetentionAction.PROTECT else None
                self.rows.prefix_decision(now, [listed[pid]], dec.predictions, 0, ret.propensity, action.value, ttl_s)
