"""The CPU tier's trained next-use model: its features and labels, the model, the served order it changes, and the
training loop that replays a logged workload on vLLM's real scheduler."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from policy.common import furthest_first
from policy.interface import CachedPrefix, Event, EventKind, OwnerState, RequestMeta
from policy.session_reuse import TIER_FEATURES, SessionStateNextUse, TrainedNextUse, tier_features
from predictors.tier_reuse import FEATURES, TierReuseModel
from training.tier_training import TierConfig, TierRecorder, TierTrainingError


def _ev(kind: EventKind, t: float, sid: str, tool: str | None = None) -> Event:
    return Event(kind=kind, time_s=t, request_id=f"{sid}-{t}", meta=RequestMeta(session_id=sid, tool=tool))


def _owner(sid: str, state: OwnerState, tool: str | None = "bash", pos: int | None = None, turn: int = 1,
           blocks: int = 4) -> CachedPrefix:
    return CachedPrefix(sid, sid, state, RequestMeta(session_id=sid, tool=tool, turn=turn), (), (), 90.0,
                        tier_blocks=blocks, queue_position=pos)


def _rule_with_rate(per_s: float = 1.0) -> SessionStateNextUse:
    """A rule that has seen five admissions, ``per_s`` a second, the last at 100 s."""
    rule = SessionStateNextUse()
    for i in range(5):
        rule.observe(_ev(EventKind.SCHEDULED, 100.0 - (4 - i) / per_s, f"adm{i}"))
    return rule


OWNERS = [_owner("q0", OwnerState.WAITING, pos=0), _owner("q9", OwnerState.WAITING, pos=9),
          _owner("p", OwnerState.PAUSED_TOOL), _owner("r", OwnerState.RUNNING),
          _owner("last", OwnerState.RUNNING, tool=None), _owner("done", OwnerState.FINISHED, tool=None)]


def test_features_are_in_admissions_and_skip_owners_that_never_return() -> None:
    now = 100.0
    slow, fast = _rule_with_rate(1.0), _rule_with_rate(4.0)
    xs = []
    for rule in (slow, fast):
        rule.observe(_ev(EventKind.TOOL_CALL_STARTED, 97.0, "p", "bash"))
        X, idx = tier_features(rule, OWNERS, now, rule.next_use_s(OWNERS, now), rule.admission_rate(now))
        assert rule.admission_rate(now) == pytest.approx(1.0 if rule is slow else 4.0)
        assert X.shape == (4, len(FEATURES)) and idx == [0, 1, 2, 3]  # the last turn and the finished: never
        xs.append(X)
    assert TIER_FEATURES == len(FEATURES)
    col = {n: i for i, n in enumerate(FEATURES)}
    assert xs[0][:, col["state"]].tolist() == [0, 0, 1, 2]
    assert xs[0][1, col["log_queue_position"]] == pytest.approx(math.log1p(9))
    # a queued turn 9 places back is 9 admissions away at any engine speed: the rule's time in admissions agrees
    assert xs[0][1, col["log_rule_adm"]] == pytest.approx(xs[1][1, col["log_rule_adm"]]) == pytest.approx(
        math.log1p(9))
    # the paused session: 3 s paused is 3 admissions at 1/s and 12 at 4/s
    assert xs[0][2, col["log_paused_adm"]] == pytest.approx(math.log1p(3.0))
    assert xs[1][2, col["log_paused_adm"]] == pytest.approx(math.log1p(12.0))
    assert math.isnan(xs[0][0, col["log_paused_adm"]]) and math.isnan(xs[0][2, col["log_queue_position"]])


def test_recorder_labels_each_owner_with_its_sessions_next_scheduling() -> None:
    rule = _rule_with_rate(1.0)
    rec = TierRecorder(rule)
    for e in (_ev(EventKind.TOOL_CALL_STARTED, 97.0, "p", "bash"),):
        rec.observe(e)
    out = rec.next_use_s(OWNERS, 100.0)
    assert out == rule.next_use_s(OWNERS, 100.0)  # it answers as the predictor it wraps
    rate = rule.admission_rate(100.0)  # at the decision (later admissions move it)
    for sid, t in (("q0", 101.0), ("q9", 130.0), ("p", 105.0), ("p", 140.0)):  # "r" is never scheduled again
        rec.observe(_ev(EventKind.SCHEDULED, t, sid))
    X, y = rec.snapshots()
    assert len(X) == 3 and y.tolist() == pytest.approx([1.0 * rate, 30.0 * rate, 5.0 * rate])  # the first after


def test_model_checks_its_input_and_scores_the_same_compiled(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, len(FEATURES)))
    X[:, 0] = rng.integers(0, 3, 400)
    y = np.exp(X[:, 1]) + 1.0
    with pytest.raises(ValueError, match="columns"):
        TierReuseModel.fit(X[:, :3], y)
    with pytest.raises(ValueError, match="finite admissions"):
        TierReuseModel.fit(X, -y)
    model = TierReuseModel.fit(X, y, num_trees=20, num_threads=1)
    loaded = TierReuseModel.load(model.save(tmp_path / "tier"))
    assert loaded.engine == "compiled"
    np.testing.assert_allclose(loaded.predict(X), model.predict(X), rtol=1e-6, atol=1e-9)
    with pytest.raises(TierTrainingError):
        TierConfig(rounds=-1)
    for bad in ((), (1.0, 0.0), (math.inf,)):
        with pytest.raises(TierTrainingError, match="time scales"):
            TierConfig(time_scales=bad)


def test_changing_the_trained_model_changes_the_tier_order() -> None:
    """Two models trained on opposite outcomes (queued sessions come back late, or paused ones do) order the same
    owners at the same moment differently, against the rule's order; the owners that never return leave first
    whatever the model says."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(600, len(FEATURES)))
    X[:, 0] = rng.integers(0, 3, 600)
    late_queued = np.where(X[:, 0] == 0, 1000.0, 1.0)
    late_paused = np.where(X[:, 0] == 1, 1000.0, 1.0)
    orders = []
    for y in (late_queued, late_paused):
        pred = TrainedNextUse(TierReuseModel.fit(X, y, num_trees=30, num_threads=1))
        for i in range(5):
            pred.observe(_ev(EventKind.SCHEDULED, 96.0 + i, f"adm{i}"))
        pred.observe(_ev(EventKind.TOOL_CALL_STARTED, 97.0, "p", "bash"))
        orders.append(furthest_first(OWNERS, pred.next_use_s(OWNERS, 100.0)))
    for order in orders:
        assert set(order[:2]) == {"last", "done"}
    assert orders[0][2:4] == ["q0", "q9"] or orders[0][2:4] == ["q9", "q0"]  # the queued leave first
    assert orders[1][2] == "p"  # the paused one leaves first
    assert orders[0] != orders[1]


