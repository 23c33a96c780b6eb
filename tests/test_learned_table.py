"""The learned policy's per-request feature table gives the scorer the same input as building it afresh.

Run through vLLM's real scheduler (the hook's candidates, events and preemptions), both in serving mode
(learned) and in the behaviour policy's log mode, on a workload that preempts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from policy.learned import LearnedPolicy, LoggingPolicy, _predict, build_scorer, candidate_raw
from policy.learned_features import model_features
from tests.learned_logs import KV_FRACTION, tiny_workload
from tests.test_learned import FixedLengths


class Lengths(FixedLengths):
    """Predictions that change when a sibling finishes (as the LightGBM model's do), else fixed per request."""

    def __init__(self) -> None:
        super().__init__({})

    def predict(self, cands):
        return [(100.0 + len(c.request_id) * 7 + 50 * c.group_finished, 300.0 + 90 * c.group_finished)
                for c in cands]


def _checked(policy):
    """Wrap ``policy.table.features`` to compare each decision's input with the full, from-scratch build."""
    table = policy.table
    features = table.features
    seen = {"calls": 0, "rows": 0, "incremental": 0}

    def check(cands, state, refresh=False):
        tracking = table.tracking
        x, idx = features(cands, state, refresh)
        want = model_features(candidate_raw(cands, _predict(policy.lengths, cands), state, policy.phase))
        np.testing.assert_array_equal(x, want)
        seen["calls"] += 1
        seen["rows"] += len(cands)
        seen["incremental"] += tracking and not refresh
        return x, idx

    table.features = check
    return seen


@pytest.mark.parametrize("kind", ["learned", "logging"])
def test_table_features_equal_a_fresh_build(vllm_engine, tmp_path: Path, kind: str) -> None:
    import torch

    from simulator.simulation import run_simulation

    if kind == "learned":
        torch.manual_seed(0)
        state = {k: v.detach().numpy() for k, v in build_scorer().state_dict().items()}
        policy = LearnedPolicy(state, Lengths())
    else:
        policy = LoggingPolicy(Lengths())
    seen = _checked(policy)
    res = run_simulation(tiny_workload(5), policy, kv_fraction=KV_FRACTION, out_dir=tmp_path, progress=False)
    assert seen["incremental"] > 20 and seen["rows"] > 200, seen
    assert res.summary["preemptions"] > 0  # running rows were preempted back into the queue
