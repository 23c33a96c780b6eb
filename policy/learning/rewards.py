"""The learned policy's reward: each decision's share of the RL-step makespan, from the logged outcomes after it.

**Objective.** In synchronous RL a step ends when its last trajectory ends:
the run's cost is the step's makespan ``E``. A per-decision reward must add
up to that objective, or the policy learns something else.

**Potential.** For a replica at time ``t`` inside RL step ``s`` let
``rem_r(t)`` be the output tokens request ``r`` of the step still has to
produce (hindsight, from the ``requests`` table: all of ``output_tokens``
before it is first scheduled, decreasing linearly from its first token to its
finish, 0 after). Define the *makespan-to-go estimate*::

    Phi(t) = t + max( sum_r rem_r(t) * ctx_r / A ,  max_r rem_r(t) * tau )

The first term is the KV-area bound of the work left: decode is memory-bound,
so the work left is the token-steps of context still to be read
(``rem_r * ctx_r``, ``ctx_r`` = the request's mean context while it decodes)
over ``A``, the context token-steps per second the run sustained (measured on
the same log: sum over steps of running context / duration, see
:func:`area_rate`). The second is the critical path: the longest remaining
request decoded alone at ``tau`` seconds per token (the log's median decode
step). ``Phi`` is the time the step still needs at the run's average KV
efficiency; when the step is done ``Phi(E) = E``.

**Reward.** A decision at ``t`` gets ``r = (Phi(t) - Phi(t + window_s)) /
window_s``: how much the makespan-to-go fell per second of the window after
it, minus the time spent (an idle window scores -1, a window that does work
at exactly the bound's rate scores 0, losing work to preemption and
recomputation scores below). Summed over consecutive windows these rewards
telescope to ``(Phi(t_0) - E) / window_s``: maximising them is minimising the
makespan, with no hand-made preference for any rule. Starting a long request
early shortens the critical path; keeping the KV cache full shortens the area
term; preempting and recomputing a request lengthens both. Measured on a tiny
workload (6 prompts x 4 per step, KV 0.25): ``Phi`` at a step's start is
1.13-1.29x the step's realised makespan under vLLM default, the exploring
policy and a learned policy alike (the area term at the run's average, not
peak, efficiency), so it ranks states, not bounds them.

**Simplifications.** Progress between the first token and the finish is
linear (a preempted request's lost progress is not modelled: its later finish
shows up as slower progress); ``tau`` and ``A`` are one number per log; the
reward of a window is shared by every decision taken in it (off-policy
estimators handle the noise in expectation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

__all__ = ["RewardModel", "area_rate", "decision_rewards"]


def area_rate(steps: pd.DataFrame, requests: pd.DataFrame) -> tuple[float, float]:
    """(tau: median decode step seconds, A: context token-steps per second) of a log."""
    busy = steps[(steps["decode_tokens"] > 0) & (steps["duration_s"] > 0)]
    if busy.empty:
        return 0.01, 1.0
    tau = float(np.median(busy["duration_s"]))
    # context read per step ~ used blocks * block tokens; kv_usage * total blocks is used blocks
    total = float((steps["free_blocks"] / np.maximum(1.0 - steps["kv_usage"], 1e-9)).clip(upper=1e12).median())
    ctx = (busy["kv_usage"] * total * 16.0).to_numpy()
    rate = float(ctx.sum() / busy["duration_s"].sum())
    return tau, max(rate, 1.0)


@dataclass
class RewardModel:
    """``Phi`` of one replica's log (see the module docstring), evaluated at any time."""

    arrival: np.ndarray
    start: np.ndarray  # first token time (or first scheduled)
    finish: np.ndarray
    out: np.ndarray
    ctx: np.ndarray
    step: np.ndarray
    tau: float
    area_rate: float

    @classmethod
    def from_log(cls, requests: pd.DataFrame, steps: pd.DataFrame) -> "RewardModel":
        r = requests
        tau, rate = area_rate(steps, r)
        first = r["first_token_s"].astype(float).fillna(r["first_scheduled_s"].astype(float))
        first = first.fillna(r["finish_s"].astype(float))
        fin = r["finish_s"].astype(float).fillna(np.inf)
        out = r["output_tokens"].astype(float).to_numpy()
        ctx = r["prompt_tokens"].astype(float).to_numpy() + out / 2.0
        return cls(r["arrival_s"].astype(float).to_numpy(), first.to_numpy(), fin.to_numpy(), out, ctx,
                   r["step"].fillna(0).astype(int).to_numpy(), tau, rate)

    def remaining(self, t: float) -> np.ndarray:
        """rem_r(t) of every request (0 for those not arrived: they are not yet part of the state)."""
        span = np.maximum(self.finish - self.start, 1e-9)
        frac = np.clip((self.finish - t) / span, 0.0, 1.0)
        rem = np.where(t < self.start, self.out, self.out * frac)
        return np.where(self.arrival <= t, rem, 0.0)

    def phi(self, t: float, step: int) -> float:
        """The makespan-to-go estimate at ``t`` for RL step ``step``."""
        m = self.step == step
        rem = self.remaining(t)[m]
        if rem.size == 0:
            return t
        area = float((rem * self.ctx[m]).sum()) / self.area_rate
        crit = float(rem.max()) * self.tau
        return t + max(area, crit)


def decision_rewards(times: np.ndarray, model: RewardModel, window_s: float, resolution: int = 8) -> np.ndarray:
    """The reward of decisions taken at ``times`` on the replica ``model`` describes.

    ``Phi`` is evaluated on a grid of ``window_s / resolution`` seconds (decision times
    are snapped to it), so the cost is per grid point, not per decision.
    """
    times = np.asarray(times, dtype=float)
    if times.size == 0:
        return np.empty(0)
    dt = window_s / resolution
    idx = np.floor(times / dt).astype(np.int64)
    out = np.empty(len(times))
    order = np.argsort(model.arrival, kind="stable")
    arr_sorted, step_sorted = model.arrival[order], model.step[order]
    run_max = np.maximum.accumulate(step_sorted) if step_sorted.size else step_sorted
    for g in np.unique(idx):
        t = float(g) * dt
        k = int(np.searchsorted(arr_sorted, t, side="right"))
        s = int(run_max[k - 1]) if k else 0  # the RL step in progress: the latest arrived
        out[idx == g] = (model.phi(t, s) - model.phi(t + window_s, s)) / window_s
    return out
