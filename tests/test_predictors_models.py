"""Length and reuse models: fit / predict / save / load, schema checks, compiled trees, policy protocols."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from policy.interface import CachedPrefix, CandidateRequest, Event, EventKind, OwnerState, RequestMeta, RequestStatus
from predictors.features import LENGTH_FEATURES, length_features, prepare_requests
from predictors.length import LengthModel
from predictors.model_io import ModelSchemaError
from predictors.pipeline import Bundle, evaluate_bundle, train_bundle
from predictors.reuse import ReuseModel
from tests.test_predictors_features import fake_telemetry, small_workload

TREES = 20


@pytest.fixture(scope="module")
def log():
    w = small_workload(steps=3, prompts=8)
    return w, prepare_requests(fake_telemetry(w), w)


@pytest.fixture(scope="module")
def bundle(log):
    return train_bundle(log[1], test_steps=[2], num_trees=TREES, num_threads=1)


def test_fit_predict_shapes_and_quantile_order(bundle, log):
    X = length_features(log[1], at="admit", vocab=bundle.length.vocab)
    p = bundle.length.predict(X)
    assert p.shape == (len(X), 2)
    assert (p[:, 1] >= p[:, 0]).all() and (p[:, 0] >= 1).all()
    r = bundle.report
    assert r["train_steps"] == [0, 1] and r["test_steps"] == [2]
    for key in ("kendall_tau", "pinball_p50", "mae"):
        assert math.isfinite(r["length"][key])
    assert set(r["length"]["baselines"]) == {"domain_mean", "prompt_history"}
    assert 0.0 <= r["reuse"]["auc"] <= 1.0 and set(r["reuse"]["baselines"]) == {"recency", "frequency"}


def test_save_load_roundtrip_and_eval(bundle, log, tmp_path):
    bundle.save(tmp_path / "m")
    loaded = Bundle.load(tmp_path / "m", compiled=False)
    X = length_features(log[1], at="admit", vocab=bundle.length.vocab)
    np.testing.assert_allclose(loaded.length.predict(X), bundle.length.predict(X))
    rep = evaluate_bundle(loaded, log[1], steps=[2])
    assert rep["length"]["mae"] == pytest.approx(bundle.report["length"]["mae"])
    assert rep["reuse"]["brier"] == pytest.approx(bundle.report["reuse"]["brier"])


@pytest.mark.parametrize("field,value", [("feature_schema_version", 999), ("data_schema_version", -1),
                                         ("features", ["domain", "prompt_tokens"]), ("kind", "reuse")])
def test_model_saved_under_another_schema_fails_loudly(bundle, tmp_path, field, value):
    path = bundle.length.save(tmp_path / "len")
    m = json.loads((path / "manifest.json").read_text())
    m[field] = value
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ModelSchemaError, match="another schema"):
        LengthModel.load(path)


def test_missing_manifest_fails(tmp_path):
    with pytest.raises(ModelSchemaError):
        ReuseModel.load(tmp_path)


def test_compiled_trees_match_lightgbm(bundle, log):
    X = length_features(log[1], at="admit", vocab=bundle.length.vocab)[list(LENGTH_FEATURES)].to_numpy()
    m = bundle.length
    ref = m.predict_features(X)
    assert m.compile()
    try:
        np.testing.assert_allclose(m.predict_features(X), ref, rtol=1e-12)
        assert m.engine == "compiled"
    finally:
        m.use_lightgbm()
    r = bundle.reuse
    from predictors.features import REUSE_FEATURES, reuse_rows

    R = reuse_rows(log[1], vocab=r.vocab)[list(REUSE_FEATURES)].to_numpy()
    ref = r.predict_features(R)
    assert r.compile()
    try:
        np.testing.assert_allclose(r.predict_features(R), ref, rtol=1e-9, atol=1e-12)
    finally:
        r.use_lightgbm()


def _meta(row) -> RequestMeta:
    return RequestMeta(domain=row.domain, paradigm=row.paradigm, group_id=row.group_id, group_size=8,
                       session_id=row.session_id, turn=int(row.turn), tool=None, step=int(row.step))


def _candidate(row) -> CandidateRequest:
    return CandidateRequest(request_id=row.request_id, meta=_meta(row), status=RequestStatus.WAITING,
                            prompt_token_ids=(), num_prompt_tokens=int(row.prompt_tokens), num_cached_tokens=-1,
                            num_computed_tokens=0, num_output_tokens=0, max_tokens=int(row.max_tokens),
                            arrival_s=float(row.arrival_s), wait_s=0.0)


def _events(df, workload):
    tools = dict(zip(workload.column("request_id").to_pylist(), workload.column("tool").to_pylist()))
    ev = []
    for r in df.itertuples():
        m = _meta(r)
        ev.append((r.arrival_s, 2, Event(EventKind.ARRIVED, r.arrival_s, r.request_id, m,
                                         num_prompt_tokens=int(r.prompt_tokens))))
        ev.append((r.first_scheduled_s, 3, Event(EventKind.SCHEDULED, r.first_scheduled_s, r.request_id, m)))
        ev.append((r.finish_s, 0, Event(EventKind.FINISHED, r.finish_s, r.request_id, m,
                                        num_prompt_tokens=int(r.prompt_tokens), num_output_tokens=int(r.output_tokens),
                                        finish_reason=r.finish_reason)))
        if r.finish_reason == "tool_call":
            mt = RequestMeta(**{**{k: getattr(m, k) for k in m.__slots__}, "tool": tools[r.request_id]})
            ev.append((r.finish_s, 1, Event(EventKind.TOOL_CALL_STARTED, r.finish_s, r.request_id, mt)))
    ev.sort(key=lambda e: (e[0], e[1]))
    return ev


def test_online_features_match_offline_features_on_a_replayed_log(bundle, log):
    """The LengthPredictor's own state, fed the log's events up to a decision, gives the offline features."""
    workload, df = log
    m = LengthModel(bundle.length.boosters, bundle.length.vocab)
    offline = length_features(df, at="arrival", vocab=m.vocab).set_index("request_id")
    events = _events(df, workload)
    rows = sorted(df.itertuples(), key=lambda r: r.arrival_s)
    j = 0
    compared = 0
    for r in rows[:: max(1, len(rows) // 120)]:
        # everything before the decision, and outcomes (finish, tool call) at its very instant
        while j < len(events) and (events[j][0] < r.arrival_s or (events[j][0] == r.arrival_s
                                                                   and events[j][1] <= 1)):
            m.observe(events[j][2])
            j += 1
        _, online = m.request_features(_candidate(r))
        want = offline.loc[r.request_id, list(LENGTH_FEATURES)].to_numpy(float)
        np.testing.assert_allclose(np.asarray(online, float), want, rtol=1e-9, equal_nan=True,
                                   err_msg=f"{r.request_id}: {list(LENGTH_FEATURES)}")
        compared += 1
    assert compared > 50


def test_length_model_is_a_length_predictor_with_per_request_caching(bundle, log):
    _, df = log
    m = LengthModel(bundle.length.boosters, bundle.length.vocab)
    rows = list(df[df["step"] == 2].itertuples())[:16]
    cands = [_candidate(r) for r in rows]
    out = m.predict(cands)
    assert len(out) == 16 and all(isinstance(p, tuple) and p[1] >= p[0] > 0 for p in out)
    assert m.rows_scored == 16
    assert m.predict(cands) == out and m.rows_scored == 16  # cached
    # a sibling finishing changes the features of its group: those requests are rescored
    r0 = rows[0]
    m.observe(Event(EventKind.FINISHED, 1e9, "other", _meta(r0), num_output_tokens=123, finish_reason="stop"))
    m.predict(cands)
    same_group = sum(1 for r in rows if r.group_id == r0.group_id)
    assert m.rows_scored == 16 + same_group
    # predictions never exceed max_tokens
    assert all(p[1] <= c.max_tokens for p, c in zip(m.predict(cands), cands))


def test_reuse_model_is_a_reuse_predictor(bundle, log):
    _, df = log
    m = ReuseModel(bundle.reuse.boosters, bundle.reuse.vocab, bundle.reuse.horizon_s)
    r = next(df[df["finish_reason"] == "tool_call"].itertuples())
    meta = _meta(r)
    m.observe(Event(EventKind.ARRIVED, r.arrival_s, r.request_id, meta, num_prompt_tokens=int(r.prompt_tokens)))
    m.observe(Event(EventKind.SCHEDULED, r.first_scheduled_s, r.request_id, meta))
    m.observe(Event(EventKind.FINISHED, r.finish_s, r.request_id, meta, num_output_tokens=int(r.output_tokens),
                    finish_reason="tool_call"))
    p = CachedPrefix(prefix_id=r.request_id, owner_request_id=r.request_id, owner_state=OwnerState.PAUSED_TOOL,
                     meta=meta, block_ids=(1, 2, 3), block_hashes=(5, 6, 7), last_used_s=r.finish_s)
    now = r.finish_s + 0.5
    (t,) = m.next_use_s([p], now)
    assert t >= now or math.isinf(t)
    (prob,) = m.reuse_probability([p], now)
    assert 0.0 <= prob <= 1.0
    assert m.next_use_s([], now) == []


def test_a_trained_models_directory_is_a_policy_predictor_option(bundle, tmp_path):
    """``length_predictor`` / ``reuse_predictor`` take a trained model's directory (or the predictors holding it),
    so JSON policy options (``--policy-options``) can drive any policy with kvpilot's models."""
    from policy.catalog import create_policy
    from policy.predictors import LENGTH_PREDICTOR, REUSE_PREDICTOR, resolve_predictor

    bundle.save(tmp_path / "m")
    assert isinstance(resolve_predictor(LENGTH_PREDICTOR, str(tmp_path / "m")), LengthModel)
    assert isinstance(resolve_predictor(REUSE_PREDICTOR, tmp_path / "m" / "reuse"), ReuseModel)
    p = create_policy("oracle-offload", length_predictor=str(tmp_path / "m"), reuse_predictor=str(tmp_path / "m"))
    assert isinstance(p.lengths, LengthModel) and isinstance(p.reuse, ReuseModel)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"reuse_predictor '.*empty': cannot load a trained reuse model"):
        resolve_predictor(REUSE_PREDICTOR, str(tmp_path / "empty"), policy="X")
    with pytest.raises(ValueError, match="unknown length_predictor .*nowhere.*directory of a trained length model"):
        resolve_predictor(LENGTH_PREDICTOR, str(tmp_path / "nowhere"))
