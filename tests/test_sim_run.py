"""The simulator end to end: conservation over random workloads, unlimited-cache equality, KV pressure,
over-provisioning, replicas, telemetry timing, the CLI, and configurations that must fail before simulating."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from data.io import write_workload
from data.schemas import WORKLOAD
from data.stats import workload_stats
from data.synth import SynthConfig, generate
from simulator.simulation import (
    Overprovision,
    Simulation,
    SimulationError,
    run_simulation,
)
from simulator.sizing import blocks_for_fraction, min_blocks_for
from simulator.tokens import unlimited_cached_tokens
from simulator.workload import prepare_workload

V = 16  # vLLM block size


def small_config(seed: int, prompts: int = 8, group: int = 4, steps: int = 2,
                 shares: tuple[float, float, float] | None = None) -> SynthConfig:
    """The default mix, scaled down: code outputs shortened (median 300, cap 2000) so a run takes seconds."""
    cfg = SynthConfig(steps=steps, prompts_per_step=prompts, group_size=group, seed=seed)
    d = dict(cfg.domains)
    d["code"] = dataclasses.replace(d["code"], output_tokens=dataclasses.replace(d["code"].output_tokens, median=300),
                                    max_tokens=2000)
    if shares is not None:
        d = {k: dataclasses.replace(v, share=s) for (k, v), s in zip(d.items(), shares)}
    return dataclasses.replace(cfg, domains=d)


def _col(table: pa.Table, name: str) -> list[Any]:
    return table.column(name).to_pylist()


def check_conservation(workload: pa.Table, sim: Simulation, result: Any, stride: int = 1) -> None:
    """Every request ran exactly once with exactly its target tokens, recompute is accounted for, and sessions,
    scoring and RL steps ran in order. With a decode ``stride`` k, a request's last sampled batch (up to k
    tokens) is never computed, so it computes up to k - 1 tokens fewer than at k = 1."""
    w = {r["request_id"]: r for r in workload.to_pylist()}
    req = {r["request_id"]: r for r in result.requests.to_pylist()}
    assert len(req) == result.requests.num_rows == len(w)  # none lost, none duplicated
    assert set(req) == set(w)
    assert sim.submitted == [1] * workload.num_rows and sim.finished == [1] * workload.num_rows
    extra_total = 0
    for rid, r in req.items():
        x = w[rid]
        assert (r["prompt_tokens"], r["output_tokens"], r["max_tokens"]) == (
            x["prompt_tokens"], x["output_tokens"], x["max_tokens"]), rid
        assert r["finish_reason"] == ("tool_call" if x["tool"] is not None else x["finish_reason"]), rid
        base = r["prompt_tokens"] - r["cached_tokens"] + r["output_tokens"] - 1
        extra = r["computed_tokens"] - base
        if r["preemptions"] == 0:
            assert 1 - stride <= extra <= 0, rid  # no preemption: the uncached prompt, then the decode steps
        else:
            assert extra >= 1 - stride, rid
        extra_total += max(extra, 0)
        assert r["arrival_s"] <= r["first_scheduled_s"] <= r["first_token_s"] <= r["finish_s"], rid
        assert r["session_id"] == x["session_id"] and r["turn"] == x["turn"] and r["step"] == x["step"]
    assert result.summary.metrics.recomputed_tokens_preemption == extra_total
    if result.summary.metrics.preemptions:
        assert extra_total > 0
    # Turns in order: turn k+1 arrives when turn k's tool returns; scoring when the trajectory's last turn ends.
    sessions: dict[str, list[dict]] = {}
    for x in w.values():
        if x["kind"] == "rollout":
            sessions.setdefault(x["session_id"], []).append(x)
    last_finish = {}
    for sid, turns in sessions.items():
        turns.sort(key=lambda x: x["turn"])
        for a, b in itertools.pairwise(turns):
            ra, rb = req[a["request_id"]], req[b["request_id"]]
            assert rb["arrival_s"] == pytest.approx(ra["finish_s"] + a["tool_latency_s"], abs=1e-9)
            assert rb["arrival_s"] >= ra["finish_s"]
        last_finish[sid] = req[turns[-1]["request_id"]]["finish_s"]
    for x in w.values():
        if x["kind"] == "scoring":
            assert req[x["request_id"]]["arrival_s"] == pytest.approx(last_finish[x["scores_session_id"]], abs=1e-9)
    # Trajectories end after verification; a step is released when the previous one ends.
    records = {t.session_id: t for t in result.trajectories}
    assert set(records) == set(sessions)
    for sid, t in records.items():
        last = sessions[sid][-1]
        assert t.end_s >= last_finish[sid] + last["verify_latency_s"] - 1e-9
        assert t.start_s == pytest.approx(req[sessions[sid][0]["request_id"]]["arrival_s"])
    steps = sorted(result.rl_steps, key=lambda s: s.step)
    assert steps[0].start_s == 0.0
    for a, b in itertools.pairwise(steps):
        assert b.start_s == a.end_s
    for a in steps:
        assert a.end_s == max(t.end_s for t in result.trajectories if t.step == a.step)
    assert result.summary.metrics.trajectories == len(sessions)


def check_step_rows(result: Any) -> None:
    """Each steps row covers [time_s, time_s + duration_s] of its own step; a replica's steps never overlap."""
    s = result.steps
    for rep in set(_col(s, "replica")):
        rows = sorted((r for r in s.to_pylist() if r["replica"] == rep), key=lambda r: r["engine_step"])
        for a, b in itertools.pairwise(rows):
            assert b["time_s"] >= a["time_s"] + a["duration_s"] - 1e-9
        assert all(r["duration_s"] > 0 for r in rows if r["prefill_tokens"] + r["decode_tokens"] > 0)


