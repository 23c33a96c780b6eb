"""Helpers shared by the eviction and retention baselines (KVFlow, Marconi, LRB, Continuum, oracle).

* :func:`resolve_reuse_predictor` turns the ``reuse_predictor`` option (a name
  or an object) into a :class:`policy.predictors.ReusePredictor`.
* :class:`ReuseEventsMixin` forwards events to a predictor's ``observe``.

Plain Python, no vLLM.
"""

from __future__ import annotations

from typing import Any

from policy.interface import Event
from policy.predictors import REUSE_PREDICTOR, ReusePredictor, resolve_predictor

__all__ = ["resolve_reuse_predictor", "ReuseEventsMixin"]


def resolve_reuse_predictor(spec: Any, workload: Any = None, *, policy: str = "policy") -> ReusePredictor:
    """The ``reuse_predictor`` option's predictor: ``"auto"`` (``"oracle"`` with a workload, else ``"online"``),
    ``"oracle"`` (Belady's next use from ``workload``; hindsight, not deployable), ``"online"`` (the online reuse
    model) or an object with ``next_use_s(prefixes, now_s)`` (the LightGBM reuse model)."""
    return resolve_predictor(REUSE_PREDICTOR, spec, workload, policy=policy)


class ReuseEventsMixin:
    """Forwards every event to ``self.reuse.observe`` (when the predictor has one)."""

    reuse: Any = None

    def on_event(self, event: Event) -> None:
        obs = getattr(self.reuse, "observe", None)
        if obs is not None:
            obs(event)
