"""``kvpilot_prompt_id``: metadata -> RequestMeta -> telemetry, and the prompt-history features that key on it."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import pytest

from policy.interface import CandidateRequest, Event, EventKind, RequestMeta, RequestStatus
from predictors.features import LENGTH_CATEGORICAL, LENGTH_FEATURES, Vocab, length_features, prepare_requests
from serving_hook.metadata import parse_extra_args


def test_metadata_reads_the_prompt_id():
    assert parse_extra_args({"kvpilot_prompt_id": "gsm8k-17"}).prompt_id == "gsm8k-17"
    assert parse_extra_args({"kvpilot_prompt_id": 17}).prompt_id == "17"  # ids given as numbers
    assert parse_extra_args({"kvpilot_prompt_id": ["x"]}).prompt_id is None  # wrong type: ignored
    assert parse_extra_args({"kvpilot_group_id": "g"}).prompt_id is None


def test_metadata_reads_the_rollouts_max_tokens():
    """``kvpilot_max_tokens``: what the rollout asked for, where the request's own forces its length (replay)."""
    assert parse_extra_args({"kvpilot_max_tokens": 3000}).max_tokens == 3000
    assert parse_extra_args({"kvpilot_max_tokens": "256"}).max_tokens == 256
    assert parse_extra_args({"kvpilot_max_tokens": 0}).max_tokens is None  # out of range: ignored
    assert parse_extra_args({}).max_tokens is None


def _row(rid: str, group: str, prompt: str | None, step: int, out: int, t: float) -> dict:
    return dict(request_id=rid, session_id=rid, group_id=group, prompt_id=prompt, step=step, turn=0, domain="math",
                paradigm="math_verifier", arrival_s=t, first_scheduled_s=t, finish_s=t + 1.0, prompt_tokens=10,
                output_tokens=out, max_tokens=1000, finish_reason="stop", block_hashes=[1])


def test_prompt_history_follows_the_prompt_id_not_the_group_naming():
    """Group ids without the ``s<step>-`` convention: only the prompt id says that step 1 re-asks step 0's prompt."""
    rows = [_row("a0", "grp-x", "P", 0, 100, 0.0), _row("a1", "grp-x", "P", 0, 300, 0.0),
            _row("b0", "grp-y", "P", 1, 50, 10.0), _row("c0", "grp-z", "Q", 1, 70, 10.0)]
    f = length_features(prepare_requests(pd.DataFrame(rows)), at="arrival").set_index("request_id")
    assert f.loc["b0", "hist_n"] == 2
    assert f.loc["b0", "hist_mean"] == pytest.approx((math.log1p(100) + math.log1p(300)) / 2)
    assert f.loc["c0", "hist_n"] == 0
    without = [dict(r, prompt_id=None) for r in rows]
    g = length_features(prepare_requests(pd.DataFrame(without)), at="arrival").set_index("request_id")
    assert g.loc["b0", "hist_n"] == 0  # the group ids alone do not link the steps


def test_online_length_features_use_meta_prompt_id():
    """The online LengthModel keys its prompt history on ``RequestMeta.prompt_id``, as the offline features do."""
    from predictors.length import LengthModel

    rows = [_row("a0", "grp-x", "P", 0, 100, 0.0), _row("b0", "grp-y", "P", 1, 50, 10.0)]
    vocab = Vocab.fit(prepare_requests(pd.DataFrame(rows)), LENGTH_CATEGORICAL)
    model = LengthModel({}, vocab)
    done = RequestMeta(domain="math", group_id="grp-x", step=0, turn=0, prompt_id="P")
    model.observe(Event(EventKind.FINISHED, 1.0, "a0", done, num_prompt_tokens=10, num_output_tokens=100,
                        finish_reason="stop"))

    def hist_n(meta: RequestMeta) -> float:
        c = CandidateRequest("b0", meta, RequestStatus.WAITING, (), 10, -1, 0, 0, 1000, 10.0, 0.0)
        return model.request_features(c)[1][LENGTH_FEATURES.index("hist_n")]

    assert hist_n(RequestMeta(domain="math", group_id="grp-y", step=1, turn=0, prompt_id="P")) == 1
    assert hist_n(RequestMeta(domain="math", group_id="grp-y", step=1, turn=0, prompt_id="Q")) == 0


@pytest.mark.vllm
def test_simulated_telemetry_carries_the_workload_prompt_id(vllm_engine: Any, tmp_path):
    """The simulator passes each row's prompt id as ``kvpilot_prompt_id``; the hook writes it to telemetry."""
    from data.io import read_telemetry
    from data.synth import SynthConfig, generate
    from simulator.simulation import run_simulation

    w = generate(SynthConfig(steps=1, prompts_per_step=2, group_size=2, seed=3))
    run_simulation(w, "vllm-default", kv_fraction=1.0, progress=False, out_dir=tmp_path)
    req = read_telemetry(tmp_path / "telemetry", "requests").to_pydict()
    want = dict(zip(w.column("request_id").to_pylist(), w.column("prompt_id").to_pylist()))
    got = dict(zip(req["request_id"], req["prompt_id"]))
    assert got == want and all(v is not None for v in got.values())
