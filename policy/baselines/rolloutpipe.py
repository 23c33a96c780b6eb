"""Frontier-group dispatch, after RolloutPipe.

**Idea and source.** RolloutPipe pipelines rollout and training at the
granularity of complete GRPO groups: a group goes to the trainer as soon as all
N of its samples are done, and admission favours the "frontier" groups, those
needed to fill the next training micro-batch, so micro-batches fill early and
training overlaps with the rest of the rollout (reported: -31 to -42%
rollout-to-train-end time vs slime).

**Mechanism as implemented.**

* The frontier is a set of at most ``micro_batch_groups`` groups. It is sticky:
  a group stays in it until it completes (``group_size`` finished requests, or,
  without a size, no request of the group left in the engine), tracked from
  ``ARRIVED`` / ``FINISHED`` events. Free frontier slots are refilled, at each
  admission, from the groups that have waiting requests.
* Groups are ranked by closeness to completion: the fraction of the group
  finished or running (``(group_finished + group_running) / group_size``,
  higher first), then the predicted time to finish its waiting members (the
  largest predicted remaining output among them, from the
  ``length_predictor``, lower first), then the earliest arrival.
* Admission: the frontier groups' waiting members first (frontier order; inside
  a group, shortest predicted first), then the other groups in rank order,
  until as many requests are listed as vLLM can admit this step
  (:func:`policy.common.admission_limit`).
* Preemption: the victim comes from the group farthest from the frontier (not in
  the frontier, least close to completion); inside it, the request with the
  longest predicted remaining output. Only when every candidate belongs to the
  frontier is a frontier member (of the last frontier group) preempted.
* A request without a group is a group of its own (size 1), so without
  metadata the policy is a sticky shortest-predicted-first over
  ``micro_batch_groups`` requests, then the rest.

**Simplified.** RolloutPipe's trainer-side pipelining (streaming complete groups
into micro-batches, overlapping with training) belongs to the RL driver; the
simulator's metrics report group completion times. Multi-turn groups count
finished requests (turns) as the hook does, not finished trajectories.

Deterministic (propensity 1.0).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any, Optional

from policy.common import PredictedLengthPolicy, admission_limit, group_key, group_size
from policy.interface import AdmissionDecision, CandidateRequest, EngineState, Event, EventKind, PreemptionDecision


class FrontierGroupPolicy(PredictedLengthPolicy):
    """Admit the members of the groups that complete the next micro-batch first."""

    name = "rolloutpipe"
    version = "1"
    uses_admission = True
    uses_preemption = True

    def __init__(
        self,
        micro_batch_groups: int = 4,
        length_predictor: Any = "oracle",
        max_groups: int = 1 << 16,
        workload: Any = None,
    ) -> None:
        for opt, v in (("micro_batch_groups", micro_batch_groups), ("max_groups", max_groups)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"option {opt} must be an integer >= 1, got {v!r}")
        self.micro_batch_groups = micro_batch_groups
        self.max_groups = max_groups
        super().__init__(length_predictor, workload)
        #: frontier group keys, in the order they joined (dict as an ordered set)
        self.frontier: dict[tuple, None] = {}
        #: group key -> [live requests, finished requests, size or None]
        self._groups: dict[tuple, list] = {}
        #: frontier groups that completed, in completion order (bounded; for tests and reports)
        self.completed: list[tuple] = []

    # ------------------------------------------------------------- state
    def on_event(self, event: Event) -> None:
        super().on_event(event)
        kind = event.kind
        if kind is not EventKind.ARRIVED and kind is not EventKind.FINISHED:
            return
        meta = event.meta
        gk = ("g", meta.group_id) if meta.group_id is not None else ("r", event.request_id)
        g = self._groups.get(gk)
        if g is None:
            if kind is EventKind.FINISHED:
                return
            if len(self._groups) >= self.max_groups:
                old = next(iter(self._groups))
                del self._groups[old]
                self.frontier.pop(old, None)
            size = (meta.group_size or None) if meta.group_id is not None else 1
            g = self._groups[gk] = [0, 0, size]
        if kind is EventKind.ARRIVED:
            g[0] += 1
            return
        g[0] = max(0, g[0] - 1)
        g[1] += 1
        if (g[2] is not None and g[1] >= g[2]) or (g[2] is None and g[0] == 0):
            del self._groups[gk]
            if gk in self.frontier:
                del self.frontier[gk]
                self.completed.append(gk)
                if len(self.completed) > 4096:
                    del self.completed[:2048]

    # --------------------------------------------------------- decisions
    @staticmethod
    def _closeness(c: CandidateRequest) -> float:
        n = group_size(c)
        done = c.group_finished + c.group_running
        if n is None:
            return done / (done + 1.0)
        return min(1.0, done / n)

    def _base(self, cands: list) -> list[tuple]:
        """Per-request part of the ranking, cached: (group, closeness, remaining, arrival, id)."""
        rem = self.remaining(cands)
        closeness = self._closeness
        return [(group_key(c), closeness(c), r, c.arrival_s, c.request_id) for c, r in zip(cands, rem)]

    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        base = self.cached_keys(waiting, self._base)
        # per group: [-closeness, largest remaining of its waiting members, first arrival, group, members]
        info: dict[tuple, list] = {}
        for b in base:
            gk = b[0]
            e = info.get(gk)
            if e is None:
                info[gk] = [-b[1], b[2], b[3], gk, [b]]
            else:
                if b[2] > e[1]:
                    e[1] = b[2]
                if b[3] < e[2]:
                    e[2] = b[3]
                e[4].append(b)
        frontier = self.frontier
        groups = self._groups
        for gk in [gk for gk in frontier if gk not in groups and gk not in info]:
            del frontier[gk]  # not tracked by events and nothing waits: nothing left to favour
        limit = admission_limit(state, len(waiting))
        free = self.micro_batch_groups - len(frontier)
        ranks = [(e[0], e[1], e[2], gk) for gk, e in info.items() if gk not in frontier]
        if free > 0 and ranks:
            for r in heapq.nsmallest(free, ranks):
                frontier[r[3]] = None
            ranks = [r for r in ranks if r[3] not in frontier]
        order: list[str] = []

        def emit(members: list) -> None:
            if len(members) > 1:
                members = sorted(members, key=lambda b: (b[2], b[3], b[4]))
            order.extend(b[4] for b in members)

        for gk in frontier:  # frontier groups first, in the order they joined
            e = info.get(gk)
            if e is not None:
                emit(e[4])
        if len(order) < limit and ranks:
            for r in heapq.nsmallest(limit - len(order), ranks) if len(ranks) > limit else sorted(ranks):
                emit(info[r[3]][4])
                if len(order) >= limit:
                    break
        return AdmissionDecision(order=order)

    def preempt(self, running: Sequence[CandidateRequest], state: EngineState) -> Optional[PreemptionDecision]:
        if not running:
            return None
        rem = self.remaining(running)
        fpos = {gk: i for i, gk in enumerate(self.frontier)}
        big = len(fpos)

        def key(i: int) -> tuple:
            c = running[i]
            p = fpos.get(group_key(c))
            # outside the frontier first (largest key), least close, longest remaining, latest arrival
            return (big if p is None else p, -self._closeness(c), rem[i], c.arrival_s, c.request_id)

        i = max(range(len(running)), key=key)
        return PreemptionDecision(victim=running[i].request_id)
