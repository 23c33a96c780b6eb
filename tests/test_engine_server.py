"""The hook inside a real vLLM OpenAI server (vLLM 0.32's CPU build, ``.venv-engine``), driven by ``kvpilot replay``.

Two servers per module (start-up ~40 s each): the hook with ``vllm-default`` and telemetry, and stock vLLM.
Both use 32-token blocks (the smallest the CPU attention kernel takes) and the shipped tiny model.

* ``kvpilot replay`` and ``kvpilot simulate`` agree on the workload's requests, turns and prefix-cache hits.
  The simulator's vLLM uses 16-token blocks: a request whose prompt shares L tokens with what is cached hits
  ``L // 16 * 16`` there and ``L // 32 * 32`` here, so its hits are compared at 32-token blocks
  (``c // 32 * 32`` of the simulator's ``c``). Without eviction the hits do not depend on timing.
* Identity: under ``vllm-default`` the hook's server generates the same token ids and counts the same
  ``/metrics`` prefix-cache queries, hits and preemptions as stock vLLM for the same replay.
* Bad input: an unreachable URL, a server without the hook, a request longer than the model's max length.
* Shutdown: after a SIGTERM to the API server with vLLM's default shutdown settings, every finished request
  has its telemetry row (the last test of the module: it stops the hook's server).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.engine_server import start_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SERVER_ARGS = ("--block-size", "32", "--enforce-eager")
SERVER_BLOCK = 32


def tiny_workload(seed: int = 3, steps: int = 2, prompts: int = 8, max_tokens: int = 32):
    """A small RL workload (math, code, a multi-turn agent, reward-model scoring) that fits the tiny model."""
    from data.synth import SynthConfig, generate

    base = SynthConfig.preset("short")
    domains = {k: dataclasses.replace(d, max_tokens=max_tokens,
                                      max_context_tokens=2048 if d.tool else d.max_context_tokens)
               for k, d in base.domains.items()}
    return generate(dataclasses.replace(base, steps=steps, prompts_per_step=prompts, group_size=2, seed=seed,
                                        domains=domains))


@pytest.fixture(scope="module")
def workload_file(tmp_path_factory):
    from data.io import write_workload

    path = tmp_path_factory.mktemp("wl") / "workload.parquet"
    write_workload(tiny_workload(), path)
    return path


@pytest.fixture(scope="module")
def telemetry_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("telemetry")


@pytest.fixture(scope="module")
def hook_server(tmp_path_factory, telemetry_dir):
    with start_server(tmp_path_factory.mktemp("hook"), env={"KVPILOT_TELEMETRY_DIR": str(telemetry_dir)},
                      args=SERVER_ARGS) as server:
        yield server


@pytest.fixture(scope="module")
def stock_server(tmp_path_factory):
    with start_server(tmp_path_factory.mktemp("stock"), hook=False, args=SERVER_ARGS) as server:
        yield server


def cli(*args: str):
    from training.cli import app

    return CliRunner().invoke(app, list(args))


def replay_json(url: str, workload: Path, *extra: str) -> dict:
    result = cli("replay", "--url", url, "-w", str(workload), "--time-scale", "0", "--no-progress", "--json", *extra)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_replay_agrees_with_simulate(hook_server, workload_file, tmp_path):
    from simulator.simulation import run_simulation
    from simulator.workload import load_workload

    served = replay_json(hook_server.url, workload_file)
    prepared = load_workload(workload_file)
    sim = run_simulation(prepared, "vllm-default", out_dir=tmp_path / "sim", progress=False)
    n = prepared.num_rows
    assert served["failed"] == 0, served["failures"]
    assert served["requests"] == sim.summary.metrics.requests == n
    assert served["turns"] == sim.summary.metrics.turns
    assert served["trajectories"] == sim.summary.metrics.trajectories
    assert served["output_tokens"] == sim.summary.metrics.output_tokens
    assert served["cache_resets"] == len(prepared.steps) - 1  # the weight sync between steps, as simulated
    assert served["prefix_cache_queries"] == served["prompt_tokens"] == sum(prepared.prompt_tokens)
    sim_cached = np.asarray(sim.requests.column("cached_tokens").to_pylist())
    expected = int((sim_cached // SERVER_BLOCK * SERVER_BLOCK).sum())
    assert expected > 0.3 * served["prompt_tokens"]  # a workload that does share
    assert served["cached_tokens"] == served["prefix_cache_hits"]
    assert abs(served["cached_tokens"] - expected) <= 0.02 * expected, (served["cached_tokens"], expected)
    assert served["makespan_s"] > 0 and len(served["makespan_per_step_s"]) == len(prepared.steps)


def test_replay_async_runs_every_weight_update_mode_on_the_server(hook_server, workload_file):
    """``replay --driver async``: AReaL's rule in the client, the trainer's batches, the weight updates through the
    server's /pause and /resume in each mode (abort resubmits what it cut off): every request served once, every
    trajectory trained within eta; and a synchronous replay with the same trainer trains the same."""
    from simulator.workload import load_workload

    prepared = load_workload(workload_file)
    sync = replay_json(hook_server.url, workload_file, "--trainer")
    assert sync["failed"] == 0 and sync["weight_updates"] == len(prepared.steps) and sync["max_staleness"] == 0
    for mode in ("abort", "recompute", "keep"):
        run = replay_json(hook_server.url, workload_file, "--driver", "async", "--staleness", "1",
                          "--weight-sync", mode)
        assert run["failed"] == 0, (mode, run["failures"])
        assert run["requests"] == prepared.num_rows and run["trained_trajectories"] == len(prepared.sessions)
        assert run["max_staleness"] <= 1 and run["weight_updates"] == len(prepared.steps), mode
        assert run["trajectories_per_s"] > 0 and (mode != "keep" or run["reprefill_tokens"] == 0), mode


def test_identity_with_stock_vllm(hook_server, stock_server, workload_file):
    """Same replay, same generated ids and the same /metrics counters, with and without the hook."""
    from simulator.workload import load_workload
    from training.replay import ReplayConfig, render_replay, replay

    prepared = load_workload(workload_file)
    runs = {}
    for name, server in (("hook", hook_server), ("stock", stock_server)):
        cfg = ReplayConfig(server.url, concurrency=1, time_scale=0.0, require_hook=False, progress=False)
        runs[name] = replay(prepared, cfg, outputs=True)
    hook, stock = runs["hook"], runs["stock"]
    assert hook["failed"] == stock["failed"] == 0
    assert hook["outputs"] == stock["outputs"]
    assert len(hook["outputs"]) == prepared.num_rows
    for key in ("prefix_cache_queries", "prefix_cache_hits", "preemptions", "cached_tokens"):
        assert hook[key] == stock[key], key
    assert hook["prefix_cache_hits"] > 0
    assert hook["hook"] == {"policy": "vllm-default"} and stock["hook"] is None
    # vLLM's own step clock (its inter-token histogram) is read from both: what the benchmark compares
    assert 0 < hook["engine_inter_token_s"] < 10 and 0 < stock["engine_inter_token_s"] < 10
    # one JSON answer per request (--no-stream, as the benchmark replays): the same ids and counters
    cfg = ReplayConfig(hook_server.url, concurrency=1, time_scale=0.0, progress=False, stream=False)
    plain = replay(prepared, cfg, outputs=True)
    assert plain["failed"] == 0 and plain["outputs"] == hook["outputs"] and not plain["streamed"]
    assert plain["prefix_cache_queries"] == hook["prefix_cache_queries"] and plain["ttft_p50_s"] is None
    assert "not measured (--no-stream" in render_replay(plain)


def test_replay_refuses_an_unreachable_server(workload_file, tmp_path):
    result = cli("replay", "--url", "http://127.0.0.1:9", "-w", str(workload_file), "--no-progress", "--json")
    assert result.exit_code == 2
    assert "cannot reach the server at http://127.0.0.1:9" in result.output
    assert "{" not in result.stdout


def test_replay_refuses_a_server_without_the_hook(stock_server, workload_file):
    before = stock_server.metrics()
    result = cli("replay", "--url", stock_server.url, "-w", str(workload_file), "--no-progress", "--json")
    assert result.exit_code == 2
    assert "does not run the kvpilot hook" in result.output and stock_server.url in result.output
    assert "{" not in result.stdout
    assert _successes(stock_server.metrics()) == _successes(before)  # nothing was sent


def test_replay_refuses_a_request_longer_than_the_model(hook_server, tmp_path):
    from data.io import write_workload

    path = tmp_path / "long.parquet"
    table = tiny_workload(seed=4, steps=1, prompts=2, max_tokens=4000)
    write_workload(table, path)
    before = hook_server.metrics()
    result = cli("replay", "--url", hook_server.url, "-w", str(path), "--no-progress", "--json")
    assert result.exit_code == 2
    assert "more than the max_model_len 4096" in result.output and "--max-model-len" in result.output
    assert "{" not in result.stdout
    assert _successes(hook_server.metrics()) == _successes(before)


def _settled_rows(directory: Path, table: str, timeout_s: float = 20.0) -> int:
    """Rows of a telemetry table once the hook's drain thread has written them (the count stops changing)."""
    import time

    last, deadline = -1, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = pq.read_table(directory / table).num_rows if (directory / table).is_dir() else 0
        if n == last:
            return n
        last = n
        time.sleep(1.0)
    return last