# ------------------------------------------------------------------------ conservation

RANDOM_RUNS = 3


@pytest.fixture(scope="module")
def random_runs(vllm_engine: Any) -> list[tuple[pa.Table, Simulation, Any]]:
    """Small random workloads (seeded), each at a KV size small enough to preempt."""
    rng = np.random.default_rng(2024)
    runs = []
    for _ in range(RANDOM_RUNS):
        shares = tuple(float(x) for x in rng.dirichlet([2.0, 2.0, 2.0]))
        cfg = small_config(int(rng.integers(0, 1000)), prompts=int(rng.integers(4, 9)), group=int(rng.integers(2, 6)),
                           steps=int(rng.integers(1, 3)), shares=shares)
        workload = generate(cfg)
        prepared = prepare_workload(workload)
        kv = max(blocks_for_fraction(prepared, float(rng.uniform(0.08, 0.2))), 2 * min_blocks_for(prepared))
        sim = Simulation(prepared, "vllm-default", kv_blocks=kv, progress=False)
        runs.append((workload, sim, sim.run()))
    return runs


@pytest.mark.vllm
def test_conservation_over_random_workloads(random_runs: list) -> None:
    for workload, sim, result in random_runs:
        check_conservation(workload, sim, result)
        check_step_rows(result)
    assert sum(r.summary.metrics.preemptions for _, _, r in random_runs) > 0, "no run preempted: KV too large"


@pytest.mark.vllm
def test_multi_replica_routers_conserve(vllm_engine: Any) -> None:
    workload = generate(small_config(5, prompts=6, group=4, steps=1))
    hits = {}
    for router in ("round-robin", "least-loaded", "cache-aware"):
        sim = Simulation(workload, "vllm-default", replicas=2, router=router, kv_fraction=0.25, progress=False)
        result = sim.run()
        check_conservation(workload, sim, result)
        check_step_rows(result)
        replicas = _col(result.requests, "replica")
        assert set(replicas) == {0, 1}
        # Sticky sessions: a trajectory's turns and its scoring requests share one replica.
        stream = {}
        for x, rep in zip(result.requests.to_pylist(), replicas):
            key = x["session_id"].removesuffix("-score")
            assert stream.setdefault(key, rep) == rep
        hits[router] = result.summary.metrics.prefix_hit_rate
    # cache-aware keeps a group's siblings together; round robin splits them across the replicas
    assert hits["cache-aware"] > hits["round-robin"]


