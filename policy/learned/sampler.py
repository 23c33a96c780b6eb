"""What the learned policy and the exploring behaviour policy share: their inputs and their precedence.

:class:`StepPhase` follows how much of each RL step is done; :func:`candidate_raw` reads one decision's
candidates into the raw matrix of :mod:`policy.learned.features`. :class:`Sampler`, the base of
:class:`policy.learned.policy.LearnedPolicy` and :class:`policy.learned.exploring.LoggingPolicy`, keeps the feature
table (:class:`policy.learned.table.FeatureTable`), the length predictions, the rng and the order's precedence
(preempted, then starved requests first), and hands its state to a successor at a hot swap.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from policy.common import LengthCache, admission_limit
from policy.interface import CandidateRequest, EngineState, Event, EventKind, Policy, PolicyState, StateMismatch
from policy.learned.features import ENGINE_RAW, RAW, R
from policy.learned.sorting import descending
from policy.learned.table import FeatureTable
from policy.options import check_positive

__all__ = ["StepPhase", "candidate_raw", "Sampler", "STATE_KIND", "STATE_VERSION"]


_ARRIVED, _FINISHED = EventKind.ARRIVED, EventKind.FINISHED  # (plain names: an Enum attribute costs ~0.1 µs)


class StepPhase:
    """How much of each RL step is done: finished / arrived requests of that step (from events)."""

    def __init__(self) -> None:
        self.arrived: dict[Optional[int], int] = defaultdict(int)
        self.finished: dict[Optional[int], int] = defaultdict(int)

    def observe(self, event: Event) -> None:
        kind = event.kind
        if kind is _ARRIVED:
            self.arrived[event.meta.step] += 1
        elif kind is _FINISHED:
            self.finished[event.meta.step] += 1

    def phase(self, step: Optional[int]) -> float:
        a = self.arrived.get(step, 0)
        return min(1.0, self.finished.get(step, 0) / a) if a else 0.0


#: The :data:`RAW` values of :func:`candidate_raw`'s per-candidate rows, in the order of a row's tuple there.
_ROW_RAW = ("prompt_tokens", "computed_tokens", "output_tokens", "max_tokens", "turn", "group_size", "group_finished",
            "group_running", "wait_s", "preemptions", "is_running", "pred_p50", "pred_p90", "step_phase")
#: Their columns of :data:`RAW`, and the engine-state columns.
_ROW_COLS = [R[k] for k in _ROW_RAW]
_STATE_COLS = [R[k] for k in ENGINE_RAW]


def candidate_raw(
    cands: Sequence[CandidateRequest], preds: Sequence[tuple[float, float]], state: EngineState, phase: StepPhase
) -> np.ndarray:
    """The (n, len(RAW)) raw matrix of one decision's candidates (see :mod:`policy.learned.features`)."""
    nan = math.nan
    tot = max(state.num_total_blocks, 1)
    phases: dict[Optional[int], float] = {}
    for c in cands:
        if c.meta.step not in phases:
            phases[c.meta.step] = phase.phase(c.meta.step)
    rows = [
        (
            c.num_prompt_tokens, c.num_computed_tokens, c.num_output_tokens, c.max_tokens,
            c.meta.turn if c.meta.turn is not None else nan,
            c.meta.group_size if c.meta.group_size is not None else nan,
            c.group_finished, c.group_running, c.wait_s, c.num_preemptions,
            1.0 if c.status.value == "running" else 0.0, p[0], p[1], phases[c.meta.step],
        )
        for c, p in zip(cands, preds)
    ]
    out = np.empty((len(rows), len(RAW)), dtype=np.float64)
    if rows:  # the engine-state columns are the same for every candidate: filled per column
        out[:, _ROW_COLS] = np.array(rows, dtype=np.float64)
        out[:, _STATE_COLS] = (state.kv_usage, state.num_pinned_blocks / tot, float(state.num_running),
                               float(state.num_waiting))
    return out


def _predict(lengths: Optional[LengthCache], cands: Sequence[CandidateRequest]) -> list[tuple[float, float]]:
    """(p50, p90) per candidate (cached per request until a sibling finishes)."""
    if lengths is None:
        return [(math.nan, math.nan)] * len(cands)
    return lengths.lookup(cands)


#: :meth:`Sampler.export_state`'s kind and layout version (LearnedPolicy and LoggingPolicy read each other's).
STATE_KIND, STATE_VERSION = "kvpilot.learned", 1


