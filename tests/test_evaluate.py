"""`kvpilot evaluate`: a grid of policies x KV sizes x replicas on one tiny workload, its tables, ratios and plots."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from data.io import write_workload
from data.synth import generate
from simulator.config import SimulationError
from tests.test_sim_run import small_config
from training.cli import app
from training.evaluate import EvaluationResult, Execution, evaluate, expected_cost, finished_case
from training.grid import (
    DEFAULT,
    DEFAULT_DECODE_STRIDE,
    DEFAULT_KV_FRACTIONS,
    NOT_IN_ALL,
    Case,
    EvaluationError,
    Grid,
    build_cases,
    evaluation_config,
    resolve_policies,
    resolve_routers,
)
from training.reports import RR_RATIO, add_ratios

POLICIES = ["sortedrl", "rollpacker"]  # vllm-default is added


def _evaluate(workload: Path, policies: list[str], out: Path, *, jobs: int = 1, backend: str = "process",
              on_case: Any = None, full_telemetry: bool = False, **grid: Any) -> EvaluationResult:
    """``evaluate`` of a grid of ``policies`` on the evaluation's base run, without a progress bar."""
    return evaluate(workload, Grid(policies, full_telemetry=full_telemetry, **grid), out,
                    Execution(jobs=jobs, backend=backend, progress=False), on_case)
#: Row keys that are wall times (they differ between two runs of the same case).
TIMING = ("wall_s", "scheduler_s", "hook_s", "router_s", "setup_s", "simulator_overhead")


@pytest.fixture(scope="module")
def workload_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("wl") / "tiny.parquet"
    write_workload(generate(small_config(5, prompts=4, group=2, steps=1)), path)
    return path


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > 10_000, (path, len(data))  # a real plot, not an empty canvas
    return struct.unpack(">II", data[16:24])


def test_resolve_policies() -> None:
    from policy.baselines import BASELINES
    from policy.catalog import create_policy, known_policies, register

    assert resolve_policies("sortedrl, rollpacker") == [DEFAULT, "sortedrl", "rollpacker"]
    every = resolve_policies("all")
    assert every == [DEFAULT] + [p for p in known_policies() if p in BASELINES and p not in NOT_IN_ALL]
    register("my-candidate", lambda: create_policy("sortedrl"), replace=True)  # registered at run time: by name only
    assert resolve_policies("all") == every and resolve_policies("my-candidate") == [DEFAULT, "my-candidate"]
    # the thirteen and the tool-pause baselines; nothing that needs a trained model, only explores, or
    # learns as it runs
    assert sorted(every) == sorted(["vllm-default", "vllm-priority", "sjf-predicted", "sortedrl", "rollpacker",
                                    "heddle", "rolloutpipe", "seer", "continuum", "kvflow", "marconi", "lrb",
                                    "oracle", "infercept", "infercept-offload", "working-set",
                                    "working-set-offload", "vllm-offload", "continuum-offload", "kvflow-offload",
                                    "oracle-offload"])
    assert resolve_policies("lrb-online") == [DEFAULT, "lrb-online"]  # still runnable by name
    # the learned policy is always shown beside its prior (the same bundle with no trained network), once
    assert resolve_policies("seer,learned") == [DEFAULT, "seer", "learned-prior", "learned"]
    assert resolve_policies("learned,learned-prior,learned") == [DEFAULT, "learned", "learned-prior"]  # as named
    assert resolve_policies("learned-no-tier") == [DEFAULT, "learned-no-tier"]
    # names beside "all" are added to it, in place, once each
    assert resolve_policies("all,lrb-online") == every + ["lrb-online"]
    assert resolve_policies("lrb-online,all,sortedrl") == [DEFAULT, "lrb-online"] + every[1:]
    with pytest.raises(EvaluationError, match="no-such"):
        resolve_policies("all,no-such")
    with pytest.raises(EvaluationError, match="unknown policy 'nope'.*known policies: .*vllm-default"):
        resolve_policies("sortedrl,nope")
    cases = build_cases([DEFAULT, "sortedrl"], [0.4, 0.2, 0.2], [2, 1])
    assert [c.name for c in cases][:3] == ["vllm-default-kv0.2-r1", "sortedrl-kv0.2-r1", "vllm-default-kv0.4-r1"]
    assert len(cases) == 8
    with pytest.raises(EvaluationError):
        build_cases([DEFAULT], [0.0], [1])
    assert [c.name for c in build_cases([DEFAULT], [None, 0.2], [1])] == ["vllm-default-kv0.2-r1",
                                                                         "vllm-default-kvgpu-r1"]


