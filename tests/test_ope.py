"""Off-policy estimates: right on a synthetic bandit, and DR agrees with the simulator on a held-out log."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from policy.learning.ope import estimates
from tests.learned_logs import learned_runs, simulate, tiny_workload  # noqa: F401 - the fixture

ARM_MEANS = np.array([0.2, 0.5, 0.9])


def _bandit(n: int, seed: int):
    """A 3-armed bandit logged by a non-uniform policy; the target always plays arm 2 (value 0.9)."""
    rng = np.random.default_rng(seed)
    logp = np.array([0.5, 0.3, 0.2])
    a = rng.choice(3, size=n, p=logp)
    r = ARM_MEANS[a] + rng.normal(0, 0.3, size=n)
    pi = (a == 2).astype(float)
    return pi, logp[a], r, a


def test_estimators_recover_a_known_value() -> None:
    covered = {"ips": 0, "snips": 0, "dr": 0}
    for seed in range(20):
        pi, p, r, a = _bandit(2000, seed)
        q = ARM_MEANS[a] + 0.05  # a slightly wrong reward model
        v = np.full(len(a), ARM_MEANS[2] + 0.05)
        est = estimates(pi, p, r, q, v, n_boot=200, seed=seed)
        assert est["behaviour.value"] == pytest.approx(np.mean(r))
        for k in covered:
            covered[k] += est[f"{k}_ci_low"] <= 0.9 <= est[f"{k}_ci_high"]
        assert abs(est["dr"] - 0.9) < 0.1 and abs(est["snips"] - 0.9) < 0.1
    # 95% intervals: at least 16 of 20 cover the truth (P(fewer) < 2% for a calibrated interval)
    assert all(c >= 16 for c in covered.values()), covered


def test_estimates_reject_bad_propensities() -> None:
    with pytest.raises(ValueError, match="propensities"):
        estimates(np.ones(3), np.array([0.5, 0.0, 1.0]), np.ones(3))


@pytest.mark.vllm
def test_dr_estimate_covers_the_simulated_value(learned_runs: dict, tmp_path: Path) -> None:  # noqa: F811
    """Train on two exploring logs; on a held-out workload (another seed), log the learned policy with exploration
    (``mode="log"``), estimate the greedy policy's value there by DR, then simulate the greedy policy on the same
    workload: the value it achieves lies within the DR estimate's 95% CI."""
    from policy.learning.config import OfflineConfig
    from policy.learning.data import logged_rewards
    from policy.learning.offline import ope_on_log, train_policy

    cfg = OfflineConfig(epochs=4)
    pol = tmp_path / "policy"
    train_policy([learned_runs["train1"], learned_runs["train2"]], learned_runs["predictors"], pol, cfg,
                 progress=False)
    held = simulate(tiny_workload(3), "learned", tmp_path / "heldout", model=str(pol), mode="log")
    est = ope_on_log(pol, held, cfg)
    assert est["ope.n"] > 100
    run = simulate(tiny_workload(3), "learned", tmp_path / "sim", model=str(pol))
    value = float(np.mean(logged_rewards(run, cfg)))
    assert est["ope.dr_ci_low"] <= value <= est["ope.dr_ci_high"], (value, est)
