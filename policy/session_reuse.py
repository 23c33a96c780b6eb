"""When a CPU-tier owner's blocks are next needed, from where its session is: the learned policy's tier order.

A tier owner is a session (or a request without one). Its next use follows from the session's state, as the
hindsight oracle (:class:`policy.predictors.OracleReusePredictor`) reads it from the workload, with what the
engine can know instead of hindsight:

* ``WAITING`` (its next request is queued at ``queue_position``): when admission reaches it, estimated as that
  position over the engine's admission rate (requests scheduled per second over the last
  :data:`RATE_WINDOW` admissions);
* ``PAUSED_TOOL``: when its tool returns: the pause's start plus the tool's expected latency, not before now;
* ``RUNNING``: now plus the expected latency of the tool its turn will call (the generation left is not
  counted, as the oracle does not count it); a turn that calls no tool ends its session: never;
* ``FINISHED``: never (``inf``).

The tool's expected latency is the request's ``expected_pause_s`` hint when the framework sends one, else the
mean of all that tool's pauses seen so far (``TOOL_CALL_STARTED`` to ``TOOL_CALL_ENDED``; measured, an
exponential average over the last 100 instead ran 3% slower where memory binds), else ``default_latency_s``.
No model and no training: it learns from the engine's own events as it serves. Measured where memory binds
in docs/results/2026-12-04-tier-by-session-state.md.

:class:`TrainedNextUse` is the trained form: the same rule's estimate, with the state it reads
(:func:`tier_features`), goes into a LightGBM model of the realised next use (:mod:`predictors.tier_reuse`,
trained by :mod:`training.tier_training`), and the model's prediction orders the tier.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Optional

import numpy as np

from policy.interface import CachedPrefix, Event, EventKind, OwnerState, RequestMeta
from policy.tool_latency import ToolLatencies

#: Admissions over which the admission rate is measured.
RATE_WINDOW = 256
# enum members as plain names (an Enum class attribute costs ~0.1 µs to read; these run per owner)
_WAITING, _PAUSED, _RUNNING = OwnerState.WAITING, OwnerState.PAUSED_TOOL, OwnerState.RUNNING
_SCHEDULED = EventKind.SCHEDULED


class SessionStateNextUse:
    """A reuse predictor (``next_use_s`` / ``observe``) for the CPU tier's owners; see the module docstring."""

    def __init__(self, default_latency_s: float = 1.0) -> None:
        if not default_latency_s >= 0.0:
            raise ValueError(f"default_latency_s must be >= 0, got {default_latency_s!r}")
        self.default_latency_s = float(default_latency_s)
        self._admitted: deque[float] = deque(maxlen=RATE_WINDOW)  # times of the last admissions
        self.tools = ToolLatencies()  # the sessions' pause clocks and each tool's latencies

    def observe(self, event: Event) -> None:
        if event.kind is _SCHEDULED:
            self._admitted.append(event.time_s)
        else:
            self.tools.on_event(event)

    def latency_s(self, meta: RequestMeta) -> float:
        """The expected latency of the tool a turn with ``meta`` calls."""
        if meta.expected_pause_s is not None:
            return float(meta.expected_pause_s)
        seen = self.tools.mean_s(meta.tool)
        return seen if seen is not None else self.default_latency_s

    def admission_rate(self, now_s: float) -> Optional[float]:
        """Requests admitted per second over the last :data:`RATE_WINDOW` admissions (None before two)."""
        a = self._admitted
        if len(a) < 2:
            return None
        return (len(a) - 1) / max(now_s - a[0], a[-1] - a[0], 1e-9)

    def next_use_s(self, prefixes: Sequence[CachedPrefix], now_s: float) -> list[float]:
        rate = self.admission_rate(now_s)
        paused_since = self.tools.paused_since_s
        latency = self.latency_s
        by_tool: dict = {}  # tool -> its expected latency when a request sends no hint: read once per call
        out = []
        for p in prefixes:
            state, meta = p.owner_state, p.meta
            if state is _WAITING:
                pos = p.queue_position or 0
                out.append(now_s + (pos / rate if rate else 0.0))
                continue
            if state is _PAUSED or (state is _RUNNING and meta.tool is not None):
                if meta.expected_pause_s is None:
                    lat = by_tool.get(meta.tool)
                    if lat is None:
                        lat = by_tool[meta.tool] = latency(meta)
                else:
                    lat = latency(meta)  # (the request's own hint)
                if state is _RUNNING:
                    out.append(now_s + lat)
                else:
                    t0 = paused_since(meta.session_id)
                    out.append(max(now_s, (t0 if t0 is not None else p.last_used_s) + lat))
            else:
                out.append(math.inf)
        return out


