"""Admission lever: the order in which waiting requests may take KV blocks, and who is held back this step.

How it reaches vLLM (line numbers: ``vllm/v1/core/sched/scheduler.py`` of vllm 0.33.0): vLLM admits
inline in ``schedule()`` (L699): only when the running loop preempted nobody (L1050), it peeks/pops
``self.kv_holding_waiting`` first, then ``self.waiting`` (L1062-L1065), and stops at the first request
whose ``allocate_slots`` fails (L1435-L1463). Before calling ``super().schedule()`` the hook re-orders
the ``FCFSRequestQueue`` (a deque) in place to the policy's order, and takes the held-back requests out
of it; they are put back right after the step (``finally``), so they keep the policy's order, and no request
is lost. A policy may hold back every waiting request even with free blocks (to keep paused sessions' KV
until their tools return), but not for ever: a request that has waited ``max_hold_s`` (the hook's
starvation bound, ``KVPILOT_MAX_HOLD_S``, or the decision's own ``hold_bound_s``) since its arrival is not held
(counted in ``hold_overridden``).
Requests in
``kv_holding_waiting`` are not candidates (vLLM always drains them first). With
``--scheduling-policy priority`` the queue is a heap and this lever is left to vLLM (logged once).

An engine whose every waiting request is held and nothing runs would otherwise spin through empty steps: the
scheduler then waits (:mod:`serving_hook.idle`) for a new input or the first hold's release
(:meth:`AdmissionLever.idle_release_s`), and a decision that repeats on an unchanged queue while nothing runs
is not logged again (``quiet_ids``).
"""

from __future__ import annotations

from typing import Any, Optional

from policy.common import to_front
from policy.interface import AdmissionDecision, Policy
from serving_hook.guard import Guard
from serving_hook.lever import Lever
from serving_hook.rows import Rows
from serving_hook.translate import EngineView, Translator

#: Without the engine's input queue (an in-process engine), an idle held step's wait before the next one:
#: doubling from the first to the last (a new request then waits at most this long to be seen).
IDLE_WAIT_FIRST_S = 0.002
IDLE_WAIT_MAX_S = 0.05
#: Orders up to this long are placed by a scan of the queue's ids per request, longer ones through a dict.
_SCANNED = 16


def _keeps_order(order: Any, reqs: list, ids: Optional[tuple] = None) -> bool:
    """True when ``order`` lists the first ``len(order)`` requests in their own order (nothing moves).

    ``ids``: the requests' ids as a tuple, when known (then one C-level comparison, no read of the requests)."""
    if len(order) > len(reqs):
        return False
    if ids is not None:
        return tuple(order) == ids[:len(order)]
    return all(rid == r.request_id for rid, r in zip(order, reqs))


def _positions(order: Any, ids: tuple) -> list[int]:
    """The places in ``ids`` of the order's requests (unknown and repeated ids skipped), in the order's order.

    An order lists as many requests as vLLM can admit in the step, usually a few of hundreds: each is found by a
    scan in C (a longer order through a dict of the queue's places)."""
    picked: list[int] = []
    if len(order) <= _SCANNED:
        for rid in order:
            if rid in ids:
                i = ids.index(rid)
                if i not in picked:
                    picked.append(i)
    else:
        pos = {rid: i for i, rid in enumerate(ids)}
        seen: set = set()
        for rid in order:
            i = pos.get(rid)
            if i is not None and i not in seen:
                seen.add(i)
                picked.append(i)
    return picked


def _reordered(order: Any, reqs: list, ids: Optional[tuple]) -> list:
    """``reqs`` in ``order`` (request ids; unknown and repeated ones skipped), then the rest in their own order.

    ``ids``: the requests' ids as a tuple, when known (then no request is read: positions only, the rest copied in
    slices between them)."""
    if ids is None:
        ids = tuple([r.request_id for r in reqs])
    return to_front(reqs, _positions(order, ids))


def _to_front(queue: Any, picked: list[int]) -> None:
    """Move the requests at ``picked`` (places in ``queue``) to its front in that order; the rest keep theirs.

    The same queue as ``_reordered`` builds, in place: a deque deletes by index by moving pointers, so the hundreds
    of requests between are not touched (a rebuilt queue reads each one, cold in the CPU caches, twice)."""
    front = [queue[i] for i in picked]
    for i in sorted(picked, reverse=True):
        del queue[i]
    queue.extendleft(reversed(front))


