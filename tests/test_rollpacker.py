"""Tail batching after RollPacker: the driver keeps the first R samples of the first P complete prompts, cuts the
rest into the long-prompt queue, and re-runs them from scratch as a long round (exact ids on a hand-built workload)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from data.schemas import WORKLOAD
from policy.baselines.rollpacker import TailBatchingPolicy, TailBatchingSpec
from policy.catalog import create_policy
from simulator.simulation import Overprovision, Simulation, SimulationError

# Per step: four prompts (groups) of four samples; output lengths per sample. With eta = 2, P = 2 prompts and
# R = 2 samples are kept: a and b complete first (their two short samples), c and d are cut.
LENGTHS = {"a": [5, 6, 300, 300], "b": [7, 8, 300, 300], "c": [100, 400, 400, 400], "d": [400, 400, 400, 400]}


def _workload(steps: int = 2, lengths_of: dict[str, list[int]] = LENGTHS, verify_s: float | None = None) -> pa.Table:
    rows = []
    h = 1000
    for step in range(steps):
        for gi, (g, lengths) in enumerate(lengths_of.items()):
            gid = f"s{step}{g}"
            for i, o in enumerate(lengths):
                rows.append({"request_id": f"{gid}-{i}", "kind": "rollout", "step": step, "prompt_id": gid,
                             "group_id": gid, "group_size": len(lengths), "sample_index": i,
                             "session_id": f"{gid}-{i}", "turn": 0, "domain": "math", "paradigm": "math_verifier",
                             "prompt_tokens": 40, "output_tokens": o, "max_tokens": 512, "finish_reason": "stop",
                             "block_size": 16, "block_hashes": [h + gi * 10, h + gi * 10 + 1, h + gi * 10 + 2],
                             "arrival_s": None, "verify_latency_s": verify_s})
        h += 1000
    return pa.Table.from_pylist(rows, schema=WORKLOAD.schema)


def test_spec_and_policy() -> None:
    p = create_policy("rollpacker", eta=1.25)
    assert isinstance(p, TailBatchingPolicy) and p.name == "rollpacker"
    assert p.step_driver.kind == "tail-batching" and p.step_driver.eta == 1.25
    assert TailBatchingSpec(1.25).kept(80) == 64 and TailBatchingSpec(1.25).kept(5) == 4
    assert TailBatchingSpec(2.0).kept(4) == 2 and TailBatchingSpec(2.0).kept(1) == 1
    with pytest.raises(ValueError, match="eta"):
        create_policy("rollpacker", eta=0.5)


@pytest.mark.vllm
def test_tail_batching_cuts_and_runs_long_rounds(vllm_engine: Any) -> None:
    sim = Simulation(_workload(), "rollpacker", policy_options={"eta": 2.0}, kv_fraction=1.0, progress=False)
    result = sim.run()
    # each step cuts exactly the two long prompts, which run as a long round right after it
    assert sim.driver.cut_prompts == {0: ["s0c", "s0d"], 1: ["s1c", "s1d"]}
    assert sim.driver.long_rounds == [(2, ["s0c", "s0d"]), (3, ["s1c", "s1d"])]
    order = [s.step for s in sorted(result.rl_steps, key=lambda s: s.start_s)]
    assert order == [0, 2, 1, 3]
    kept = {}
    for t in result.trajectories:
        kept.setdefault(t.step, set()).add(t.session_id)
    assert kept[0] == {"s0a-0", "s0a-1", "s0b-0", "s0b-1"}  # P x R = 2 x 2, the first two of each kept prompt
    assert kept[1] == {"s1a-0", "s1a-1", "s1b-0", "s1b-1"}
    assert kept[2] == {f"s0{g}-{i}" for g in "cd" for i in range(4)}  # long rounds run every sample, no cut
    assert kept[3] == {f"s1{g}-{i}" for g in "cd" for i in range(4)}
    rids = set(result.requests.column("request_id").to_pylist())
    assert {f"s0{g}-{i}#long0" for g in "cd" for i in range(4)} <= rids
    assert {f"s1{g}-{i}#long1" for g in "cd" for i in range(4)} <= rids
    steps = {s.step: s for s in result.rl_steps}
    assert steps[2].start_s == steps[0].end_s and steps[1].start_s == steps[2].end_s
    # the long round re-submits each cut prompt's samples from scratch: each cut row ran twice (aborted, then full)
    rows = {r: i for i, r in enumerate(_workload().column("request_id").to_pylist())}
    assert all(sim.submitted[rows[f"s0{g}-{i}"]] == 2 for g in "cd" for i in range(4))
    assert all(sim.submitted[rows[f"s0{g}-{i}"]] == 1 for g in "ab" for i in range(4))
    # 2 aborted samples per kept prompt + 8 per step of the cut prompts, in two steps
    assert result.summary.aborted_trajectories == 2 * (4 + 8)
    assert result.summary.metrics.trajectories == 2 * (4 + 8)


@pytest.mark.vllm
def test_long_round_ignores_the_cut_attempts_late_finish(vllm_engine: Any) -> None:
    # b's second kept sample finishes, and its verification (1 ms) ends while the next engine step runs: the cut
    # aborts c's first sample only when that step ends, and in that step it finishes (41 tokens). The long round
    # has by then given c's rows to fresh trajectories: the stale finish must not end the fresh one.
    lengths = {"a": [5, 6, 300, 300], "b": [7, 40, 300, 300], "c": [41, 400, 400, 400], "d": [400] * 4}
    sim = Simulation(_workload(1, lengths, verify_s=0.001), "rollpacker", policy_options={"eta": 2.0},
                     kv_fraction=1.0, decode_stride=8, progress=False)
    result = sim.run()
    assert sim.driver.long_rounds == [(1, ["s0c", "s0d"])]
    req = result.requests.to_pydict()
    finish = dict(zip(req["request_id"], req["finish_s"]))
    assert finish["s0c-0"] is not None  # the cut attempt did finish in the engine (not aborted in time)
    ends = sorted((t.session_id, t.end_s) for t in result.trajectories if t.step == 1)
    assert [s for s, _ in ends] == sorted(f"s0{g}-{i}" for g in "cd" for i in range(4))  # each ends once
    for session, end in ends:  # with its own request's verification
        assert end == pytest.approx(finish[f"{session}#long0"] + 0.001)


@pytest.mark.vllm
def test_tail_batching_queue_waits_until_full_then_flushes(vllm_engine: Any) -> None:
    # long rounds of 3 prompts: the queue holds 2 after step 0, 4 after step 1 (round of 3), 1 left at the end
    sim = Simulation(_workload(), "rollpacker", policy_options={"eta": 2.0, "long_round_prompts": 3},
                     kv_fraction=1.0, progress=False)
    result = sim.run()
    assert sim.driver.long_rounds == [(2, ["s0c", "s0d", "s1c"]), (3, ["s1d"])]
    order = [s.step for s in sorted(result.rl_steps, key=lambda s: s.start_s)]
    assert order == [0, 1, 2, 3]


def test_tail_batching_rejects_overprovision_and_traces() -> None:
    pytest.importorskip("vllm")
    with pytest.raises(SimulationError, match="not both"):
        Simulation(_workload(1), "rollpacker", overprovision=Overprovision(0.5), kv_fraction=1.0, progress=False)