@pytest.mark.vllm
@pytest.mark.slow
def test_tier_training_replays_the_log_and_keeps_a_model_only_where_it_wins(vllm_engine, tmp_path: Path) -> None:
    """On a tiny logged agentic workload over a small CPU tier: the loop replays it under the rule and under the
    fitted model, records labelled snapshots, and the bundle serves the model exactly when it beat the rule."""
    import dataclasses

    from data.synth import SynthConfig, generate
    from policy.learned.bundle import TIER_REUSE_DIR
    from policy.learned.policy import LearnedPolicy
    from policy.learning.config import OfflineConfig
    from policy.learning.offline import train_policy
    from predictors.logs import load_logs
    from predictors.pipeline import train_bundle
    from simulator.simulation import run_simulation
    from training.tier_training import train_tier

    workload = generate(dataclasses.replace(SynthConfig.preset("agentic"), steps=1, prompts_per_step=3,
                                            group_size=4, seed=3))
    log = tmp_path / "log"
    run_simulation(workload, "logging", kv_fraction=0.3, out_dir=log, progress=False, decode_stride=32,
                   offload_gib=0.2)
    import pyarrow.parquet as pq

    pq.write_table(workload, log / "workload.parquet")  # as `kvpilot simulate` does
    pred = train_bundle(load_logs([log]), num_trees=10, num_threads=1).save(tmp_path / "pred")
    policy_dir = tmp_path / "pol"
    train_policy([log], pred, policy_dir, OfflineConfig(epochs=1), progress=False)
    said: list[str] = []
    cfg = TierConfig(rounds=1, num_trees=10, jobs=1, time_scales=(1.0, 3.0))
    result = train_tier(policy_dir, [log], cfg, progress=said.append)
    assert said[0].startswith("tier: the rule's order") and "time scale(s) 1, 3" in said[0]
    assert len(result.history) == 1 and result.history[0]["rows"] > 0  # the tier decided, its owners labelled
    # the log replayed once per time scale, and the slower tools took longer
    fast, slow = result.history[0]["makespans_s"]
    assert slow > fast
    runtime = json.loads((policy_dir / "policy.json").read_text())["config"]["runtime"]
    served = LearnedPolicy.load(policy_dir)
    if result.kept:
        assert result.ratio == result.history[0]["ratio"] < 1.0 - cfg.min_gain
        assert runtime["reuse_predictor"] == "session-trained" and isinstance(served.reuse, TrainedNextUse)
    else:
        assert result.history[0]["ratio"] >= 1.0 - cfg.min_gain and result.ratio == 1.0
        assert runtime["reuse_predictor"] == "session-state" and type(served.reuse) is SessionStateNextUse
        assert not (policy_dir / "predictors" / TIER_REUSE_DIR).exists()
    # learned-prior serves the rule whatever was kept
    assert type(LearnedPolicy.load(policy_dir, reuse_predictor="session-state").reuse) is SessionStateNextUse
    # logs with no workload beside them cannot be replayed: a clear error before anything runs
    (log / "workload.parquet").unlink()
    with pytest.raises(TierTrainingError, match="workload.parquet"):
        train_tier(policy_dir, [log], cfg)