def test_the_registry_policy_is_known_in_a_fresh_process() -> None:
    """The serving hook registers "registry"; evaluate resolves it without anything else imported first."""
    import subprocess
    import sys

    code = "from training.grid import resolve_policies; print(resolve_policies('registry'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and "'registry'" in done.stdout, done.stderr[-2000:]


def test_cli_unknown_policy_fails_before_running(workload_path: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["evaluate", "-w", str(workload_path), "-o", str(tmp_path / "e"),
                                   "--policies", "sortedrl,nope", "--no-progress"])
    assert res.exit_code == 2, res.output
    assert "unknown policy 'nope'" in res.output and "known policies" in res.output
    assert not (tmp_path / "e").exists()  # nothing ran
    res = CliRunner().invoke(app, ["evaluate", "-w", str(workload_path), "-o", str(tmp_path / "e"),
                                   "--kv-fractions", "0.2,x", "--no-progress"])
    assert res.exit_code == 2, res.output
    res = CliRunner().invoke(app, ["evaluate", "-w", str(workload_path), "-o", str(tmp_path / "e"),
                                   "--decode-stride", "0", "--no-progress"])
    assert res.exit_code == 2 and "decode_stride must be an integer >= 1, got 0" in res.output, res.output
    with pytest.raises(SimulationError, match="decode_stride"):
        Grid(["sortedrl"], evaluation_config(decode_stride=0))
    assert not (tmp_path / "e").exists()


