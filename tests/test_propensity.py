"""Logged propensities are the probabilities the exploring policies really act with."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from policy.interface import RequestStatus
from policy.learned.exploring import LoggingPolicy
from policy.learned.policy import LearnedPolicy
from tests.learned_logs import learned_runs  # noqa: F401 - the fixture
from tests.test_learned import FixedLengths, _cand, _state, _state_dict

N = 4000


def _check_frequencies(decide, n_cands: int) -> None:
    """Sample ``N`` decisions; each action's frequency matches the propensity logged with it (4 sigma)."""
    counts: Counter = Counter()
    props: dict[str, set] = {}
    for _ in range(N):
        action, p = decide()
        counts[action] += 1
        props.setdefault(action, set()).add(round(p, 12))
    assert len(counts) == n_cands  # every candidate is explored
    total = 0.0
    for action, ps in props.items():
        assert len(ps) == 1, (action, ps)  # one action, one probability
        p = next(iter(ps))
        total += p
        sd = np.sqrt(p * (1 - p) / N)
        assert abs(counts[action] / N - p) <= 4 * sd + 1e-9, (action, counts[action] / N, p)
    assert total == pytest.approx(1.0, abs=1e-9)  # the propensities of all actions sum to 1


def _logging_policy(lengths: dict[str, float]) -> LoggingPolicy:
    return LoggingPolicy(predictors=FixedLengths(lengths), seed=1)


def _learned_log_policy(lengths: dict[str, float]) -> LearnedPolicy:
    return LearnedPolicy(_state_dict(remaining_weight=0.8), FixedLengths(lengths), mode="log", epsilon=0.1, seed=2)


@pytest.mark.parametrize("make_policy", [_logging_policy, _learned_log_policy], ids=["logging", "learned-log"])
def test_propensities_match_frequencies(make_policy) -> None:
    pol = make_policy({f"r{i}": 100.0 * (i + 1) for i in range(5)})
    waiting = [_cand(i) for i in range(5)]
    running = [_cand(i, status=RequestStatus.RUNNING) for i in range(5)]

    def admit():
        d = pol.admit(waiting, _state())
        return d.order[0], d.propensity

    def preempt():
        d = pol.preempt(running, _state())
        return d.victim, d.propensity

    _check_frequencies(admit, 5)
    _check_frequencies(preempt, 5)


@pytest.mark.vllm
def test_logged_propensities_on_the_real_scheduler(learned_runs: dict) -> None:  # noqa: F811
    """In a real run's decisions telemetry, E[1 / p(logged action)] equals the number of candidates.

    (For any behaviour policy with full support, sum_a p(a) / p(a) = n.) Checked with a 4-sigma CLT bound.
    """
    from data.io import read_telemetry

    d = read_telemetry(learned_runs["train1"] / "telemetry", "decisions").to_pandas()
    assert set(d["policy"]) == {"logging"}
    n = d["candidate_ids"].map(len).to_numpy()
    p = d["propensity"].to_numpy()
    assert ((p > 0) & (p <= 1)).all()
    assert (p[n == 1] == 1).all()
    explored = (n >= 2) & (p < 1)  # starved decisions are deterministic (propensity 1)
    assert explored.sum() >= 200
    x = 1.0 / p[explored] - n[explored]
    se = x.std(ddof=1) / np.sqrt(len(x))
    assert abs(x.mean()) <= 4 * se, (x.mean(), se)