# ------------------------------------------------------------------------ prefix hits vs the workload's own numbers


def _hit_checks(workload: pa.Table, result: Any) -> tuple[float, float, float]:
    """(measured fraction, stats with outputs, stats plain); asserts the exact per-request equality."""
    prepared = prepare_workload(workload)
    req = result.requests
    rows = prepared.rows(_col(req, "request_id"))
    expected = unlimited_cached_tokens(prepared.tokens, include_outputs=True)
    np.testing.assert_array_equal(req.column("cached_tokens").to_numpy(), expected[rows])
    measured = result.summary.metrics.prefix_hit_rate
    assert measured == pytest.approx(expected.sum() / prepared.tokens.prompt.sum(), abs=1e-12)
    assert result.summary.metrics.recomputed_tokens == 0 and result.summary.metrics.preemptions == 0
    stats = workload_stats(workload)
    return measured, stats["unlimited_cache_hit_fraction_with_outputs"], stats["unlimited_cache_hit_fraction"]


def _rounding(workload: pa.Table) -> float:
    """Block rounding between token and block-reference fractions: one workload block per request, over all
    prompt tokens (stats count a request's partial last block and vLLM never hits it, nor the last token)."""
    b = _col(workload, "block_size")[0]
    return workload.num_rows * b / sum(_col(workload, "prompt_tokens"))


@pytest.mark.vllm
def test_unlimited_cache_hits_equal_workload_stats_with_outputs(vllm_engine: Any) -> None:
    workload = generate(small_config(3))
    result = run_simulation(workload, "vllm-default", kv_fraction=1.0, progress=False)
    measured, with_outputs, plain = _hit_checks(workload, result)
    assert abs(measured - with_outputs) <= _rounding(workload)
    assert with_outputs > plain  # later turns and scoring also hit the previous output's blocks
    assert abs(measured - plain) > abs(measured - with_outputs)


@pytest.mark.vllm
def test_unlimited_cache_hits_equal_workload_stats_single_turn(vllm_engine: Any) -> None:
    base = small_config(4, prompts=6)
    workload = generate(dataclasses.replace(base, domains={"math": base.domains["math"]}))
    result = run_simulation(workload, "vllm-default", kv_fraction=1.0, progress=False)
    measured, with_outputs, plain = _hit_checks(workload, result)
    assert with_outputs == plain  # one-turn sessions, nothing scored: outputs are never read again
    assert abs(measured - plain) <= _rounding(workload)


@pytest.mark.vllm
def test_hits_fall_and_recompute_rises_as_kv_shrinks(vllm_engine: Any) -> None:
    workload = generate(small_config(3))
    runs = [run_simulation(workload, "vllm-default", kv_fraction=f, progress=False).summary for f in (1.0, 0.3, 0.12)]
    hit = [s.metrics.prefix_hit_rate for s in runs]
    recomputed = [s.metrics.recomputed_tokens for s in runs]
    assert hit[0] > hit[1] > hit[2]
    assert 0 == recomputed[0] < recomputed[1] < recomputed[2]
    assert runs[2].metrics.preemptions > 0 and runs[2].metrics.recomputed_tokens_eviction > 0


# ------------------------------------------------------------------------ drivers


