"""Helpers shared by the eviction and retention baselines (KVFlow, Marconi, LRB, Continuum, oracle).

* :func:`resolve_reuse_predictor` turns the ``reuse_predictor`` option (a name
  or an object) into a :class:`policy.predictors.ReusePredictor`.
* :func:`tail_starts` (from :mod:`data.records`) finds where each candidate's own tail begins (past the
  blocks it shares with other candidates): the part the lever moves.
* :func:`check_count` / :func:`check_number` validate integer and bounded numeric options.
* :class:`ReuseEventsMixin` forwards events to a predictor's ``observe``.

Plain Python, no vLLM.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from data.records import tail_starts
from policy.interface import Event
from policy.predictors import REUSE_PREDICTOR, ReusePredictor, resolve_predictor

__all__ = [
    "resolve_reuse_predictor", "check_count", "check_number",
    "ReuseEventsMixin",
]

def resolve_reuse_predictor(spec: Any, workload: Any = None, *, policy: str = "policy") -> ReusePredictor:
    """The ``reuse_predictor`` option's predictor: ``"auto"`` (``"oracle"`` with a workload, else ``"online"``),
    ``"oracle"`` (Belady's next use from ``workload``; hindsight, not deployable), ``"online"`` (the online reuse
    model) or an object with ``next_use_s(prefixes, now_s)`` (the LightGBM reuse model)."""
    return resolve_predictor(REUSE_PREDICTOR, spec, workload, policy=policy)


def check_count(name: str, value: Any, *, allow_none: bool = False) -> Optional[int]:
    """Validate a positive integer option."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"option {name} must be a positive integer, got {value!r}")
    return int(value)


def check_number(name: str, value: Any, *, lo: float = 0.0, allow_lo: bool = False, hi: float = math.inf) -> float:
    """Validate a finite numeric option in ``(lo, hi]`` (``[lo, hi]`` with ``allow_lo``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"option {name} must be a finite number, got {value!r}")
    if value < lo or (value == lo and not allow_lo) or value > hi:
        raise ValueError(f"option {name} out of range: {value!r}")
    return float(value)


class ReuseEventsMixin:
    """Forwards every event to ``self.reuse.observe`` (when the predictor has one)."""

    reuse: Any = None

    def on_event(self, event: Event) -> None:
        obs = getattr(self.reuse, "observe", None)
        if obs is not None:
            obs(event)
