"""The learned policy's fast inputs give the reference raw matrix at every decision, on vLLM's real scheduler.

:class:`policy.learned_inputs.CandidateInputs` keeps length predictions between
steps and asks the predictor only when an event may have changed them; this
checks it against :func:`policy.learned.candidate_raw` with the predictor asked
about every candidate (the behaviour it replaces) at every admission and
preemption decision of a run where siblings finish, groups of a second RL step
arrive while the first is still running, and requests are preempted.
"""

from __future__ import annotations

import numpy as np
import pytest

from policy.learned import LearnedPolicy, build_scorer, candidate_raw
from policy.learned_features import RAW


@pytest.fixture(scope="module")
def length_model():
    from data.synth import SynthConfig, generate
    from predictors.features import workload_as_requests
    from predictors.length import LengthModel

    return LengthModel.fit(workload_as_requests(generate(SynthConfig(steps=2, prompts_per_step=6))), num_trees=8)


def _meta(step: int, prompt: int) -> dict:
    dom = ("math", "code", "agentic")[prompt % 3]
    return {"kvpilot_domain": dom, "kvpilot_group_id": f"s{step}-p{prompt}", "kvpilot_group_size": 4,
            "kvpilot_step": step, "kvpilot_turn": 0}


@pytest.mark.parametrize("with_predictor", [True, False])
def test_fast_inputs_match_the_reference_at_every_decision(length_model, with_predictor: bool) -> None:
    import torch

    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig
    from simulator import engine

    torch.manual_seed(0)
    state = {k: v.detach().numpy() for k, v in build_scorer().state_dict().items()}
    policy = LearnedPolicy(state, length_model if with_predictor else None)
    fast = policy.inputs.raw
    checked = {"admit": 0, "preempt": 0, "hits": 0}
    stamps: dict = {}  # request id -> the length model's cache stamp when the prediction was kept

    def checking_raw(cands, st, phase):
        entries = policy.inputs.entries
        for c in cands:
            e = entries.get(c.request_id)
            kept = e is not None and e[0] == c.group_finished
            if with_predictor:  # a kept prediction: the model's own stamp has not moved either
                stamp = length_model.request_features(c)[0]
                if kept:
                    assert stamp == stamps[c.request_id], c.request_id
                else:
                    stamps[c.request_id] = stamp
            checked["hits"] += kept
        got = fast(cands, st, phase)
        preds = (length_model.predict(cands) if with_predictor else [(np.nan, np.nan)] * len(cands))
        want = candidate_raw(cands, preds, st, phase)
        assert got.shape == (len(cands), len(RAW))
        np.testing.assert_array_equal(got, want)
        if with_predictor:
            for c, p in zip(cands, preds):
                assert c.predictions == {"len_p50": float(p[0]), "len_p90": float(p[1])}
        kind = "preempt" if any(c.status.value == "running" for c in cands) else "admit"
        checked[kind] += 1
        return got

    policy.inputs.raw = checking_raw
    cls = with_policy(KVPilotScheduler, lambda: policy, HookConfig(decision_budget_s=10.0))
    s = engine.make_scheduler(cls, num_blocks=40, max_num_seqs=12, max_num_batched_tokens=512)
    runner = engine.FakeRunner()

    def add(step: int, prompt: int) -> None:
        for k in range(4):
            rid = f"s{step}-p{prompt}-{k}"
            s.add_request(engine.make_request(rid, engine.prompt_tokens(f"p{prompt}-{k}", 48), 6 + 9 * k + prompt,
                                              extra_args=_meta(step, prompt)))

    for p in range(4):
        add(0, p)
    for i in range(400):
        if i == 12:  # the next RL step's groups arrive while the first is still running
            for p in range(4):
                add(1, p)
        runner.step(s)
        if not s.requests:
            break
    assert not s.requests, "the run did not finish"
    assert s.kvpilot_stats.fallback_steps == 0, s.kvpilot_stats.fallbacks
    assert s.kvpilot_stats.preemptions > 0
    assert checked["admit"] >= 10 and checked["preempt"] >= 1 and checked["hits"] > 0, checked
