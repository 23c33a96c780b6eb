"""The learned policy's raw input matrix, built in one pass per decision, with length predictions kept between steps.

The learned policy ranks every waiting request in each step in which vLLM could
admit, inside vLLM's scheduler step (issue #7: at most 10% added to
``schedule()``). :class:`CandidateInputs` gives it the same
:data:`policy.learned_features.RAW` matrix as :func:`policy.learned.candidate_raw`
(a test checks it) at a fraction of the cost:

* **Predictions kept.** The length predictor is asked only about candidates
  whose answer may have changed since it was last asked, in one batched call. For
  :class:`predictors.length.LengthModel` that is exactly when its own cache
  stamp may move: the request's group has a new finished request (the sibling
  features, and the hook's ``group_finished``), or a request of an earlier RL
  step finished (the prompt-history features); events say when. Without a
  predictor nothing changes; other predictors are asked about every
  candidate, as before.
* **One pass.** A candidate's fixed values (prompt and token limit, turn, group
  size, RL step) are kept with its prediction; a decision reads only the values
  that move (computed and generated tokens, group progress, wait, preemptions,
  status) in one loop, and the engine-state columns are filled per column.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from policy.interface import CandidateRequest, EngineState, Event, EventKind, RequestStatus
from policy.learned_features import RAW, R

#: Columns of the per-candidate part of :data:`RAW` written by the one-pass loop, in loop order.
_LOOP_COLS = [R[k] for k in (
    "prompt_tokens", "computed_tokens", "output_tokens", "max_tokens", "turn", "group_size", "group_finished",
    "group_running", "wait_s", "preemptions", "is_running", "pred_p50", "pred_p90", "step_phase",
)]
_STATE_COLS = [R[k] for k in ("kv_usage", "pinned_frac", "num_running", "num_waiting")]


class CandidateInputs:
    """Builds a decision's raw matrix; keeps each request's prediction and fixed values between steps."""

    def __init__(self, predictor: Any) -> None:
        self.predictor = predictor
        self.cacheable = predictor is None or _is_length_model(predictor)
        #: request id -> (group_finished when predicted, fixed row values, p50, p90, predictions dict, RL step)
        self.entries: dict[str, tuple] = {}
        self.by_group: dict[str, list[str]] = {}
        self.max_step = 0  # the highest RL step among the entries

    def observe(self, event: Event) -> None:
        """Drop the predictions an event may change (before the predictor itself observes it)."""
        if event.kind is not EventKind.FINISHED:
            return
        entries = self.entries
        entries.pop(event.request_id, None)
        m = event.meta
        if (m.step or 0) < self.max_step:  # an earlier step's request: prompt histories move
            entries.clear()
            self.by_group.clear()
        elif m.group_id is not None:
            for rid in self.by_group.pop(m.group_id, ()):
                entries.pop(rid, None)

    def raw(self, cands: Sequence[CandidateRequest], state: EngineState, phase: Any) -> np.ndarray:
        """The (n, len(RAW)) raw matrix; also sets each candidate's ``predictions`` (the hook logs them)."""
        entries = self.entries
        if not self.cacheable:
            entries.clear()
        get = entries.get
        miss = [c for c in cands if (e := get(c.request_id)) is None or e[0] != c.group_finished]
        if miss:
            self._predict(miss)
        running = RequestStatus.RUNNING
        phases: dict = {}
        rows = []
        append = rows.append
        for c in cands:
            e = entries[c.request_id]
            if e[4] is not None:
                c.predictions = e[4]
            step = e[5]
            ph = phases.get(step)
            if ph is None:
                ph = phases[step] = phase.phase(step)
            fixed = e[1]
            append((
                fixed[0], c.num_computed_tokens, c.num_output_tokens, fixed[1], fixed[2], fixed[3],
                c.group_finished, c.group_running, c.wait_s, c.num_preemptions,
                1.0 if c.status is running else 0.0, e[2], e[3], ph,
            ))
        n = len(rows)
        out = np.empty((n, len(RAW)), dtype=np.float64)
        if n:
            out[:, _LOOP_COLS] = np.array(rows, dtype=np.float64)
            tot = max(state.num_total_blocks, 1)
            out[:, _STATE_COLS] = (state.kv_usage, state.num_pinned_blocks / tot, float(state.num_running),
                                   float(state.num_waiting))
        return out

    def _predict(self, cands: list[CandidateRequest]) -> None:
        nan = math.nan
        preds = self.predictor.predict(cands) if self.predictor is not None else [(nan, nan)] * len(cands)
        for c, p in zip(cands, preds):
            m = c.meta
            fixed = (
                c.num_prompt_tokens, c.max_tokens, m.turn if m.turn is not None else nan,
                m.group_size if m.group_size is not None else nan,
            )
            p50, p90 = p[0], p[1]
            pdict = {"len_p50": float(p50), "len_p90": float(p90)} if self.predictor is not None else None
            self.entries[c.request_id] = (c.group_finished, fixed, p50, p90, pdict, m.step)
            if self.cacheable:
                if m.group_id is not None:
                    self.by_group.setdefault(m.group_id, []).append(c.request_id)
                self.max_step = max(self.max_step, m.step or 0)


def _is_length_model(predictor: Any) -> bool:
    from predictors.length import LengthModel

    return isinstance(predictor, LengthModel)
