"""Session models: labels from telemetry, no reads of the future, each model beside its baseline, the online
API, schema errors, and model directories without the session models."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pandas as pd
import pytest

from data.synth import SynthConfig, generate
from predictors.features import mask_future, prepare_requests
from predictors.pipeline import Bundle, evaluate_bundle, train_bundle
from predictors.session import SessionModel, session_ok
from predictors.session_features import SESSION_CATEGORICAL, SESSION_FEATURES, session_rows
from tests.test_predictors_features import fake_telemetry

TREES = 60


def agentic_workload(steps: int = 3, prompts: int = 12, seed: int = 0, session_icc: float = 0.6):
    """The agentic preset, smaller, with the sandbox's latency shared across a session's calls."""
    cfg = SynthConfig.preset("agentic")
    swe = cfg.domains["swe"]
    swe = dataclasses.replace(swe, tool=dataclasses.replace(swe.tool, session_icc=session_icc))
    return generate(dataclasses.replace(cfg, steps=steps, prompts_per_step=prompts, seed=seed,
                                        domains={**cfg.domains, "swe": swe}))


@pytest.fixture(scope="module")
def log():
    w = agentic_workload()
    return w, prepare_requests(fake_telemetry(w), w)


@pytest.fixture(scope="module")
def bundle(log):
    return train_bundle(log[1], test_steps=[2], num_trees=TREES, num_threads=1, reuse=False)


def test_labels_are_the_workload_tool_latencies_and_turn_counts(log):
    w, df = log
    R = session_rows(df)
    wl = w.to_pandas().set_index("request_id")
    calls = R[R["cont"] > 0]
    np.testing.assert_allclose(calls["latency_s"], wl.loc[calls["request_id"], "tool_latency_s"], rtol=1e-9)
    n = wl[wl["kind"] == "rollout"].groupby("session_id")["turn"].max() + 1
    want = n.loc[R["session_id"]].to_numpy() - 1 - R["turn"].to_numpy()
    np.testing.assert_array_equal(R["remaining"], want)
    assert ((R["remaining"] > 0) == (R["cont"] > 0)).all()
    assert (R["next_use_s"][R["cont"] > 0] >= R["latency_s"][R["cont"] > 0]).all()
    assert set(calls["tool_key"]) == {"sandbox", "search"}  # the workload's tools (telemetry has none)


def test_features_read_nothing_after_the_turn_finishes(log):
    _, df = log
    full = session_rows(df).set_index("request_id")
    for cut in np.quantile(df["finish_s"], [0.3, 0.6, 0.85]):
        masked = session_rows(mask_future(df, cut)).set_index("request_id")
        ids = full.index[full["t"] <= cut]
        assert len(ids) > 20
        pd.testing.assert_frame_equal(masked.loc[ids, list(SESSION_FEATURES)], full.loc[ids, list(SESSION_FEATURES)])


def test_each_session_model_beats_its_baseline_on_held_out_steps(bundle):
    S = bundle.report["session"]
    assert S["n_calls"] > 500
    assert session_ok(S) == {"tool_latency": True, "continue": True, "turns_remaining": True, "next_use": True}, S


def test_online_rows_match_the_feature_matrix_and_compiled_trees(bundle, log):
    m = bundle.session
    R = session_rows(log[1], m.vocab)
    R = R[R["step"] == 2].head(300)
    raw = log[1].set_index("request_id").loc[R["request_id"]]
    cols = {c: R[c].to_numpy() for c in SESSION_FEATURES if c not in SESSION_CATEGORICAL}
    cols.update({c: raw[c].to_numpy(object) for c in SESSION_CATEGORICAL})
    ref = m.predict_features(R[list(SESSION_FEATURES)])
    got = m.predict_rows(cols)
    for k in ("tool_latency_s", "p_continue", "turns_remaining", "next_use_s"):
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-9)
    assert m.compile()
    try:
        fast = m.predict_rows(cols)
        for k in ref:
            np.testing.assert_allclose(fast[k], ref[k], rtol=1e-9, atol=1e-12)
    finally:
        m.use_lightgbm()
    few = m.predict_rows({"domain": ["swe", "agentic"], "turn": [3, 0], "prompt_tokens": [9000, 320],
                          "output_tokens": [200, 40]})
    assert few["p_continue"].shape == (2,) and np.all((few["p_continue"] > 0) & (few["p_continue"] < 1))
    assert np.all(few["next_use_s"] >= few["tool_latency_s"] - 1e-9)


def test_missing_columns_are_named(log, bundle):
    with pytest.raises(ValueError, match="session_id"):
        session_rows(log[1].drop(columns=["session_id"]))
    with pytest.raises(ValueError, match="turn"):
        bundle.session.predict_rows({"domain": ["swe"], "prompt_tokens": [1], "output_tokens": [1]})
    with pytest.raises(ValueError, match="sib_done"):
        bundle.session.predict_rows({"domain": ["swe"], "turn": [1], "prompt_tokens": [1], "output_tokens": [1],
                                     "sib_done": [1]})
    with pytest.raises(ValueError, match="latency_s"):
        SessionModel.fit_rows(session_rows(log[1]).drop(columns=["latency_s"]), bundle.session.vocab)


def test_save_load_and_a_directory_without_session_models(bundle, log, tmp_path):
    path = bundle.save(tmp_path / "m")
    loaded = Bundle.load(path, compiled=False)
    rep = evaluate_bundle(loaded, log[1], steps=[2])
    assert rep["session"]["tool_latency"]["model"]["mae"] == pytest.approx(
        bundle.report["session"]["tool_latency"]["model"]["mae"])
    assert rep["session"]["continue"]["turn_count_prior"]["auc"] == pytest.approx(
        bundle.report["session"]["continue"]["turn_count_prior"]["auc"])
    shutil.rmtree(path / "session")  # a directory written before the session models
    old = Bundle.load(path, compiled=False)
    assert old.session is None and "session" not in evaluate_bundle(old, log[1], steps=[2])


def test_single_turn_logs_skip_the_session_models_with_a_reason():
    w = generate(SynthConfig(steps=2, prompts_per_step=8, domains={"math": SynthConfig().domains["math"]}))
    b = train_bundle(prepare_requests(fake_telemetry(w), w), test_steps=[1], num_trees=5, num_threads=1, reuse=False)
    assert b.session is None and "multi-turn" in b.report["session"]["skipped"]