def test_calibrate_on_the_servers_own_steps(hook_server, workload_file, telemetry_dir, tmp_path):
    """The loop in small: the server's own steps fit a preset with its engine's shape that prices a replay's steps
    from what they scheduled (loosely: two noisy cores, a few hundred steps of a few ms), and the simulator runs
    the workload on it. Its makespan is not compared here: on two cores the client's and the API server's time
    between a turn's end and the next turn's arrival is most of this short workload's makespan and spreads its
    requests over more, smaller steps, which the simulator does not model
    (docs/results/2026-12-06-real-engine-calibrated.md)."""
    import time

    import pyarrow.compute as pc

    from data.io import read_telemetry
    from simulator.fitted_cost import read_preset_file
    from simulator.simulation import run_simulation
    from simulator.workload import load_workload
    from training.calibrate import TERMS

    httpx.post(f"{hook_server.url}/reset_prefix_cache", timeout=60).raise_for_status()
    started = time.time()  # the hook's clock on a server: seconds since the epoch
    served = replay_json(hook_server.url, workload_file)
    assert served["failed"] == 0
    assert _settled_rows(telemetry_dir, "steps") > 100
    preset = tmp_path / "cpu.toml"
    result = cli("calibrate", "--telemetry", str(telemetry_dir), "-o", str(preset), "--json")
    assert result.exit_code == 0, result.output
    fit = json.loads(result.stdout[: result.stdout.rindex("}") + 1])
    # the tiny model's steps are a few ms of mostly fixed overhead on two loaded cores: R² is printed but
    # unstable here (-0.03 to 0.06 seen); the error and the replay's priced time are bounded
    assert fit["heldout_median_rel_error"] < 0.5 and "heldout_r2" in fit, fit
    fitted = read_preset_file(preset)
    assert fitted.engine.block_size == SERVER_BLOCK and fitted.engine.num_gpu_blocks > 1000
    steps = read_telemetry(telemetry_dir, "steps", ["time_s", "duration_s", *TERMS])
    mine = steps.filter(pc.and_(pc.greater_equal(steps.column("time_s"), started),
                                pc.greater(pc.add(steps.column("prefill_tokens"), steps.column("decode_tokens")), 0)))
    p, s, ap, ad = (mine.column(c).to_pylist() for c in TERMS)
    priced = sum(fitted.step_time(*terms) for terms in zip(p, ap, s, ad))
    measured = pc.sum(mine.column("duration_s")).as_py()
    # fitted on every replay of this module (the identity test's one-at-a-time steps among them) on two loaded
    # cores: 0.74-1.0 of the measured time seen; a preset with its terms mixed up is off by far more
    assert 0.6 < priced / measured < 1.5, (priced, measured)
    sim = run_simulation(load_workload(workload_file), "vllm-default", preset=str(preset), time_scale=0.0,
                         progress=False)
    assert sim.summary.metrics.requests == served["requests"] and sim.summary.kv_blocks > 2000
    # replay forces each output's length through max_tokens; the hook logs the rollout's own, not the answer
    prepared = load_workload(workload_file)
    asked = {(s, t): m for s, t, m in zip(prepared.session_id, prepared.turn, prepared.max_tokens)}
    reqs = read_telemetry(telemetry_dir, "requests", ["session_id", "turn", "arrival_s", "max_tokens"])
    reqs = reqs.filter(pc.greater_equal(reqs.column("arrival_s"), started)).to_pylist()
    assert len(reqs) == served["requests"]
    assert all(r["max_tokens"] == asked[(r["session_id"], r["turn"])] for r in reqs if r["turn"] is not None)


def _successes(metrics: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(metrics) if f.name == "vllm:request_success"
               for s in f.samples if s.name.endswith("_total"))


def test_sigterm_keeps_every_telemetry_row(hook_server, telemetry_dir):
    """Last: requests finish, the API server gets SIGTERM at once (default --shutdown-timeout 0); every request
    it finished has its row."""
    for i in range(6):
        body = {"model": "tiny-llama", "prompt": list(range(100 + i, 400 + i)), "max_tokens": 16, "min_tokens": 16,
                "ignore_eos": True, "vllm_xargs": {"kvpilot_session_id": f"term-{i}"}}
        httpx.post(f"{hook_server.url}/v1/completions", json=body, timeout=120).raise_for_status()
    finished = _successes(hook_server.metrics())
    hook_server.stop()
    rows = pq.read_table(telemetry_dir / "requests")
    assert finished >= 6
    assert rows.num_rows == finished
    assert {f"term-{i}" for i in range(6)} <= set(rows.column("session_id").to_pylist())
