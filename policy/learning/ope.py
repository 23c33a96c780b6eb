"""Off-policy evaluation of a target policy on logged decisions: IPS, self-normalised IPS and doubly robust.

Each logged decision ``d`` brings the behaviour propensity ``p_d`` of the
logged action, its reward ``r_d``, the target policy's probability
``pi_d`` of that same action, and (for DR) the reward model's prediction
``q_d`` for the logged action and ``v_d = sum_a pi(a) q(a)`` over all actions.
With ``w_d = pi_d / max(p_d, clip)``:

* IPS ``= mean(w r)``;
* SNIPS ``= sum(w r) / sum(w)``;
* DR ``= mean(v + w (r - q))``.

Confidence intervals are percentile bootstraps over decisions or, with
``groups``, over groups of decisions (a block bootstrap): decisions taken
close together share their outcome (:mod:`policy.learning.rewards` gives every decision
in a window the same window's outcome), so they are not independent, and a
bootstrap over single decisions would give intervals far too narrow.
"""

from __future__ import annotations

import numpy as np

__all__ = ["estimates"]


def _ips(w: np.ndarray, r: np.ndarray, q: np.ndarray, v: np.ndarray) -> float:
    return float(np.mean(w * r))


def _snips(w: np.ndarray, r: np.ndarray, q: np.ndarray, v: np.ndarray) -> float:
    s = float(np.sum(w))
    return float(np.sum(w * r) / s) if s > 0 else float("nan")


def _dr(w: np.ndarray, r: np.ndarray, q: np.ndarray, v: np.ndarray) -> float:
    return float(np.mean(v + w * (r - q)))


ESTIMATORS = {"ips": _ips, "snips": _snips, "dr": _dr}


def estimates(
    pi: np.ndarray,
    propensity: np.ndarray,
    reward: np.ndarray,
    q_logged: np.ndarray | None = None,
    v_target: np.ndarray | None = None,
    *,
    clip: float = 1e-3,
    groups: np.ndarray | None = None,
    n_boot: int = 500,
    alpha: float = 0.05,
    seed: int = 0,
) -> dict[str, float]:
    """``{ips, snips, dr}`` with ``<name>_ci_low`` / ``<name>_ci_high`` and ``behaviour.value``, ``n``, ``ess``.

    Without a reward model (``q_logged`` / ``v_target`` None) DR equals IPS.
    """
    pi = np.asarray(pi, float)
    p = np.asarray(propensity, float)
    r = np.asarray(reward, float)
    if not (len(pi) == len(p) == len(r)):
        raise ValueError(f"pi, propensity and reward differ in length: {len(pi)}, {len(p)}, {len(r)}")
    if np.any(~(p > 0)) or np.any(p > 1 + 1e-9):
        raise ValueError("propensities must lie in (0, 1]")
    q = np.zeros_like(r) if q_logged is None else np.asarray(q_logged, float)
    v = np.zeros_like(r) if v_target is None else np.asarray(v_target, float)
    w = pi / np.maximum(p, clip)
    out: dict[str, float] = {"n": float(len(r)), "behaviour.value": float(np.mean(r)) if len(r) else float("nan")}
    out["ess"] = float(w.sum() ** 2 / max((w * w).sum(), 1e-12))
    if len(r) == 0:
        return out
    rng = np.random.default_rng(seed)
    if groups is None:
        samples = [rng.integers(0, len(r), size=len(r)) for _ in range(n_boot)]
    else:
        _, g = np.unique(np.asarray(groups), return_inverse=True)
        members = [np.nonzero(g == k)[0] for k in range(g.max() + 1)]
        out["groups"] = float(len(members))
        samples = [np.concatenate([members[k] for k in rng.integers(0, len(members), size=len(members))])
                   for _ in range(n_boot)]
    lo, hi = 100 * alpha / 2, 100 * (1 - alpha / 2)
    for name, f in ESTIMATORS.items():
        out[name] = f(w, r, q, v)
        boots = np.array([f(w[i], r[i], q[i], v[i]) for i in samples])
        boots = boots[np.isfinite(boots)]
        out[f"{name}_ci_low"] = float(np.percentile(boots, lo)) if boots.size else float("nan")
        out[f"{name}_ci_high"] = float(np.percentile(boots, hi)) if boots.size else float("nan")
    return out