@pytest.mark.vllm
def test_evaluate_grid(vllm_engine: Any, workload_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    # 1e-4 is far below the largest request's need: those cases fail and are reported, not raised
    result = _evaluate(workload_path, POLICIES, out, kv_fractions=[0.3, 0.6, 1e-4], replicas=[1])
    for name in ("summary.md", "summary.csv", "summary.json"):
        assert (out / name).stat().st_size > 0
    rows = json.loads((out / "summary.json").read_text())
    assert len(rows) == 9 and {(r["policy"], r["kv_fraction"], r["replicas"]) for r in rows} == {
        (p, k, 1) for p in [DEFAULT, *POLICIES] for k in (0.3, 0.6, 1e-4)}
    keys = {"policy", "kv_fraction", "replicas", "router", "error", "makespan_s", "prefix_hit_rate",
            "recomputed_tokens", "tokens_per_s", "trajectory_p99_s", "tail_bubble_s",
            "makespan_per_step_s", "group_completion_s",
            "makespan_ratio_vs_default", "recompute_ratio_vs_default", "hit_rate_ratio_vs_default",
            "bound_s", "bound_total_s", "makespan_over_bound", "gap_closed", "gpu_decode_s", "gpu_idle_s"}
    default = {r["kv_fraction"]: r for r in rows if r["policy"] == DEFAULT}
    for r in rows:
        assert keys <= set(r), keys - set(r)
        if r["kv_fraction"] == 1e-4:
            assert "smaller than the largest request" in r["error"] and r["makespan_ratio_vs_default"] is None
            continue
        assert r["error"] is None and r["makespan_s"] > 0 and r["decode_stride"] == DEFAULT_DECODE_STRIDE
        assert math.isclose(r["makespan_ratio_vs_default"], r["makespan_s"] / default[r["kv_fraction"]]["makespan_s"])
        assert math.isclose(r["hit_rate_ratio_vs_default"],
                            r["prefix_hit_rate"] / default[r["kv_fraction"]]["prefix_hit_rate"])
        if r["policy"] == DEFAULT:
            assert r["makespan_ratio_vs_default"] == 1.0 and r["gap_closed"] == 0.0
        d = default[r["kv_fraction"]]
        assert r["bound_total_s"] == d["bound_total_s"]  # one bound per workload, KV size and replica count
        assert math.isclose(r["gap_closed"], (d["simulated_s"] - r["simulated_s"]) /
                            (d["simulated_s"] - d["bound_total_s"]))
        if r["policy"] != "rollpacker":  # tail batching moves work across RL steps (simulator/bound.py)
            assert r["makespan_over_bound"] >= 1.0
        assert (out / "runs" / f"{r['policy']}-kv{r['kv_fraction']:g}-r1" / "summary.json").is_file()
    with (out / "summary.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 9 and "makespan_ratio_vs_default" in table[0] and "error" in table[0]
    assert "makespan_per_step_s" not in table[0]
    md = (out / "summary.md").read_text()
    assert md.count("\n| ") == 10 and "smaller than the largest request" in md
    assert "| makespan_over_bound | gap_closed |" in md
    for name in ("makespan.png", "hit_rate.png", "recompute.png", "trajectory_ecdf.png"):
        w, h = _png_size(out / name)
        assert w > 400 and h > 300
    assert all(len(v) > 0 for k, v in result.trajectory_s.items() if "kv0.3" in k or "kv0.6" in k)


def test_cpu_tier_sizes_are_a_dimension_of_the_tier_policies_only() -> None:
    cases = build_cases([DEFAULT, "vllm-offload"], [0.2], [1], tier_gibs=[64, 16, 16.0],
                        tier_users=["vllm-offload"])
    assert [c.name for c in cases] == ["vllm-default-kv0.2-r1", "vllm-offload-kv0.2-off16-r1",
                                       "vllm-offload-kv0.2-off64-r1"]
    assert [c.tier_gib for c in cases] == [None, 16.0, 64.0]
    assert [c.tier_gib for c in build_cases(["vllm-offload"], [0.2], [1])] == [None]  # no sweep: one case
    with pytest.raises(EvaluationError, match="GiB >= 0"):
        build_cases(["vllm-offload"], [0.2], [1], tier_gibs=[-1.0], tier_users=["vllm-offload"])


@pytest.mark.vllm
def test_cli_sweeps_the_cpu_tier(vllm_engine: Any, workload_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "evaltier"
    res = CliRunner().invoke(app, ["evaluate", "-w", str(workload_path), "-o", str(out), "--policies",
                                   "vllm-offload", "--kv-fractions", "0.3", "--offload-gib", "0.01,0.5",
                                   "--no-progress"])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "summary.json").read_text())
    got = {(r["policy"], r["tier_gib"]): r for r in rows}
    assert set(got) == {(DEFAULT, None), ("vllm-offload", 0.01), ("vllm-offload", 0.5)}
    small, big = got[("vllm-offload", 0.01)], got[("vllm-offload", 0.5)]
    assert small["offload_gib"] == 0.01 and big["offload_gib"] == 0.5 \
        and small["offload_blocks"] < big["offload_blocks"]
    assert got[(DEFAULT, None)]["offload_blocks"] == 0
    assert (out / "runs" / "vllm-offload-kv0.3-off0.5-r1" / "summary.json").is_file()
    assert "tier 0.01 GiB" in res.output
    assert (out / "summary.csv").read_text().splitlines()[0].split(",")[:5] == [
        "policy", "kv_fraction", "replicas", "router", "tier_gib"]  # a swept tier is a grid column
    bad = CliRunner().invoke(app, ["evaluate", "-w", str(workload_path), "-o", str(tmp_path / "bad"),
                                   "--offload-gib", "16,-1", "--no-progress"])
    assert bad.exit_code == 2 and TIER_ERROR in " ".join(bad.output.split())


#: What every command says of a bad ``--offload-gib`` (simulator.config.check_offload_gib, its one check).
TIER_ERROR = "offload_gib (--offload-gib) must be a number of GiB >= 0, got -1.0"


@pytest.mark.parametrize("command", ["simulate", "evaluate", "train", "promote"])
def test_offload_gib_has_one_check(command: str, workload_path: Path, tmp_path: Path) -> None:
    """``--offload-gib`` is checked in one function: every command that takes it refuses -1 in its words, exit 2."""
    args = {"simulate": ["-w", str(workload_path), "-o", str(tmp_path / "o")],
            "evaluate": ["-w", str(workload_path), "-o", str(tmp_path / "o")],
            "train": ["--logs", str(tmp_path)], "promote": ["--version", "1"]}[command]
    res = CliRunner().invoke(app, [command, *args, "--offload-gib", "-1"])
    assert res.exit_code == 2 and TIER_ERROR in " ".join(res.output.split()), res.output


@pytest.mark.vllm
def test_cli_gpu_capacity_beside_a_fraction(vllm_engine: Any, workload_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "evalgpu"
    res = CliRunner().invoke(app, ["evaluate", "-w", str(workload_path), "-o", str(out), "--policies",
                                   "vllm-default", "--kv-fractions", "gpu,0.5", "--no-progress"])
    assert res.exit_code == 0, res.output
    rows = {r["kv_fraction"]: r for r in json.loads((out / "summary.json").read_text())}
    assert set(rows) == {None, 0.5} and rows[None]["kv_blocks"] > rows[0.5]["kv_blocks"]
    assert (out / "runs" / "vllm-default-kvgpu-r1" / "summary.json").is_file()
    assert "| vllm-default | gpu | 1 |" in (out / "summary.md").read_text()
    assert "kv gpu" in res.output and "gap closed" in res.output


def test_kv_totals_split_over_each_replica_count() -> None:
    """A fleet KV total is the same KV in all at every replica count: 0.2 is 0.05 per replica at 4, 0.025 at 8."""
    cases = build_cases([DEFAULT], None, [8, 4], ["round-robin"], kv_totals=[0.2, 0.24])
    assert [(c.replicas, c.kv_fraction) for c in cases] == [(4, 0.05), (4, 0.06), (8, 0.025), (8, 0.03)]
    assert cases[2].name == "vllm-default-kv0.025-r8-round-robin"
    assert [c.kv_fraction for c in build_cases([DEFAULT], None, [1])] == list(DEFAULT_KV_FRACTIONS)
    with pytest.raises(EvaluationError, match="not both"):
        build_cases([DEFAULT], [0.1], [4], kv_totals=[0.2])
    with pytest.raises(EvaluationError, match="KV totals must be positive"):
        build_cases([DEFAULT], None, [4], kv_totals=[0.2, -1.0])


@pytest.mark.vllm
def test_cli_kv_total_gives_each_replica_count_the_same_kv(vllm_engine: Any, workload_path: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "evaltotal"
    base = ["evaluate", "-w", str(workload_path), "-o", str(out), "--policies", "vllm-default", "--no-progress"]
    res = CliRunner().invoke(app, [*base, "--kv-fractions", "0.5", "--kv-total", "1"])
    assert res.exit_code == 2 and "KV fractions per replica or KV totals for the fleet, not both" in res.output, \
        res.output
    res = CliRunner().invoke(app, [*base, "--kv-total", "1", "--replicas", "1,2", "--decode-stride", "4"])
    assert res.exit_code == 0, res.output
    assert "1 fleet KV size(s)" in res.output
    rows = {r["replicas"]: r for r in json.loads((out / "summary.json").read_text())}
    assert {k: r["kv_fraction"] for k, r in rows.items()} == {1: 1.0, 2: 0.5}
    assert not any(r.get("error") for r in rows.values())
    # the same KV in all (each replica's blocks include vLLM's null block)
    assert abs(2 * (rows[2]["kv_blocks"] - 1) - (rows[1]["kv_blocks"] - 1)) <= 2


@pytest.mark.vllm
def test_cli_two_replicas(vllm_engine: Any, workload_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval2"
    res = CliRunner().invoke(app, ["evaluate", "-w", str(workload_path), "-o", str(out), "--policies",
                                   "vllm-default", "--kv-fractions", "0.5", "--replicas", "2",
                                   "--router", "least-loaded", "--decode-stride", "4", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "decode stride 4" in res.output
    rows = json.loads((out / "summary.json").read_text())
    assert [(r["policy"], r["replicas"], r["makespan_ratio_vs_default"]) for r in rows] == [(DEFAULT, 2, 1.0)]
    assert rows[0]["router"] == "least-loaded" and rows[0]["decode_stride"] == 4
    # --resume reads the finished case back instead of simulating it again; another stride reruns it
    run = out / "runs" / "vllm-default-kv0.5-r2-least-loaded" / "summary.json"
    before = run.stat().st_mtime_ns
    args = ["evaluate", "-w", str(workload_path), "-o", str(out), "--policies", "vllm-default", "--kv-fractions",
            "0.5", "--replicas", "2", "--router", "least-loaded", "--no-progress", "--resume"]
    res = CliRunner().invoke(app, [*args[:-1], "--decode-stride", "4"])  # no --resume: the earlier run is kept
    assert res.exit_code == 2 and "already holds" in res.output and "--resume" in res.output, res.output
    assert run.stat().st_mtime_ns == before
    res = CliRunner().invoke(app, [*args, "--decode-stride", "4"])
    assert res.exit_code == 0, res.output
    assert run.stat().st_mtime_ns == before
    again = json.loads((out / "summary.json").read_text())
    assert again[0]["makespan_s"] == rows[0]["makespan_s"] and again[0]["decode_stride"] == 4
    res = CliRunner().invoke(app, [*args, "--decode-stride", "2"])
    assert res.exit_code == 0, res.output
    assert run.stat().st_mtime_ns != before
    assert json.loads((out / "summary.json").read_text())[0]["decode_stride"] == 2


@pytest.mark.vllm
@pytest.mark.slow
def test_evaluate_parallel_jobs(vllm_engine: Any, workload_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "evalj"
    result = _evaluate(workload_path, ["sortedrl", "oracle"], out, kv_fractions=[0.5], replicas=[1], jobs=2)
    assert [r["error"] for r in result.rows] == [None, None, None]
    # oracle runs first (longest expected), the rows keep the grid's order
    assert [r["policy"] for r in result.rows] == [DEFAULT, "sortedrl", "oracle"]
    assert result.rows[1]["makespan_ratio_vs_default"] == pytest.approx(
        result.rows[1]["makespan_s"] / result.rows[0]["makespan_s"])


@pytest.mark.vllm
def test_full_telemetry_is_optional_and_changes_no_result(vllm_engine: Any, workload_path: Path,
                                                           tmp_path: Path) -> None:
    """Evaluation runs leave the decisions and kv_events tables out by default; with them, every result is the
    same (two replicas behind the kv-aware router, which gets the KV events either way)."""
    runs = {}
    for log in (False, True):
        res = _evaluate(workload_path, ["sjf-predicted"], tmp_path / str(log), kv_fractions=[0.3], replicas=[2],
                        routers=["kv-aware"], full_telemetry=log)
        runs[log] = res.rows
        telemetry = tmp_path / str(log) / "runs" / "sjf-predicted-kv0.3-r2-kv-aware" / "telemetry"
        for table in ("decisions", "kv_events"):
            assert any((telemetry / table).glob("part-*.parquet")) is log, table
        assert any((telemetry / "requests").glob("part-*.parquet"))
    strip = [[{k: v for k, v in r.items() if k not in TIMING} for r in rows] for rows in runs.values()]
    assert strip[0] == strip[1]


def test_cases_are_handed_out_longest_expected_first() -> None:
    cases = build_cases([DEFAULT, "sortedrl", "oracle"], [0.1, 0.2, 0.4], [1, 2])
    ranked = sorted(cases, key=expected_cost, reverse=True)
    assert ranked[0] == Case("oracle", 0.1, 2, "round-robin")  # the smallest cache, two replicas, a costly hook
    assert ranked[-1] == Case(DEFAULT, 0.4, 1)
    rr = "round-robin"
    assert expected_cost(Case(DEFAULT, 0.1, 2, rr)) > expected_cost(Case(DEFAULT, 0.2, 2, rr)) \
        > expected_cost(Case(DEFAULT, 0.4, 2, rr)) > expected_cost(Case(DEFAULT, 0.1, 1)) \
        > expected_cost(Case(DEFAULT, 0.4, 1))


# ---------------------------------------------------------------- routers as a grid dimension, the Ray backend

ROUTER_GRID = {"kv_fractions": [0.5, 1e-4], "replicas": [1, 2], "routers": ("round-robin", "kv-aware")}


def test_routers_are_a_grid_dimension_at_several_replicas() -> None:
    from simulator.routers import ROUTERS

    assert resolve_routers("kv-aware, round-robin,kv-aware") == ["kv-aware", "round-robin"]
    assert resolve_routers("all") == list(ROUTERS) and resolve_routers(["all", "kv-aware"]) == list(ROUTERS)
    with pytest.raises(EvaluationError, match="unknown router 'nope'; known routers: round-robin, least-loaded"):
        resolve_routers("round-robin,nope")
    with pytest.raises(EvaluationError, match="no routers"):
        resolve_routers(" , ")
    cases = build_cases([DEFAULT, "sortedrl"], [0.5], [2, 1], ["round-robin", "kv-aware"])
    assert [c.name for c in cases] == [
        "vllm-default-kv0.5-r1", "sortedrl-kv0.5-r1",  # one replica: no router, one case each
        "vllm-default-kv0.5-r2-round-robin", "sortedrl-kv0.5-r2-round-robin",
        "vllm-default-kv0.5-r2-kv-aware", "sortedrl-kv0.5-r2-kv-aware"]
    assert [c.router for c in cases[:2]] == [None, None]
    with pytest.raises(ValueError, match="router exactly when"):
        Case(DEFAULT, 0.5, 2)
    with pytest.raises(ValueError, match="router exactly when"):
        Case(DEFAULT, 0.5, 1, "kv-aware")


def test_ratios_compare_within_a_router() -> None:
    def row(policy: str, replicas: int, router: str | None, makespan: float) -> dict[str, Any]:
        return {"policy": policy, "kv_fraction": 0.5, "replicas": replicas, "router": router, "error": None,
                "makespan_s": makespan}

    rows = [row(DEFAULT, 1, None, 10.0), row("learned", 1, None, 5.0),
            row(DEFAULT, 2, "round-robin", 8.0), row("learned", 2, "round-robin", 6.0),
            row(DEFAULT, 2, "kv-aware", 4.0), row("learned", 2, "kv-aware", 2.0)]
    add_ratios(rows)
    assert [r["makespan_ratio_vs_default"] for r in rows] == [1.0, 0.5, 1.0, 0.75, 1.0, 0.5]
    assert [r[RR_RATIO] for r in rows] == [None, None, 1.0, 0.75, 0.5, 0.25]
    rows = [row(DEFAULT, 2, "kv-aware", 4.0), row("learned", 2, "kv-aware", 2.0)]  # no round-robin in the grid
    add_ratios(rows)
    assert [r[RR_RATIO] for r in rows] == [None, None] and rows[1]["makespan_ratio_vs_default"] == 0.5


def test_bad_backend_or_missing_ray_fails_before_running(workload_path: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EvaluationError, match="unknown backend 'dask'; known backends: process, ray"):
        Execution(backend="dask")
    with pytest.raises(EvaluationError, match="address 'auto' is for the ray backend"):
        Execution(address="auto")
    with pytest.raises(EvaluationError, match="unknown router 'nope'"):
        Grid(["sortedrl"], replicas=[2], routers="nope")
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(EvaluationError, match=r"backend 'ray' needs Ray: pip install 'ray>=2.60'"):
        _evaluate(workload_path, ["sortedrl"], tmp_path / "e", backend="ray")
    assert not (tmp_path / "e").exists()
    res = CliRunner().invoke(app, ["evaluate", "-w", str(workload_path), "-o", str(tmp_path / "e"),
                                   "--replicas", "2", "--routers", "kv-aware,nope", "--no-progress"])
    assert res.exit_code == 2 and "--routers: unknown router 'nope'" in res.output, res.output
    res = CliRunner().invoke(app, ["evaluate", "-w", str(workload_path), "-o", str(tmp_path / "e"),
                                   "--backend", "mpi", "--no-progress"])
    assert res.exit_code == 2 and "unknown backend 'mpi'; known backends: process, ray" in res.output, res.output
    assert not (tmp_path / "e").exists()


@pytest.fixture(scope="module")
def router_grid(vllm_engine: Any, workload_path: Path, tmp_path_factory: pytest.TempPathFactory) -> EvaluationResult:
    """sortedrl and vllm-default at KV 0.5 (and 1e-4, whose cases fail) on 1 and 2 replicas behind two routers,
    in two worker processes."""
    return _evaluate(workload_path, ["sortedrl"], tmp_path_factory.mktemp("grid"), jobs=2, **ROUTER_GRID)


@pytest.mark.vllm
@pytest.mark.slow
def test_router_grid(router_grid: EvaluationResult, tmp_path: Path) -> None:
    rows, out = router_grid.rows, router_grid.out_dir
    assert [(r["policy"], r["kv_fraction"], r["replicas"], r["router"]) for r in rows] == [
        (p, k, 1, None) for k in (1e-4, 0.5) for p in (DEFAULT, "sortedrl")] + [
        (p, k, 2, rt) for k in (1e-4, 0.5) for rt in ("round-robin", "kv-aware") for p in (DEFAULT, "sortedrl")]
    ok = {(r["policy"], r["replicas"], r["router"]): r for r in rows if r["kv_fraction"] == 0.5}
    assert all(r["error"] is None for r in ok.values())
    assert all("smaller than the largest request" in r["error"] for r in rows if r["kv_fraction"] == 1e-4)
    for (policy, reps, router), r in ok.items():
        d, rr = ok[(DEFAULT, reps, router)], ok.get((DEFAULT, reps, "round-robin"))
        assert r["makespan_ratio_vs_default"] == pytest.approx(r["makespan_s"] / d["makespan_s"])
        assert r["gap_closed"] == pytest.approx((d["simulated_s"] - r["simulated_s"]) /
                                                (d["simulated_s"] - d["bound_total_s"]))
        assert r[RR_RATIO] == (None if reps == 1 else pytest.approx(r["makespan_s"] / rr["makespan_s"]))
        case = Case(policy, 0.5, reps, router)
        assert json.loads((out / "runs" / case.name / "summary.json").read_text())["router"] == router
    header = (out / "summary.csv").read_text().splitlines()[0].split(",")
    assert header[:5] == ["policy", "kv_fraction", "replicas", "router", "makespan_ratio_vs_default"]  # no tier sweep
    assert RR_RATIO in header
    assert "| vllm-default | 0.5 | 2 | kv-aware | 1 |" in (out / "summary.md").read_text()
    for name in ("makespan.png", "hit_rate.png", "recompute.png", "trajectory_ecdf.png"):
        assert _png_size(out / name)[0] > 400
    assert list(router_grid.trajectory_s) == [c.name for c in build_cases([DEFAULT, "sortedrl"], **ROUTER_GRID)]
    # --resume reads a case back only when its run was behind the same router
    case = Case(DEFAULT, 0.5, 2, "kv-aware")
    grid = Grid(["sortedrl"], **ROUTER_GRID)
    again = finished_case(grid, case, out)
    assert again is not None and again[0]["router"] == "kv-aware" and again[0]["makespan_s"] == ok[
        (DEFAULT, 2, "kv-aware")]["makespan_s"]
    moved = tmp_path / "runs" / case.name
    shutil.copytree(out / "runs" / case.name, moved)
    summary = json.loads((moved / "summary.json").read_text())
    (moved / "summary.json").write_text(json.dumps({**summary, "router": "least-loaded"}))
    assert finished_case(grid, case, tmp_path) is None


@pytest.mark.vllm
@pytest.mark.slow
def test_ray_backend_gives_the_process_pools_rows(router_grid: EvaluationResult, workload_path: Path,
                                                  tmp_path: Path) -> None:
    """The same grid as Ray tasks on a local Ray instance started (and shut down) by evaluate: the same rows,
    failed cases included, reported as they finish."""
    ray = pytest.importorskip("ray")
    seen: list[str] = []
    result = _evaluate(workload_path, ["sortedrl"], tmp_path, backend="ray", jobs=2,
                       on_case=lambda case, row: seen.append(case.name), **ROUTER_GRID)
    assert not ray.is_initialized()  # started here, so shut down here
    assert sorted(seen) == sorted(router_grid.trajectory_s) and len(seen) == 12
    strip = [[{k: v for k, v in r.items() if k not in TIMING} for r in res.rows] for res in (router_grid, result)]
    assert strip[0] == strip[1]
    assert sum(r["error"] is not None for r in result.rows) == 6
    assert result.trajectory_s == router_grid.trajectory_s
    assert (tmp_path / "runs" / "sortedrl-kv0.5-r2-kv-aware" / "summary.json").is_file()


def test_resume_reuses_a_run_only_of_the_same_workload_and_preset(tmp_path: Path) -> None:
    """A finished case is read back only for the workload (its request count and source) and preset it ran."""
    case = Case("vllm-default", 0.5, 1, None)
    run = tmp_path / "runs" / case.name
    run.mkdir(parents=True)
    source = {"generator": "kvpilot workload synth", "config": {"seed": 3, "steps": [1, 2]}}
    (run / "summary.json").write_text(json.dumps({"decode_stride": 32, "keep_cache_across_steps": False,
                                                  "router": None, "preset": "H200-7B", "requests": 40,
                                                  "workload_source": source, "makespan_s": 5.0}))
    (run / "trajectories.json").write_text("[1.0, 2.0]")
    grid = Grid([DEFAULT], kv_fractions=[0.5])  # H200-7B at stride 32
    assert finished_case(grid, case, tmp_path, workload=(40, source))[1] == [1.0, 2.0]
    for other in ((41, source), (40, {**source, "config": {"seed": 4, "steps": [1, 2]}})):
        assert finished_case(grid, case, tmp_path, workload=other) is None
    on_32b = dataclasses.replace(grid, base=evaluation_config(preset="H200-32B"))
    assert finished_case(on_32b, case, tmp_path, workload=(40, source)) is None


def test_cli_learned_without_a_readable_model_fails_before_running(workload_path: Path, tmp_path: Path) -> None:
    """``learned`` (or an ablation) with no --model, or one that is not a POLICY_DIR, exits 2 before any case runs,
    not after a grid of failed cases."""
    base = ["evaluate", "-w", str(workload_path), "-o", str(tmp_path / "e"), "--no-progress"]
    res = CliRunner().invoke(app, [*base, "--policies", "vllm-default,learned-admission"])
    assert res.exit_code == 2 and "needs --model" in res.output, res.output
    bundle = tmp_path / "trained" / "policy"
    bundle.mkdir(parents=True)
    (bundle / "policy.json").write_text("{}")
    res = CliRunner().invoke(app, [*base, "--policies", "learned", "--model", str(tmp_path / "trained")])
    said = "".join(res.output.split())  # (the console wraps long paths)
    assert res.exit_code == 2 and "policy.json:missing" in said and "/trained/policyisone" in said, res.output
    assert not (tmp_path / "e").exists()


def test_cli_a_grid_whose_every_case_failed_exits_1(workload_path: Path, tmp_path: Path) -> None:
    """A KV size below the largest request fails every case: the command says so and exits 1, not 0."""
    res = CliRunner().invoke(app, ["evaluate", "-w", str(workload_path), "-o", str(tmp_path / "e"), "--policies",
                                   "vllm-default", "--kv-fractions", "0.01", "--no-progress"])
    assert res.exit_code == 1 and "every case failed" in " ".join(res.output.split()), res.output
    assert json.loads((tmp_path / "e" / "summary.json").read_text())[0]["error"]  # the rows are kept
