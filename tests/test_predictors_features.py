"""Predictor features: decision-time semantics, no reads of the future, reuse labels."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from data.io import read_telemetry, write_telemetry_part
from data.schemas import REQUESTS
from data.synth import SynthConfig, generate
from predictors.features import (
    LENGTH_CATEGORICAL,
    LENGTH_FEATURES,
    REUSE_CATEGORICAL,
    REUSE_FEATURES,
    Vocab,
    length_features,
    mask_future,
    prepare_requests,
    prompt_key,
    reuse_rows,
    workload_as_requests,
)


def fake_telemetry(workload: pa.Table, seed: int = 0) -> pa.Table:
    """A requests telemetry table for a workload, with made-up but consistent times (no simulator).

    Step s starts at 1000 s; each request waits a random while, decodes at 1 ms a token;
    turn k+1 arrives when turn k has finished plus its tool latency; scoring requests
    arrive when their trajectory's last turn has finished.
    """
    w = workload.to_pandas()
    rng = np.random.default_rng(seed)
    finish: dict[tuple[str, int], float] = {}
    rows = []
    last_of: dict[str, float] = {}
    order = w.sort_values(["step", "kind", "turn"], kind="stable")
    for r in order.itertuples():
        if r.kind == "scoring":
            arrival = last_of[r.scores_session_id]
        elif r.turn == 0:
            arrival = 1000.0 * r.step
        else:
            prev = w.loc[(w.session_id == r.session_id) & (w.turn == r.turn - 1)].iloc[0]
            arrival = finish[(r.session_id, r.turn - 1)] + float(prev.tool_latency_s or 0.0)
        sched = arrival + float(rng.exponential(2.0))
        fin = sched + 0.05 + 0.001 * r.output_tokens
        finish[(r.session_id, r.turn)] = fin
        last_of[r.session_id] = max(last_of.get(r.session_id, 0.0), fin)
        rows.append(dict(
            request_id=r.request_id, session_id=r.session_id, group_id=r.group_id, prompt_id=None, step=r.step,
            turn=r.turn, domain=r.domain, paradigm=r.paradigm, replica=0, arrival_s=arrival,
            first_scheduled_s=sched, first_token_s=sched + 0.05, finish_s=fin, prompt_tokens=r.prompt_tokens,
            cached_tokens=0, output_tokens=r.output_tokens, computed_tokens=r.prompt_tokens + r.output_tokens,
            max_tokens=r.max_tokens, finish_reason=r.finish_reason, preemptions=0, held_s=0.0,
            block_hashes=list(r.block_hashes)))
    df = pd.DataFrame(rows)
    return pa.Table.from_pandas(df, schema=REQUESTS.schema, preserve_index=False)


def small_workload(steps: int = 3, prompts: int = 8, seed: int = 0) -> pa.Table:
    return generate(SynthConfig(steps=steps, prompts_per_step=prompts, seed=seed))


@pytest.fixture(scope="module")
def small_log():
    w = small_workload()
    return w, prepare_requests(fake_telemetry(w), w)


def test_fake_telemetry_is_valid(tmp_path):
    w = small_workload(steps=2, prompts=4)
    write_telemetry_part(tmp_path, "requests", fake_telemetry(w), 0)
    assert read_telemetry(tmp_path, "requests").num_rows == w.num_rows


def test_prompt_key_strips_the_step_prefix():
    assert prompt_key(None, "s3-math-00012", 3) == "math-00012"
    assert prompt_key("p1", "s3-math-00012", 3) == "p1"
    assert prompt_key(None, "search_r1:s0:g4", 0) == "search_r1:s0:g4"
    assert prompt_key(None, None) is None


def _check_no_future(df: pd.DataFrame, cut: float, rng) -> int:
    """Features of decisions taken by ``cut`` are equal on the full log and on the log as it stood at ``cut``."""
    lv, rv = Vocab.fit(df, LENGTH_CATEGORICAL), Vocab.fit(df, REUSE_CATEGORICAL)
    masked = mask_future(df, cut, rng)
    checked = 0
    for at in ("arrival", "admit"):
        a = length_features(df, at=at, vocab=lv).set_index("request_id")
        b = length_features(masked, at=at, vocab=lv).set_index("request_id")
        keep = [k for k in a.index[a["t"] <= cut] if k in b.index]
        assert len(keep) == int((a["t"] <= cut).sum())  # every decision before the cut is in the masked log
        x, y = a.loc[keep, list(LENGTH_FEATURES)].to_numpy(), b.loc[keep, list(LENGTH_FEATURES)].to_numpy()
        bad = ~np.isclose(x, y, equal_nan=True)
        assert not bad.any(), f"length features read the future: {np.array(LENGTH_FEATURES)[bad.any(0)]}"
        checked += len(keep)
    ra = reuse_rows(df, vocab=rv)
    rb = reuse_rows(masked, vocab=rv)
    ra = ra[ra["t"] <= cut].set_index(["request_id", "offset"])
    rb = rb[rb["t"] <= cut].set_index(["request_id", "offset"])
    common = ra.index.intersection(rb.index)
    assert len(common) == len(ra)
    x, y = ra.loc[common, list(REUSE_FEATURES)].to_numpy(), rb.loc[common, list(REUSE_FEATURES)].to_numpy()
    bad = ~np.isclose(x, y, equal_nan=True)
    assert not bad.any(), f"reuse features read the future: {np.array(REUSE_FEATURES)[bad.any(0)]}"
    return checked + len(common)


def test_replayed_log_features_never_read_the_future(small_log):
    _, df = small_log
    rng = np.random.default_rng(7)
    ends = df["finish_s"].to_numpy(float)
    cuts = [1.0, 5.0, 1000.5, 1010.0, float(np.quantile(ends, 0.8))]
    checked = sum(_check_no_future(df, c, rng) for c in cuts)
    assert checked > 100


def test_masking_is_not_vacuous(small_log):
    """A feature built from future outcomes would differ: the masked log really scrambles them."""
    _, df = small_log
    cut = 1005.0
    masked = mask_future(df, cut).set_index("request_id")
    late = df[df["finish_s"] > cut].set_index("request_id")
    later = late.index.intersection(masked.index)
    assert len(later) > 0
    assert (masked.loc[later, "output_tokens"] != late.loc[later, "output_tokens"]).mean() > 0.9


def test_sibling_features_count_only_finished_siblings():
    rows = []
    for i, (fin, out) in enumerate([(1.0, 100), (2.0, 300), (5.0, 50)]):
        rows.append(dict(request_id=f"g-{i}-t0", session_id=f"g-{i}", group_id="s0-p", prompt_id=None, step=0, turn=0,
                         domain="math", paradigm="math_verifier", arrival_s=0.0, first_scheduled_s=0.0 if i < 3 else 3,
                         finish_s=fin, prompt_tokens=10, output_tokens=out, max_tokens=1000, finish_reason="stop",
                         block_hashes=[1, 2]))
    rows.append(dict(request_id="g-3-t0", session_id="g-3", group_id="s0-p", prompt_id=None, step=0, turn=0,
                     domain="math", paradigm="math_verifier", arrival_s=0.0, first_scheduled_s=3.0, finish_s=9.0,
                     prompt_tokens=10, output_tokens=7, max_tokens=1000, finish_reason="stop", block_hashes=[1, 2]))
    df = prepare_requests(pd.DataFrame(rows))
    f = length_features(df, at="admit").set_index("request_id")
    assert f.loc["g-3-t0", "sib_n"] == 2
    assert f.loc["g-3-t0", "sib_mean"] == pytest.approx((math.log1p(100) + math.log1p(300)) / 2)
    assert f.loc["g-3-t0", "sib_max"] == pytest.approx(math.log1p(300))
    a = length_features(df, at="arrival").set_index("request_id")
    assert (a["sib_n"] == 0).all() and a["sib_mean"].isna().all()


def test_prompt_history_uses_earlier_steps_only(small_log):
    w, df = small_log
    f = length_features(df, at="arrival")
    assert (f.loc[f["step"] == 0, "hist_n"] == 0).all()
    later = f[f["step"] > 0]
    assert (later["hist_n"] > 0).any()  # repeat_fraction re-draws prompts
    # a recurring prompt's history is the mean log length of its earlier steps
    row = later[later["hist_n"] > 0].iloc[0]
    prev = df[(df["pkey"] == row["pkey"]) & (df["step"] < row["step"])]
    assert row["hist_n"] == len(prev)
    assert row["hist_mean"] == pytest.approx(prev["y"].mean())


def test_reuse_label_is_next_use_of_the_sharing_key():
    # owner finishes at 1; a sibling is first scheduled at 4, another at 30
    base = dict(group_id="s0-p", prompt_id=None, step=0, turn=0, domain="math", paradigm="math_verifier",
                prompt_tokens=32, output_tokens=5, max_tokens=10, finish_reason="stop", block_hashes=[11, 12])
    rows = [dict(base, request_id="a", session_id="a", arrival_s=0.0, first_scheduled_s=0.0, finish_s=1.0),
            dict(base, request_id="b", session_id="b", arrival_s=0.0, first_scheduled_s=4.0, finish_s=5.0),
            dict(base, request_id="c", session_id="c", arrival_s=0.0, first_scheduled_s=30.0, finish_s=31.0)]
    df = prepare_requests(pd.DataFrame(rows))
    r = reuse_rows(df, offsets=(0.0, 5.0), horizon_s=10.0).set_index(["request_id", "offset"])
    assert r.loc[("a", 0.0), "tnext"] == pytest.approx(3.0)
    assert r.loc[("a", 0.0), "hit"] == 1.0
    assert r.loc[("a", 0.0), "key_waiting"] == 2  # b and c arrived, not scheduled
    assert r.loc[("a", 5.0), "tnext"] == pytest.approx(24.0)
    assert r.loc[("a", 5.0), "hit"] == 0.0
    assert r.loc[("a", 5.0), "hits"] == 2  # a and b scheduled by t = 6
    assert r.loc[("a", 5.0), "since_use"] == pytest.approx(2.0)
    assert math.isinf(r.loc[("c", 0.0), "tnext"])


def test_workload_only_features_see_earlier_turns_not_siblings_of_the_same_turn():
    w = small_workload(steps=2, prompts=8)
    f = length_features(workload_as_requests(w), at="admit")
    rollout = f["domain_name"] != "reward"
    assert (f.loc[rollout, "sib_n"] == 0).all()
    assert (f.loc[rollout & (f["turn"] > 0), "grp_n"] > 0).all()
    assert (f.loc[~rollout, "sib_n"] > 0).all()  # a scoring request comes after its group's rollouts
