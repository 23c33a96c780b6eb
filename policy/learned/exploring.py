"""The exploring behaviour policy (registered as ``logging``) that logs decisions for the learned policy.

Per decision, one component of a mixture is drawn (vLLM's FCFS order / tail
victim, shortest and longest predicted remaining output first, uniform); the
logged propensity is the mixture's marginal probability of the logged action,
summed over every component that would have taken it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

from policy.interface import AdmissionDecision, CandidateRequest, EngineState, PreemptionDecision
from policy.learned.bundle import read_predictor
from policy.learned.policy import RUNTIME_DEFAULTS
from policy.learned.sampler import Sampler
from policy.learned.sorting import queue_keys
from policy.options import check_positive

__all__ = ["LOGGING_ADMIT", "LOGGING_PREEMPT", "LoggingPolicy"]

#: Admission components of the behaviour mixture and their default weights.
LOGGING_ADMIT = {"fcfs": 0.4, "shortest": 0.2, "longest": 0.2, "uniform": 0.2}
#: Preemption components (``vllm``: the tail of the running list, vLLM's own victim).
LOGGING_PREEMPT = {"vllm": 0.4, "shortest": 0.2, "longest": 0.2, "uniform": 0.2}


class LoggingPolicy(Sampler):
    """The exploring behaviour policy: a per-decision mixture of vLLM's rule, the predicted-length rules and uniform.

    ``admit_weights`` / ``preempt_weights`` (JSON objects over the component
    names of :data:`LOGGING_ADMIT` / :data:`LOGGING_PREEMPT`; normalised)
    weigh the components. ``shortest`` / ``longest`` rank by predicted
    remaining output (SJF after vLLM-LTR, and LPT, the makespan rule);
    predictions come from ``predictors`` (a MODEL_DIR, or a length predictor
    object) or, without one, the per-domain running mean. The propensity of the logged action (the first
    admitted request, or the victim) is ``sum_k w_k P_k(action)``.
    """

    name = "logging"
    version = "1"

    def __init__(
        self,
        predictors: Any = None,
        admit_weights: Optional[Mapping[str, float]] = None,
        preempt_weights: Optional[Mapping[str, float]] = None,
        max_wait_steps: Optional[float] = RUNTIME_DEFAULTS["max_wait_steps"],
        max_wait_s: Optional[float] = RUNTIME_DEFAULTS["max_wait_s"],
        resume_preempted: bool = RUNTIME_DEFAULTS["resume_preempted"],
        seed: Optional[int] = 0,
        offload: bool = True,
    ) -> None:
        if isinstance(predictors, (str, Path)):
            predictor = read_predictor(Path(predictors))
        elif predictors is not None:  # a LengthPredictor object
            predictor = predictors
        else:
            from policy.predictors import DomainMeanLengthPredictor

            predictor = DomainMeanLengthPredictor()
        super().__init__(predictor, max_wait_steps, max_wait_s, seed, resume_preempted)
        self.admit_w = _weights("admit_weights", admit_weights, LOGGING_ADMIT)
        self.preempt_w = _weights("preempt_weights", preempt_weights, LOGGING_PREEMPT)
        # Log in the regime the learned policy serves in. On by default: where the workload runs over a CPU tier
        # (the simulator's --offload-gib, serving's --kv-offloading-size), the logs carry it and `kvpilot train`
        # trains a policy over it (policy.learning.config.OfflineConfig.offload); off: no tier.
        self.uses_offload = bool(offload)

    def _pick(self, weights: dict[str, float]) -> str:
        u = self.rng.random()
        acc = 0.0
        for k, w in weights.items():
            acc += w
            if u < acc:
                return k
        return next(reversed(weights))

    @staticmethod
    def _choice(kind: str, rem: np.ndarray, default: int) -> Optional[int]:
        """The action of a deterministic component (None for uniform)."""
        if kind in ("fcfs", "vllm"):
            return default
        if kind == "shortest":
            return int(np.argmin(rem))  # ties: the earliest in vLLM's order
        if kind == "longest":
            return int(np.argmax(rem))
        return None

    def _propensity(self, weights: dict[str, float], rem: np.ndarray, default: int, action: int) -> float:
        n = len(rem)
        return float(sum(w / n if k == "uniform" else (w if self._choice(k, rem, default) == action else 0.0)
                         for k, w in weights.items()))

    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        if not waiting:
            return None
        rem, idx = self._remaining(waiting, state)
        first = self.table.first(idx, state)
        n = len(waiting)
        kind = self._pick(self.admit_w)
        if kind == "fcfs":  # (queue_keys: no np.arange, which releases the GIL, policy.learned.sorting)
            keys = queue_keys(n)
        elif kind == "shortest":
            keys = queue_keys(n) * 1e-9 - rem
        elif kind == "longest":
            keys = queue_keys(n) * 1e-9 + rem
        else:
            keys = self.np_rng.random(n)
        order = self._order(first, keys, waiting, state)
        predictions = self._predicted(waiting, idx)
        if first:
            return AdmissionDecision(order=order, propensity=1.0, predictions=predictions)
        head = next(i for i, c in enumerate(waiting) if c.request_id == order[0])
        return AdmissionDecision(order=order, propensity=self._propensity(self.admit_w, rem, 0, head),
                                 predictions=predictions)

    def preempt(self, running: Sequence[CandidateRequest], state: EngineState) -> Optional[PreemptionDecision]:
        if not running:
            return None
        rem, idx = self._remaining(running, state, refresh=True)
        n = len(running)
        kind = self._pick(self.preempt_w)
        i = self._choice(kind, rem, n - 1)
        if i is None:
            i = self.rng.randrange(n)
        return PreemptionDecision(victim=running[i].request_id,
                                  propensity=self._propensity(self.preempt_w, rem, n - 1, i),
                                  predictions=self._predicted(running, idx))


def _weights(name: str, given: Optional[Mapping[str, float]], default: Mapping[str, float]) -> dict[str, float]:
    w = dict(default if given is None else given)
    unknown = set(w) - set(default)
    if unknown:
        raise ValueError(f"option {name}: unknown component(s) {sorted(unknown)}; known: {sorted(default)}")
    for k, v in w.items():
        check_positive(f"{name}.{k}", v, allow_zero=True)
    tot = sum(w.values())
    if not tot > 0:
        raise ValueError(f"option {name}: the weights must not all be 0")
    return {k: float(v) / tot for k, v in w.items() if v > 0}