#: Columns of :func:`tier_features` (``len(predictors.tier_reuse.FEATURES)``, whose order they follow).
TIER_FEATURES = 10
_LOG_CAP = math.log1p(1e9)  # a time past any run, in log1p(admissions)
_NAN = math.nan


def tier_features(rule: SessionStateNextUse, prefixes: Sequence[CachedPrefix], now_s: float,
                  estimate: Sequence[float], rate: float) -> tuple[np.ndarray, list[int]]:
    """The rows of :data:`predictors.tier_reuse.FEATURES` for the owners whose session comes back (queued, paused,
    or running a turn that calls a tool), and their places in ``prefixes``; ``estimate``: the rule's next uses,
    ``rate``: the admission rate (admissions per second) that turns seconds into admissions."""
    n = len(prefixes)
    waiting = sum(1 for p in prefixes if p.owner_state is _WAITING)
    log_owners, waiting_share = math.log1p(n), waiting / n if n else 0.0
    paused_since = rule.tools.paused_since_s
    rows, idx = [], []
    for i, p in enumerate(prefixes):
        state, meta = p.owner_state, p.meta
        if state is _WAITING:
            code = 0.0
        elif state is _PAUSED:
            code = 1.0
        elif state is _RUNNING and meta.tool is not None:
            code = 2.0
        else:
            continue  # finished, or a turn that ends its session: never used again
        dt = estimate[i] - now_s
        lat = rule.latency_s(meta) if (meta.tool is not None or meta.expected_pause_s is not None) else None
        t0 = paused_since(meta.session_id) if code == 1.0 else None
        qp = p.queue_position if code == 0.0 else None
        rows.append((code,
                     math.log1p(dt * rate) if dt < math.inf else _LOG_CAP,
                     math.log1p(qp) if qp is not None else _NAN,
                     math.log1p(lat * rate) if lat is not None else _NAN,
                     math.log1p(max(now_s - t0, 0.0) * rate) if t0 is not None else _NAN,
                     math.log1p(max(now_s - p.last_used_s, 0.0) * rate),
                     math.log1p(p.tier_blocks),
                     log_owners, waiting_share,
                     float(meta.turn or 0)))
        idx.append(i)
    return np.array(rows, dtype=np.float64).reshape(len(rows), TIER_FEATURES), idx


class TrainedNextUse(SessionStateNextUse):
    """The session-state rule corrected by a trained model (:mod:`predictors.tier_reuse`): the owners whose session
    comes back are next used when the model says; the others as the rule says (never). Before the engine has an
    admission rate (two admissions), the rule's estimates stand."""

    def __init__(self, model, default_latency_s: float = 1.0) -> None:
        super().__init__(default_latency_s)
        self.model = model

    def next_use_s(self, prefixes: Sequence[CachedPrefix], now_s: float) -> list[float]:
        out = super().next_use_s(prefixes, now_s)
        rate = self.admission_rate(now_s)
        if not rate:
            return out
        X, idx = tier_features(self, prefixes, now_s, out, rate)
        if idx:
            pred = np.expm1(self.model.predict(X)) / rate
            for i, d in zip(idx, pred.tolist()):
                out[i] = now_s + d
        return out
