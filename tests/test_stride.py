"""The decode stride: k tokens per request per simulated step, against the exact path (k = 1)."""

from __future__ import annotations

import hashlib
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from data.synth import generate
from simulator.cost_model import CostModel
from simulator.simulation import Simulation, SimulationError
from tests.test_sim_run import check_conservation, check_step_rows, small_config

K = 8
KV = 0.25  # preempts: 15 preemptions at k = 1


def test_strided_step_time_is_prefill_once_plus_decode_iterations() -> None:
    c = CostModel.preset("H200-7B")
    assert c.strided_step_time(512, 40_000, [3, 2, 0], [9_000, 6_100, 0]) == pytest.approx(
        c.step_time(512, 40_000, 3, 9_000) + c.step_time(0, 0, 2, 6_100), rel=1e-12)
    assert c.strided_step_time(100, 5_050, [4], [800]) == c.step_time(100, 5_050, 4, 800)
    assert c.strided_step_time(0, 0, [0, 0], [0, 0]) == 0.0
    with pytest.raises(ValueError, match="one entry per iteration"):
        c.strided_step_time(0, 0, [1, 1], [10])


@pytest.fixture(scope="module")
def runs(vllm_engine: Any) -> dict[int, tuple[pa.Table, Simulation, Any]]:
    workload = generate(small_config(5, prompts=8, group=4, steps=1))
    out = {}
    for k in (1, K):
        sim = Simulation(workload, "vllm-default", kv_fraction=KV, decode_stride=k, progress=False)
        out[k] = (workload, sim, sim.run())
    return out


@pytest.mark.vllm
def test_stride_keeps_every_output_length_and_finish_reason(runs: dict) -> None:
    workload, sim, result = runs[K]
    check_conservation(workload, sim, result, stride=K)
    check_step_rows(result)
    assert result.summary.metrics.preemptions > 0


@pytest.mark.vllm
def test_stride_stays_close_to_the_exact_path(runs: dict) -> None:
    """Tolerances: makespan 2 %, preemptions 30 %, prefix hit rate 0.02; with 1/4 of the engine steps or fewer."""
    exact, strided = runs[1][2].summary, runs[K][2].summary
    assert strided.metrics.makespan_s == pytest.approx(exact.metrics.makespan_s, rel=0.02)
    assert strided.metrics.preemptions == pytest.approx(exact.metrics.preemptions, rel=0.3)
    assert strided.metrics.prefix_hit_rate == pytest.approx(exact.metrics.prefix_hit_rate, abs=0.02)
    assert strided.engine_steps <= exact.engine_steps / 4


@pytest.mark.vllm
def test_stride_telemetry_counts_decode_tokens_not_sequences(runs: dict) -> None:
    for k in (1, K):
        result = runs[k][2]
        steps, requests = result.steps, result.requests
        scheduled = pc.sum(steps.column("prefill_tokens")).as_py() + pc.sum(steps.column("decode_tokens")).as_py()
        assert scheduled == pc.sum(requests.column("computed_tokens")).as_py()
    decode = {k: pc.sum(runs[k][2].steps.column("decode_tokens")).as_py() for k in (1, K)}
    assert decode[K] == pytest.approx(decode[1], rel=0.05)  # counting sequences would give ~1/K of it


@pytest.mark.vllm
def test_stride_one_is_the_exact_path(runs: dict) -> None:
    """Pinned from the simulator before the stride existed (commit e82bd02): same makespan, steps and telemetry."""
    result = runs[1][2]
    s = result.summary
    h = hashlib.sha256()
    for c in ("time_s", "duration_s", "running", "waiting", "free_blocks", "prefill_tokens", "decode_tokens",
              "preemptions"):
        h.update(repr(result.steps.column(c).to_pylist()).encode())
    assert (s.metrics.makespan_s, s.engine_steps, s.metrics.preemptions, s.metrics.recomputed_tokens) == (
        9.238984162017964, 1031, 15, 9782)
    assert h.hexdigest() == "5c2d8554824ff5f83cb6a41da2ed36910f2cc4fbca9eb8c20cc716a70e01d318"


@pytest.mark.vllm
def test_a_lone_request_takes_as_long_as_at_stride_one(vllm_engine: Any) -> None:
    """One request alone: the strided steps charge the same prefill and decode iterations, with the same contexts."""
    w = generate(small_config(5, prompts=2, group=2, steps=1))
    rows = w.to_pylist()
    pick = next(r for r in rows if r["kind"] == "rollout" and r["domain"] == "code" and r["output_tokens"] > 50
                and sum(x["session_id"] == r["session_id"] for x in rows) == 1)
    lone = pa.Table.from_pylist([pick], schema=w.schema)
    finish, steps = {}, {}
    for k in (1, 5, 16):
        sim = Simulation(lone, "vllm-default", decode_stride=k, progress=False)
        steps[k] = sim.run().summary.engine_steps
        finish[k] = sim.finish_times[0]
    assert steps[16] * 10 < steps[1]
    assert finish[5] == pytest.approx(finish[1], rel=1e-9) and finish[16] == pytest.approx(finish[1], rel=1e-9)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_stride_fails_before_simulating(bad: Any) -> None:
    workload = generate(small_config(5, prompts=2, group=2, steps=1))
    with pytest.raises(SimulationError, match="decode_stride"):
        Simulation(workload, "vllm-default", decode_stride=bad, progress=False)