@pytest.mark.vllm
def test_overprovisioned_steps_stop_at_quota(vllm_engine: Any) -> None:
    workload = generate(small_config(8, prompts=6, group=4, steps=2))
    sim = Simulation(workload, "vllm-default", kv_fraction=0.5, overprovision=Overprovision(keep_fraction=0.5),
                     progress=False)
    result = sim.run()
    per_step = {s: sum(1 for x in workload.to_pylist() if x["step"] == s and x["kind"] == "rollout" and x["turn"] == 0)
                for s in (0, 1)}
    kept = {s: sum(1 for t in result.trajectories if t.step == s) for s in (0, 1)}
    assert kept == {s: math.ceil(n / 2) for s, n in per_step.items()}
    assert result.summary.aborted_trajectories == sum(per_step.values()) - sum(kept.values())
    steps = sorted(result.rl_steps, key=lambda s: s.step)
    assert steps[1].start_s == steps[0].end_s == max(t.end_s for t in result.trajectories if t.step == 0)
    reasons = _col(result.requests, "finish_reason")
    assert "abort" in reasons
    assert max(sim.finished) == 1 and max(sim.submitted) == 1
    # no request of step 0 finishes (other than aborted) after the step ended
    for r in result.requests.to_pylist():
        if r["step"] == 0 and r["finish_reason"] != "abort":
            assert r["finish_s"] <= steps[0].end_s + 1e-9


def _mini_trace() -> pa.Table:
    """Four single-turn requests at given arrival times; the last two share the first's two leading blocks."""
    rows = []
    for i, (t, hashes, p, o) in enumerate([(0.0, [1, 2, 3], 40, 5), (0.5, [9, 8], 20, 3), (2.0, [1, 2, 4], 44, 6),
                                           (2.0, [1, 2, 5], 36, 2)]):
        rows.append({"request_id": f"q{i}", "kind": "rollout", "step": 0, "prompt_id": f"p{i}", "group_id": f"g{i}",
                     "group_size": 1, "sample_index": 0, "session_id": f"s{i}", "turn": 0, "domain": "chat",
                     "paradigm": "reward_model", "prompt_tokens": p, "output_tokens": o, "max_tokens": o,
                     "finish_reason": "stop", "block_size": 16, "block_hashes": hashes, "arrival_s": t})
    return pa.Table.from_pylist(rows, schema=WORKLOAD.schema)


@pytest.mark.vllm
def test_trace_replay_at_arrival_times(vllm_engine: Any) -> None:
    trace = _mini_trace()
    result = run_simulation(trace, "vllm-default", kv_blocks=64, progress=False)
    req = {r["request_id"]: r for r in result.requests.to_pylist()}
    assert [req[f"q{i}"]["arrival_s"] for i in range(4)] == [0.0, 0.5, 2.0, 2.0]
    assert [req[f"q{i}"]["cached_tokens"] for i in range(4)] == [0, 0, 32, 32]
    assert all(req[f"q{i}"]["first_scheduled_s"] == req[f"q{i}"]["arrival_s"] for i in range(4))  # idle engine
    s = result.summary
    assert s.metrics.trajectories == 4 and s.metrics.prefix_hit_rate == pytest.approx(64 / 140)
    assert s.metrics.makespan_s == pytest.approx(max(r["finish_s"] for r in req.values()))
    assert 0 < s.metrics.trajectory_p50_s <= s.metrics.trajectory_p99_s


# ------------------------------------------------------------------------ CLI