class Sampler(Policy):
    """What the learned and the exploring policy share: the rng, precedence (preempted, starved), predictions,
    step phase."""

    uses_admission = True
    uses_preemption = True
    uses_events = True
    lazy_candidates = True  # the feature table reads candidates only for new or changed rows

    def __init__(self, predictor: Any, max_wait_steps: Optional[float], max_wait_s: Optional[float],
                 seed: Optional[int], resume_preempted: bool) -> None:
        self.predictor = predictor
        self.lengths = LengthCache(predictor) if predictor is not None else None
        self.phase = StepPhase()
        self.table = FeatureTable(self._raw, self.phase.phase,
                                  check_positive("max_wait_steps", max_wait_steps, allow_none=True),
                                  check_positive("max_wait_s", max_wait_s, allow_none=True),
                                  resume_preempted=bool(resume_preempted),
                                  preds_of=lambda cands: _predict(self.lengths, cands))
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self._observe = getattr(predictor, "observe", None)
        self._last_order: Optional[tuple[np.ndarray, int, list[str]]] = None  # (keys, limit, order): see _order

    def _raw(self, cands: Sequence[CandidateRequest], state: EngineState) -> np.ndarray:
        return candidate_raw(cands, _predict(self.lengths, cands), state, self.phase)

    def _remaining(self, cands: Sequence[CandidateRequest], state: EngineState,
                   refresh: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Predicted remaining output of each candidate, and their table rows."""
        return self.table.remaining(cands, state, refresh)

    def _predicted(self, cands: Sequence[CandidateRequest], idx: np.ndarray) -> Optional[dict[str, dict]]:
        """The candidates' length predictions (table rows ``idx``), for the decision to return and the hook to log."""
        if self.lengths is None:
            return None
        return {c.request_id: {"len_p50": p[0], "len_p90": p[1]} for c, p in zip(cands, self.table.predictions(idx))}

    #: the reuse predictor's ``observe`` (the learned policy over the tier), else None
    _observe_reuse: Any = None

    def on_event(self, event: Event) -> None:
        self.phase.observe(event)
        self.table.observe(event)
        if self._observe is not None:
            self._observe(event)
        if self._observe_reuse is not None:
            self._observe_reuse(event)
        if event.kind is _FINISHED and self.lengths is not None:
            self.lengths.forget(event.request_id)

    def export_state(self) -> PolicyState:
        """The RL steps' phase, the feature table's rows and clocks, and the predictor's observed state (hot swap)."""
        pred = getattr(self.predictor, "export_state", None)
        return PolicyState(STATE_KIND, STATE_VERSION, {
            "phase": (self.phase.arrived, self.phase.finished), "table": self.table.export_state(),
            "predictor": pred() if pred is not None else None})

    def import_state(self, state: PolicyState) -> None:
        """A predecessor's :meth:`export_state`; the predictor's part only where this predictor reads it."""
        from policy.learned.table import TableState

        data = self.state_data(state, STATE_KIND, STATE_VERSION)
        if not isinstance(data, dict) or not isinstance(data.get("table"), TableState):
            raise StateMismatch(f"a {STATE_KIND!r} state without its feature table")
        take = getattr(self.predictor, "import_state", None)
        if take is not None and data.get("predictor") is not None:
            try:
                take(data["predictor"])
            except ValueError as e:
                raise StateMismatch(f"the length predictor's state: {e}") from None
        self.table.import_state(data["table"])
        self.phase.arrived, self.phase.finished = data["phase"]

    def _order(self, first: list[int], keys: np.ndarray, waiting: Sequence[CandidateRequest],
               state: EngineState) -> list[str]:
        """Request ids: ``first`` (preempted, starved), then the rest by descending ``keys``, up to vLLM's admission
        limit.

        ``waiting`` must be the candidates of the table's last :meth:`FeatureTable.features` call (their ids are
        kept there as a tuple). The same ``keys`` array as the last call's (scores the scorer reused), with no
        ``first`` and the same limit, gives the last call's order again (a copy)."""
        k = admission_limit(state, len(waiting))
        last = self._last_order
        if not first and last is not None and last[0] is keys and last[1] == k:
            return list(last[2])
        take = max(0, min(k, len(waiting)) - len(first))
        top = descending(keys, take, first)  # (a sort that keeps the GIL: policy.learned.sorting)
        ids = self.table.request_ids
        if not first:
            order = [ids[i] for i in top]
            self._last_order = (keys, k, order)
            return list(order)
        return [ids[i] for i in first] + [ids[i] for i in top]

