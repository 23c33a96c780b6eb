"""Longest-group-first with sibling probing, after Seer.

**Idea and source.** Seer (Moonshot AI, online context learning for RL
rollouts) notes that the samples of one GRPO group have similar lengths. It
runs one "speculative" request of each group early to probe the group's length,
then schedules the groups likely to run longest first: longest-processing-time
first (LPT) shortens the makespan, since long groups no longer start last and
form the tail (reported: +74-97% rollout throughput, -72-94% tail latency).

**Mechanism as implemented.**

* Probing (``probe=True``): a group none of whose members has been scheduled or
  finished (``group_running + group_finished == 0``) is unprobed. One member of
  each unprobed group (a preempted one if any, else the earliest arrival) goes
  before every other waiting request. Probes are ordered longest estimate
  first.
* Group length estimate: from the group's finished siblings when there are any
  (``sibling_output_tokens``: their maximum, or mean with
  ``group_estimate="mean"``); otherwise from the ``length_predictor`` (the
  largest p50, capped by ``max_tokens``, among the group's members predicted so
  far); never less than what the request already generated. Estimates are
  cached per request and recomputed when the group's counts change.
* Then every other waiting request in LPT order: longest group estimate first,
  a group's members together (by the group's first arrival), then arrival.
* Preemption: the victim comes from the group with the shortest estimate;
  inside it, the request that generated least (least work lost), then the
  latest arrival.
* A request without a group (or of a group of size 1) is its own group, not
  probed, ranked by its own prediction: without metadata and with an
  uninformative predictor the policy is FCFS.

**Simplified.** Seer also splits requests into chunks to balance memory
(divided rollout) and uses speculative decoding with a shared suffix tree; only
the scheduling idea is kept. A running probe's partial length is not used as a
lower bound for its waiting siblings (running requests are not admission
candidates); the estimate updates when the probe finishes.

Deterministic (propensity 1.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import Any, Optional

from policy.common import PredictedLengthPolicy, admission_limit, top_ids
from policy.interface import AdmissionDecision, CandidateRequest, EngineState, PreemptionDecision

GROUP_ESTIMATES: tuple[str, ...] = ("max", "mean")


def _is_grouped(c: CandidateRequest) -> bool:
    return c.meta.group_id is not None and c.meta.group_size != 1


class LongestGroupFirstPolicy(PredictedLengthPolicy):
    """Probe one sibling per group, then run the longest predicted groups first."""

    name = "seer"
    version = "1"
    uses_admission = True
    uses_preemption = True

    def __init__(
        self,
        length_predictor: Any = "oracle",
        probe: bool = True,
        group_estimate: str = "max",
        workload: Any = None,
    ) -> None:
        if not isinstance(probe, bool):
            raise ValueError(f"option probe must be true or false, got {probe!r}")
        if group_estimate not in GROUP_ESTIMATES:
            raise ValueError(
                f"option group_estimate must be one of {', '.join(GROUP_ESTIMATES)}, got {group_estimate!r}"
            )
        self.probe = probe
        self.group_estimate = group_estimate
        self.max_groups = 1 << 16
        super().__init__(length_predictor, workload)
        #: group id -> largest predicted length / first arrival seen among its members
        self._group_pred: dict[str, float] = {}
        self._group_first: dict[str, float] = {}

    def _note_groups(self, cands: Sequence[CandidateRequest], preds: list) -> None:
        """Remember each group's largest predicted length and first arrival."""
        gp, gf = self._group_pred, self._group_first
        if len(gp) > self.max_groups:
            for d in (gp, gf):
                for k in list(islice(d, len(d) // 2)):
                    del d[k]
        for c, (p50, _) in zip(cands, preds):
            gid = c.meta.group_id
            if gid is None:
                continue
            own = min(p50, float(c.max_tokens)) if c.max_tokens else p50
            if own > gp.get(gid, -1.0):
                gp[gid] = own
            a = gf.get(gid)
            if a is None or c.arrival_s < a:
                gf[gid] = c.arrival_s

    def _compute(self, cands: list) -> list[tuple]:
        """Cached per request: (-group estimate, group first arrival, group, arrival, id)."""
        preds = self.lengths.lookup(cands)
        self._note_groups(cands, preds)
        mean = self.group_estimate == "mean"
        gp, gf = self._group_pred, self._group_first
        out = []
        for c, (p50, _) in zip(cands, preds):
            own = min(p50, float(c.max_tokens)) if c.max_tokens else p50
            sibs = c.sibling_output_tokens
            if _is_grouped(c):
                gid = c.meta.group_id
                if sibs:
                    est = float(sum(sibs) / len(sibs) if mean else max(sibs))
                else:
                    est = gp.get(gid, own)
                first = gf.get(gid, c.arrival_s)
                gk = ("g", gid)
            else:
                est, first, gk = own, c.arrival_s, ("r", c.request_id)
            est = max(est, float(c.num_output_tokens))
            out.append((-est, first, gk, c.arrival_s, c.request_id))
        return out

    def estimates(self, cands: Sequence[CandidateRequest]) -> list[float]:
        """Each candidate's group length estimate (output tokens)."""
        return [-k[0] for k in self.cached_keys(cands, self._compute)]

    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        keys = self.cached_keys(waiting, self._compute)
        limit = admission_limit(state, len(waiting))
        if not self.probe:
            return AdmissionDecision(order=top_ids(keys, limit))
        # one probe per unprobed group: a preempted member if any, else the earliest arrival
        probes: dict[str, tuple] = {}
        for c, k in zip(waiting, keys):
            if c.group_running or c.group_finished or not _is_grouped(c):
                continue
            gid = c.meta.group_id
            pk = (-c.num_output_tokens, c.arrival_s, c.request_id)
            cur = probes.get(gid)
            if cur is None or pk < cur[0]:
                probes[gid] = (pk, k)
        if not probes:
            return AdmissionDecision(order=top_ids(keys, limit))
        first = top_ids([k for _, k in probes.values()], limit)
        if len(first) < limit:
            chosen = set(first)
            rest = [k for k in keys if k[-1] not in chosen]
            first.extend(top_ids(rest, limit - len(first)))
        return AdmissionDecision(order=first)

    def preempt(self, running: Sequence[CandidateRequest], state: EngineState) -> Optional[PreemptionDecision]:
        if not running:
            return None
        est = self.estimates(running)
        i = min(
            range(len(running)),
            key=lambda j: (est[j], running[j].num_output_tokens, -running[j].arrival_s, running[j].request_id),
        )
        return PreemptionDecision(victim=running[i].request_id)
