"""Progressive priority for long-tail trajectories, after Heddle.

**Idea and source.** Heddle (trajectory-centric scheduling for agentic RL)
observes that an agent trajectory re-enters the queue after every tool call; under
FCFS each returning turn queues behind fresh short turns, so the longest
trajectories, which set the step's makespan, wait the most. Its progressive
priority makes a trajectory's priority grow with its progress, so returning
turns of long trajectories go first. (Heddle also predicts runtimes and places
and migrates trajectories across workers during tool pauses.)

**Mechanism as implemented.** Each trajectory (``session_id``) has a progress
score, in tokens:

    progress = turn_weight_tokens * turn + session_output_tokens + generated

* ``turn``: the larger of the request's ``turn`` metadata and the number of the
  session's turns seen finishing;
* ``session_output_tokens``: output tokens of the session's finished turns,
  tracked from ``FINISHED`` events (``uses_events``);
* ``generated``: this turn's own output so far (preempted or running requests).

Admission: highest progress first (ties: shorter predicted output first when a
``length_predictor`` is given, then arrival). Preemption: the victim is the
least-progressed trajectory among the candidates (ties: the latest arrival). A
request without a session is a fresh one-turn trajectory (progress = its own
``turn`` and generated tokens), so without metadata the policy is FCFS. In
vLLM a request always has one: when the framework sends none, the serving hook
infers it from the block-hash chain (``docs/session-identity.md``).

**Simplified.** No placement or migration across replicas (routing is
elsewhere), and no runtime predictor by default (``length_predictor=None``;
a predictor only breaks ties). Progress is a linear score of turns and tokens,
not Heddle's exact priority function. Session state is bounded
(``max_sessions``, least recently updated dropped first).

Deterministic (propensity 1.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from policy.common import (
    LengthCache,
    admission_limit,
    resolve_length_predictor,
    top_ids,
)
from policy.interface import (
    AdmissionDecision,
    CandidateRequest,
    EngineState,
    Event,
    EventKind,
    Policy,
    PreemptionDecision,
)
from policy.options import check_positive
from policy.session_progress import TURN_WEIGHT_TOKENS, SessionProgress


class ProgressivePriorityPolicy(Policy):
    """The most-progressed trajectory first; preempt the least-progressed."""

    name = "heddle"
    version = "1"
    uses_admission = True
    uses_preemption = True
    uses_events = True

    def __init__(
        self,
        turn_weight_tokens: float = TURN_WEIGHT_TOKENS,
        length_predictor: Any = None,
        max_sessions: int = 1 << 16,
        workload: Any = None,
    ) -> None:
        self.turn_weight_tokens = check_positive("turn_weight_tokens", turn_weight_tokens, allow_zero=True)
        self.tracker = SessionProgress(self.turn_weight_tokens, max_sessions)
        self.max_sessions = max_sessions
        self.predictor = None
        self.lengths: Optional[LengthCache] = None
        if length_predictor is not None:
            self.predictor = resolve_length_predictor(length_predictor, workload, policy=type(self).__name__)
            self.lengths = LengthCache(self.predictor)
        obs = getattr(self.predictor, "observe", None)
        self._observe = obs if callable(obs) else None

    # ------------------------------------------------------------- state
    def on_event(self, event: Event) -> None:
        if self._observe is not None:
            self._observe(event)
        if event.kind is EventKind.FINISHED and self.lengths is not None:
            self.lengths.forget(event.request_id)
        self.tracker.observe(event)

    def session_progress(self, session_id: str) -> tuple[int, int]:
        """(turns finished, output tokens of finished turns) seen for a session."""
        return self.tracker.get(session_id)

    def progress(self, c: CandidateRequest) -> float:
        """The trajectory's progress score in tokens (see the module docstring)."""
        return self.tracker.score(c)

    # --------------------------------------------------------- decisions
    def _tiebreak(self, cands: Sequence[CandidateRequest]) -> list[float]:
        if self.lengths is None:
            return [0.0] * len(cands)
        return self.lengths.remaining(cands)

    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        tie = self._tiebreak(waiting)
        keys = [(-p, t, c.arrival_s, c.request_id)
                for p, t, c in zip(self.tracker.scores(waiting), tie, waiting)]
        return AdmissionDecision(order=top_ids(keys, admission_limit(state, len(waiting))))

    def preempt(self, running: Sequence[CandidateRequest], state: EngineState) -> Optional[PreemptionDecision]:
        if not running:
            return None
        tie = self._tiebreak(running)
        # least progress; among equals the longest predicted remaining, then the latest arrival
        i = min(
            range(len(running)),
            key=lambda j: (self.progress(running[j]), -tie[j], -running[j].arrival_s, running[j].request_id),
        )
        return PreemptionDecision(victim=running[i].request_id)