@pytest.mark.vllm
def test_cli_simulate_json(vllm_engine: Any, tmp_path: Path) -> None:
    from training.cli import app

    path = tmp_path / "w.parquet"
    write_workload(generate(small_config(6, prompts=4, steps=1)), path)
    res = CliRunner().invoke(app, ["simulate", "--workload", str(path), "--policy", "vllm-default",
                                   "--kv-fraction", "0.3", "--preset", "H200-7B", "-o", str(tmp_path / "run"),
                                   "--json", "--no-progress", "--decode-stride", "4"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["decode_stride"] == 4
    for key in ("makespan_s", "tokens_per_s", "prefix_hit_rate", "recomputed_tokens", "recomputed_tokens_preemption",
                "recomputed_tokens_eviction", "preemptions", "trajectory_p50_s", "trajectory_p99_s"):
        assert key in summary
    assert summary["makespan_s"] > 0 and 0 < summary["prefix_hit_rate"] < 1
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["requests"] == summary["requests"]
    assert (tmp_path / "run" / "telemetry" / "requests").is_dir()
    assert (tmp_path / "run" / "telemetry" / "kv_events").is_dir()


# ------------------------------------------------------------------------ bad configurations (no vLLM needed)


@pytest.fixture(scope="module")
def tiny_workload() -> pa.Table:
    return generate(small_config(1, prompts=2, group=2, steps=1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"preset": "A100-70B"}, "unknown cost-model preset 'A100-70B'; known presets: H200-7B"),
        ({"replicas": 0}, "replicas must be an integer >= 1, got 0"),
        ({"kv_blocks": 10}, "KV cache of 10 blocks is smaller than the largest request, which needs"),
        ({"kv_fraction": 0.001}, "raise --kv-fraction above"),
        ({"kv_blocks": 1000, "kv_fraction": 1.0}, "at most one of kv_blocks and kv_fraction"),
        ({"router": "random"}, "unknown router 'random'"),
        ({"policy": "no-such-policy"}, "unknown kvpilot policy 'no-such-policy'"),
    ],
)
def test_bad_configurations_fail_before_simulating(tiny_workload: pa.Table, kwargs: dict, message: str) -> None:
    with pytest.raises(SimulationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Simulation(tiny_workload, progress=False, **kwargs)


def test_dangling_reference_fails_before_simulating(tiny_workload: pa.Table) -> None:
    rows = tiny_workload.to_pylist()
    scoring = next((r for r in rows if r["kind"] == "scoring"), None)
    if scoring is None:  # make one
        scoring = dict(rows[0], request_id="x-score", kind="scoring", session_id="x-score", tool=None,
                       tool_latency_s=None, tool_tokens=None, verify_latency_s=0.001)
        rows.append(scoring)
    scoring["scores_session_id"] = "no-such-session"
    bad = pa.Table.from_pylist(rows, schema=WORKLOAD.schema)
    with pytest.raises(SimulationError, match="dangling reference: no rollout session 'no-such-session'"):
        Simulation(bad, progress=False)


def test_cli_bad_configuration_exits_2(tmp_path: Path) -> None:
    from training.cli import app

    path = tmp_path / "w.parquet"
    write_workload(generate(small_config(1, prompts=2, group=2, steps=1)), path)
    runner = CliRunner()
    res = runner.invoke(app, ["simulate", "--workload", str(path), "--preset", "H300-1B", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "unknown cost-model preset 'H300-1B'" in res.output
    res = runner.invoke(app, ["simulate", "--workload", str(path), "--replicas", "0", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "replicas must be an integer >= 1, got 0" in res.output
    res = runner.invoke(app, ["simulate", "--workload", str(path), "--kv-blocks", "3", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "smaller than the largest request" in res.output
    res = runner.invoke(app, ["simulate", "--workload", str(path), "--decode-stride", "0", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "decode_stride must be an integer >= 1, got 0" in res.output
    assert not (tmp_path / "o" / "telemetry").exists()


# ------------------------------------------------------------------------ Mooncake trace replay

MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "synthetic_trace.jsonl"
MOONCAKE_PREFIX = 120  # the whole trace (3,993 requests) takes ~7-8 min per KV size here; see the report


@pytest.mark.vllm
@pytest.mark.slow
def test_mooncake_replay_at_two_kv_sizes(vllm_engine: Any) -> None:
    """The held-in Mooncake trace's first requests replay at their arrival times on one replica. With KV for the
    whole prefix nothing is recomputed and vLLM hits exactly what an unlimited cache would; at a tenth of it
    hits fall and recomputation appears. Prompts reach ~190k tokens: max_model_len and chunked prefill cope."""
    if not MOONCAKE.exists():
        pytest.skip(f"Mooncake trace not found at {MOONCAKE}")
    from data.importers import import_mooncake

    trace = import_mooncake(MOONCAKE).table.slice(0, MOONCAKE_PREFIX)
    assert max(_col(trace, "prompt_tokens")) > 50_000  # the trace opens with huge prompts
    big = run_simulation(trace, "vllm-default", kv_fraction=1.0, progress=False)
    small = run_simulation(trace, "vllm-default", kv_fraction=0.1, progress=False)
    for result in (big, small):
        req = {r["request_id"]: r for r in result.requests.to_pylist()}
        assert len(req) == trace.num_rows
        for x in trace.to_pylist():
            r = req[x["request_id"]]
            assert r["arrival_s"] == x["arrival_s"] and r["output_tokens"] == x["output_tokens"]
            assert r["first_scheduled_s"] >= r["arrival_s"]
        s = result.summary
        assert 0 < s.metrics.trajectory_p50_s <= s.metrics.trajectory_p99_s
        assert s.metrics.makespan_s >= max(_col(trace, "arrival_s")) - min(_col(trace, "arrival_s"))
    measured, _, plain = _hit_checks(trace, big)
    assert abs(measured - plain) <= _rounding(trace)
    b, s = big.summary, small.summary
    assert s.metrics.prefix_hit_rate < b.metrics.prefix_hit_rate
    assert s.metrics.recomputed_tokens > b.metrics.recomputed_tokens == 0


# ------------------------------------------------------------------------ pluggable policies


@pytest.mark.vllm
def test_policy_by_factory_matches_by_name(vllm_engine: Any, tmp_path: Path) -> None:
    """A factory plugs in like a registry name; vLLM's defaults answered explicitly schedule identically."""
    from data.io import read_telemetry
    from policy.vllm_default import VllmDefaultPolicy

    workload = generate(small_config(9, prompts=4, group=4, steps=1))
    by_name = run_simulation(workload, "vllm-default", kv_fraction=0.3, progress=False).summary.to_dict()
    explicit = run_simulation(workload, lambda: VllmDefaultPolicy(explicit=True), kv_fraction=0.3, progress=False,
                              out_dir=tmp_path, decision_budget_s=10.0).summary.to_dict()
    for key in ("makespan_s", "prefix_hit_rate", "preemptions", "recomputed_tokens", "engine_steps"):
        assert explicit[key] == by_name[key], key
    assert by_name["preemptions"] > 0
    kinds = set(read_telemetry(tmp_path / "telemetry", "decisions").column("kind").to_pylist())
    assert {"admit", "preempt"} <= kinds


@pytest.mark.vllm
def test_a_policy_that_holds_everything_stalls_with_a_clear_error(vllm_engine: Any) -> None:
    from policy.interface import AdmissionDecision, Policy

    class HoldAll(Policy):
        name = "test-hold-all"
        uses_admission = True

        def admit(self, waiting, state):
            return AdmissionDecision(hold={c.request_id for c in waiting})

    workload = generate(small_config(1, prompts=2, group=2, steps=1))
    with pytest.raises(SimulationError, match=r"replica 0 stalled: \d+ request\(s\) waiting"):
        run_simulation(workload, HoldAll, kv_fraction=1.0, progress=False, stall_steps=50)


def test_vllm_env_reads_are_cached_only_during_a_run() -> None:
    """vLLM's env variables are cached while the loop runs (as EngineCore does) and uncached afterwards."""
    import vllm.envs as envs

    from simulator.engine import vllm_envs_cached

    def cached() -> bool:
        return hasattr(envs.__getattr__, "cache_clear")

    assert not cached()
    with vllm_envs_cached():
        assert cached()
    assert not cached()  # a later run, or a test, sees changes to os.environ again
    envs.enable_envs_cache()
    try:
        with vllm_envs_cached():
            assert cached()
        assert cached()  # cached by someone else before: left as it was
    finally:
        envs.disable_envs_cache()


@pytest.mark.vllm
@pytest.mark.parametrize("policy", ["vllm-default", "kvflow"])
def test_cached_env_reads_change_no_result(vllm_engine: Any, policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run with vLLM's env variables cached gives exactly the numbers of one that reads them every time."""
    import contextlib

    from simulator import engine

    workload = prepare_workload(generate(small_config(9, prompts=8, group=4, steps=1)))
    kw: dict[str, Any] = {"kv_fraction": 0.2, "progress": False, "decode_stride": 8}
    cached = run_simulation(workload, policy, **kw).summary.to_dict()
    monkeypatch.setattr(engine, "vllm_envs_cached", contextlib.nullcontext)
    uncached = run_simulation(workload, policy, **kw).summary.to_dict()
    for key in ("makespan_s", "preemptions", "recomputed_tokens", "prefix_hit_rate", "engine_steps",
                "group_completion_s"):
        assert cached[key] == uncached[key], key
    assert cached["preemptions"] > 0


def test_start_up_noise_is_dropped_and_nothing_else() -> None:
    """The start-up warnings every simulator process printed are dropped at their loggers (installed when
    simulator.engine is imported, before vLLM); other messages of the same loggers still show."""
    import logging

    import simulator.engine  # noqa: F401 - installs the filters

    def shown(logger: str, msg: str, *args: object) -> bool:
        return logging.getLogger(logger).filter(logging.LogRecord(logger, logging.WARNING, __file__, 1, msg, args,
                                                                  None))

    cpu = "vllm.platforms.cpu"
    assert not shown(cpu, "CPU backend prefers block_size is multiples of 32, otherwise the performance is not "
                          "optimized.")
    assert not shown(cpu, "Reset SSM cache type to float32 for accelerated GDN mamba backend '%s'.", "none")
    no_kernels = repr(ModuleNotFoundError("No module named 'vllm._C'"))
    assert not shown(cpu, "Failed to import from vllm._C: %s", no_kernels)
    assert not shown("vllm.platforms.interface", "Failed to import from vllm._C: %s", no_kernels)
    assert not shown(cpu, "Failed to import from vllm._C_AVX2: %s", repr(ModuleNotFoundError(
        "No module named 'vllm._C_AVX2'")))
    assert shown(cpu, "Failed to import from vllm._C_AVX2: %s", repr(ImportError("undefined symbol: foo")))
    factory = "vllm.v1.kv_offload.cpu.policies.factory"
    assert not shown(factory, "Loading out-of-tree cache policy. This API is experimental and subject to change in "
                              "the future as we iterate the design.")
    assert not shown(factory, "Loading out-of-tree cache policy '%s' from '%s'.", "KVPilotCachePolicy", "x")
    assert not shown("torch._opaque_base", "torch._opaque_base is deprecated, use torch._custom_class_base instead")
    assert not shown("torch._library.opaque_object", "typ='value' is deprecated, use typ='constant' instead")
    assert not shown("torch._library.opaque_object", "register_opaque_type is deprecated, use register_custom_class")
    assert not shown("torch.utils.cpp_extension", "No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
    assert not shown(cpu, "Triton is not installed. triton-cpu is expected on x86 CPUs.")
    assert not shown("vllm.config.vllm", "Model Runner V2 requires Triton; using the V1 model runner instead.")
    assert shown("vllm.config.vllm", "Model Runner V2 does not support %s; using the V1 model runner.", "LoRA")
    assert shown(cpu, "Pin memory is not supported on this platform.")
    assert shown(cpu, "Reset SSM cache type to float32 for accelerated GDN mamba backend '%s'.", "gdn")
    assert shown(cpu, "Failed to import from vllm._C: %s", repr(ImportError("undefined symbol: foo")))
    assert shown("torch._library.opaque_object", "typ='reference' is deprecated, use typ='symbolic' instead")
