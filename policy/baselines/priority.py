"""vLLM's priority scheduling mode (``--scheduling-policy priority``), as a policy.

**Idea and source.** vLLM (v1 scheduler, ``SchedulingPolicy.PRIORITY``) keeps
the waiting queue as a heap on ``(priority, arrival_time)`` (lower value first)
and, when a running request cannot get blocks, preempts the running request
with the largest ``(priority, arrival_time)``: the least important, newest one.

**Mechanism as implemented.**

* Admission: waiting requests ordered by ``(priority, arrival, request id)``
  (only as many as vLLM can admit this step are listed, see
  :func:`policy.common.admission_limit`).
  Preempted requests are ordered like the others (vLLM's FCFS mode would put
  them in front; its priority mode, like this policy, does not).
* Preemption: the victim is the candidate with the largest
  ``(priority, arrival, request id)``.
* ``priority`` is the request's own ``priority`` (``CandidateRequest.priority``,
  vLLM's ``Request.priority``). RL frameworks (veRL, OpenRLHF, slime, ROLL)
  rarely set it, so with the default every request has priority 0 and this
  policy degenerates to FCFS by arrival. Option ``priority_from`` derives a
  priority from kvpilot's metadata instead, placed before the request's own
  priority in the key:

  - ``"request"`` (default): the request's own priority only;
  - ``"turn"``: ``-turn``, later turns of a multi-turn trajectory go first;
  - ``"step"``: the RL step (policy version), older steps go first (useful
    with asynchronous RL, whose staleness bound is set by the oldest step).

  Missing metadata counts as turn 0 / a step after every known one.

**Simplified.** The hook can preempt only among the running requests vLLM has
not scheduled yet in the current step (``PreemptionDecision``), while vLLM's
priority mode takes the maximum over all running requests and unschedules it
if needed. Running with vLLM's own ``--scheduling-policy priority`` instead
leaves both levers to vLLM (the hook does not touch a priority heap).

The policy is deterministic (propensity 1.0) and keeps no state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable, Optional

from policy.common import admission_limit, top_ids
from policy.interface import (
    AdmissionDecision,
    CandidateRequest,
    EngineState,
    Policy,
    PreemptionDecision,
)

PRIORITY_SOURCES: tuple[str, ...] = ("request", "turn", "step")


def _key_request(c: CandidateRequest) -> tuple:
    return (c.priority, c.arrival_s, c.request_id)


def _key_turn(c: CandidateRequest) -> tuple:
    return (-(c.meta.turn or 0), c.priority, c.arrival_s, c.request_id)


def _key_step(c: CandidateRequest) -> tuple:
    step = c.meta.step
    return (step if step is not None else math.inf, c.priority, c.arrival_s, c.request_id)


_KEYS: dict[str, Callable[[CandidateRequest], tuple]] = {
    "request": _key_request,
    "turn": _key_turn,
    "step": _key_step,
}


class VllmPriorityPolicy(Policy):
    """Admission by (priority, arrival); preempt the max (priority, arrival)."""

    name = "vllm-priority"
    version = "1"
    uses_admission = True
    uses_preemption = True

    def __init__(self, priority_from: str = "request", length_predictor: Any = None, workload: Any = None) -> None:
        # length_predictor / workload are accepted so every baseline takes the
        # same common options; this policy uses neither.
        if priority_from not in _KEYS:
            raise ValueError(f"priority_from must be one of {', '.join(PRIORITY_SOURCES)}, got {priority_from!r}")
        self.priority_from = priority_from
        self._key = _KEYS[priority_from]

    def sort_key(self, c: CandidateRequest) -> tuple:
        """Smaller is more important (admitted first, preempted last)."""
        return self._key(c)

    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        key = self._key
        return AdmissionDecision(order=top_ids([key(c) for c in waiting], admission_limit(state, len(waiting))))

    def preempt(self, running: Sequence[CandidateRequest], state: EngineState) -> Optional[PreemptionDecision]:
        if not running:
            return None
        return PreemptionDecision(victim=max(running, key=self._key).request_id)