class AdmissionLever(Lever):
    """Re-orders vLLM's FCFS waiting queue to the policy's order before each step, holding some back."""

    def __init__(self, sched: EngineView, policy: Policy, guard: Guard, tr: Translator, rows: Rows,
                 max_hold_s: float) -> None:
        super().__init__(sched, policy, guard, tr, rows)
        self.max_hold_s = max_hold_s
        #: The waiting queue's ids after an idle held step (nothing ran): the same queue next step logs no row.
        self.quiet_ids: Optional[tuple] = None
        self.logged = False  # this step's decision was logged
        self._idle_s = 0.0
        self._holding: set[str] = set()  # the requests the last step held
        self.bound_s = max_hold_s  # the last decision's hold bound (AdmissionDecision.hold_bound_s)

    def admit(self, now: float) -> tuple[list, Optional[list]]:
        """Ask the policy and re-order ``waiting``: ``(held-back requests, the full order)`` for :meth:`restore`.

        ``([], None)`` when nothing changed or vLLM could admit nobody this step. Each request's held time
        (``ReqInfo.held_s``) runs from the first step that holds it to the first that does not.
        """
        held, desired = self._admit(now)
        if held or self._holding:
            self._held_time(held, now)
        return held, desired

    def _held_time(self, held: list, now: float) -> None:
        """Start the holds of ``held`` not under way; end those under way that this step did not hold."""
        infos = self.tr.infos
        ids = {r.request_id for r in held}
        for rid in self._holding - ids:
            info = infos.get(rid)
            if info is not None and info.held_at is not None:
                info.held_s += now - info.held_at
                info.held_at = None
        for rid in ids - self._holding:
            info = infos.get(rid)
            if info is not None:
                info.held_at = now
        self._holding = ids

    def _admit(self, now: float) -> tuple[list, Optional[list]]:
        """:meth:`admit` but the held time."""
        sched = self.sched
        waiting = sched.waiting
        # vLLM admits nobody while the running set is full (L1072-L1074): skip the policy.
        if not waiting or len(sched.running) + sched.num_waiting_for_streaming_input >= sched.max_num_active_reqs:
            return [], None
        reqs = list(waiting)
        cands = self.tr.offer(reqs, now, self.policy.lazy_candidates)
        dec = self.guard.decide("admit", self.policy.admit, AdmissionDecision, cands, self.tr.state(now))
        if dec is None:
            return [], None
        order = dec.order
        ids = getattr(cands, "request_ids", None)
        ids = ids if isinstance(ids, tuple) else None
        hold = dec.hold
        if isinstance(hold, str):  # one id, not its substrings
            hold = (hold,)
        if not hold and ids is not None:
            return self._front(order, ids, cands, dec, now)
        if order is None or _keeps_order(order, reqs, ids):
            ordered = reqs
        else:
            ordered = _reordered(order, reqs, ids)
        held = [r for r in ordered if r.request_id in hold] if hold else []
        if held:
            bound = dec.hold_bound_s
            self.bound_s = self.max_hold_s if bound is None or not bound >= 0 else float(bound)
            limit = now - self.bound_s
            starved = [r for r in held if r.arrival_time <= limit]
            if starved:
                self.stats.hold_overridden += len(starved)
                held = [r for r in held if r.arrival_time > limit]
        self.logged = self.rows.log_decisions and self._not_quiet(
            ids if ids is not None else tuple(r.request_id for r in reqs))
        if self.logged:
            first = ordered[0].request_id if ordered else None
            idx = next((i for i, c in enumerate(cands) if c.request_id == first), -1)
            action = f"hold:{len(held)}" if held else None
            self.rows.request_decision("admit", now, cands, dec.predictions, idx, dec.propensity, action)
        changed = ordered is not reqs and ordered != reqs  # (vLLM's requests compare by identity)
        if not changed and not held:
            return [], None
        waiting.clear()
        if held:
            heldset = {id(r) for r in held}
            waiting.extend(r for r in ordered if id(r) not in heldset)
        else:
            waiting.extend(ordered)
        st = self.stats
        if changed:
            st.admission_reorders += 1
        st.held += len(held)
        return held, ordered

    def _front(self, order: Any, ids: tuple, cands: Any, dec: AdmissionDecision, now: float) -> tuple[list, None]:
        """A decision that holds nobody: its order to the queue's front, in place (see :func:`_to_front`)."""
        picked = _positions(order, ids) if order is not None else []
        self.logged = self.rows.log_decisions and self._not_quiet(ids)
        if self.logged:
            idx = picked[0] if picked else (0 if ids else -1)
            self.rows.request_decision("admit", now, cands, dec.predictions, idx, dec.propensity, None)
        if picked != list(range(len(picked))):
            _to_front(self.sched.waiting, picked)
            self.tr.moved(picked)
            self.stats.admission_reorders += 1
        return [], None

    def _not_quiet(self, ids: tuple) -> bool:
        """A decision over the queue ``ids`` that does not repeat an idle held step's (nothing running, the same
        queue): it is logged."""
        return bool(self.sched.running) or self.quiet_ids is None or self.quiet_ids != ids

    def idle_release_s(self, held: list, now: float) -> float:
        """After a step that ran nothing because of ``held``: seconds until the first hold's release by
        ``max_hold_s``. Marks the queue quiet."""
        self.quiet_ids = tuple(r.request_id for r in self.sched.waiting)
        return max(0.0, min(r.arrival_time for r in held) + self.bound_s - now)

    def fallback_s(self) -> float:
        """The next wait of an idle held engine that cannot wait for its inputs: growing while idle."""
        self._idle_s = min(max(2 * self._idle_s, IDLE_WAIT_FIRST_S), IDLE_WAIT_MAX_S)
        return self._idle_s

    def busy(self) -> None:
        """A step that ran something, or held nobody: the next idle step starts a fresh wait and logs."""
        self.quiet_ids = None
        self._idle_s = 0.0

    def restore(self, held: list, desired: Optional[list]) -> None:
        """Put held-back requests back into ``waiting`` in the policy's order.

        Requests vLLM put in front during the step (preempted ones) stay in front.
        """
        waiting = self.sched.waiting
        pos = {id(r): i for i, r in enumerate(desired or held)}
        rest = list(waiting)
        front = [r for r in rest if id(r) not in pos]
        tail = [r for r in rest if id(r) in pos] + [r for r in held if not r.is_finished()]
        tail.sort(key=lambda r: pos[id(r)])
        waiting.clear()
        waiting.extend(front)
        waiting.extend(tail)
