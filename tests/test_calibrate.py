"""``kvpilot calibrate`` and fitted presets: the fit recovers a known engine, presets drive the simulator, and bad
input gets a named error (exit 2). ``--time-scale`` on ``simulate`` scales the workload's waits as ``replay`` does.

The known engine is a :class:`FittedCost` written by hand: the simulator runs on it, its ``steps`` telemetry
(the hook's context columns included) is what a server would log, and calibrating on it must give the same
coefficients back, so the hook's attention terms and the runner's pricing agree.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from simulator.fitted_cost import EngineShape, FittedCost, PresetFileError, read_preset_file, write_preset_file

pytestmark = pytest.mark.slow

KNOWN = FittedCost(name="known", engine=EngineShape(num_gpu_blocks=301, block_size=32, max_num_seqs=64,
                                                    max_num_batched_tokens=1024),
                   step_overhead_s=0.002, prefill_token_s=4e-6, decode_token_s=1.2e-4, prefill_pair_s=3e-9,
                   decode_context_s_per_token=7e-9)
COEFFICIENTS = ("step_overhead_s", "prefill_token_s", "decode_token_s", "prefill_pair_s",
                "decode_context_s_per_token")


def cli(*args: str):
    from training.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def said(result) -> str:
    """A command's output with rich's line wrapping undone."""
    return " ".join(result.output.split())


def small_workload(seed: int = 4) -> pa.Table:
    """A small multi-turn RL step with tool waits (the agentic preset, short outputs)."""
    from data.synth import SynthConfig, generate

    base = SynthConfig.preset("agentic")
    domains = {k: dataclasses.replace(d, max_tokens=min(d.max_tokens, 128), max_context_tokens=3072)
               for k, d in base.domains.items()}
    return generate(dataclasses.replace(base, steps=1, prompts_per_step=4, group_size=2, seed=seed, domains=domains))


@pytest.fixture(scope="module")
def known_run(tmp_path_factory):
    """The small workload simulated on the known engine (its preset file), with its telemetry."""
    from data.io import write_workload
    from simulator.simulation import run_simulation

    tmp = tmp_path_factory.mktemp("known")
    preset = tmp / "known.toml"
    write_preset_file(KNOWN, preset)
    write_workload(small_workload(), tmp / "workload.parquet")
    result = run_simulation(small_workload(), "vllm-default", preset=str(preset), out_dir=tmp / "run",
                            progress=False)
    return tmp, preset, result


def test_calibrate_recovers_the_engine_it_ran_on(known_run, tmp_path):
    tmp, _, result = known_run
    out = tmp_path / "fitted.toml"
    res = cli("calibrate", "--telemetry", tmp / "run", "-o", out, "--json")
    assert res.exit_code == 0, res.output
    fit = json.loads(res.stdout[: res.stdout.rindex("}") + 1])
    assert fit["heldout_r2"] > 0.999 and fit["heldout_p90_rel_error"] < 1e-3
    fitted = read_preset_file(out)
    # the engine read from the telemetry's columns: the simulator's, the known engine's tokens in 16-token blocks
    assert fitted.engine == dataclasses.replace(KNOWN.engine, num_gpu_blocks=601, block_size=16)
    assert fitted.max_kv_blocks(16) == KNOWN.max_kv_blocks(16) == 601
    for k in COEFFICIENTS:
        assert getattr(fitted, k) == pytest.approx(getattr(KNOWN, k), rel=0.02, abs=1e-12), k
    # the fitted preset predicts the run it was fitted on
    from simulator.simulation import run_simulation

    again = run_simulation(small_workload(), "vllm-default", preset=str(out), progress=False)
    assert again.summary.metrics.makespan_s == pytest.approx(result.summary.metrics.makespan_s, rel=0.01)


def test_a_fitted_preset_models_its_engine(known_run):
    from simulator.config import SimConfig, SimulationError, Trainer

    _, preset, result = known_run
    cfg = SimConfig(preset=str(preset))
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (64, 1024)  # the engine's limits by default
    assert SimConfig(preset=str(preset), max_num_seqs=8).max_num_seqs == 8
    # 300 usable blocks of 32 tokens are 600 of the simulator's 16, plus vLLM's null block
    assert result.summary.kv_blocks == 601
    assert cfg.offload_blocks() == 0  # a fitted engine has no host tier
    # the physics bound holds on a fitted engine too (no schedule beats it), and is not vacuous
    b = result.summary.bound
    assert 0.3 * result.summary.metrics.simulated_s < b.bound_total_s <= result.summary.metrics.simulated_s
    with pytest.raises(SimulationError, match="no model or GPU to price a training step.*--trainer-preset"):
        Trainer().sync_s(cfg.cost)
    # a roofline preset prices the trainer of a fitted engine's run (as replay --trainer-preset does the server's)
    from simulator.cost_model import CostModel

    roofline = CostModel.preset("H200-7B")
    assert Trainer(preset="H200-7B").train_s(10_000, cfg.cost, 1) == Trainer().train_s(10_000, roofline, 1) > 2.0
    assert Trainer(preset="H200-7B").sync_s(cfg.cost) == Trainer().sync_s(roofline)
    with pytest.raises(SimulationError, match="trainer preset: unknown cost-model preset 'H9-1B'"):
        Trainer(preset="H9-1B")


def test_a_fitted_engines_run_prices_its_trainer_on_the_named_preset(known_run, tmp_path):
    """``--trainer`` on a fitted preset needs ``--trainer-preset`` (a named error, exit 2, without); with it the run
    trains; ``--trainer-preset`` alone, without a trainer, is an error too."""
    tmp, preset, _ = known_run
    wl = tmp / "workload.parquet"
    no = cli("simulate", "-w", wl, "--preset", preset, "--trainer", "--no-progress", "-o", tmp_path / "a")
    assert no.exit_code == 2 and "--trainer-preset" in said(no)
    ok = cli("simulate", "-w", wl, "--preset", preset, "--trainer", "--trainer-preset", "H200-7B", "--no-progress",
             "--json", "-o", tmp_path / "b")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["trajectories_per_s"] > 0
    alone = cli("simulate", "-w", wl, "--preset", preset, "--trainer-preset", "H200-7B", "--no-progress", "-o",
                tmp_path / "c")
    assert alone.exit_code == 2 and "--trainer-preset needs --trainer or --driver async" in said(alone)


def test_time_scale_scales_the_waits(known_run, tmp_path):
    tmp, preset, result = known_run
    runs = {}
    for scale in ("0", "2"):
        res = cli("simulate", "-w", tmp / "workload.parquet", "-o", tmp_path / scale, "--preset", preset,
                  "--time-scale", scale, "--no-progress")
        assert res.exit_code == 0, res.output
        runs[scale] = json.loads((tmp_path / scale / "summary.json").read_text())
    assert runs["0"]["time_scale"] == 0 and runs["2"]["time_scale"] == 2
    base = result.summary.metrics.makespan_s
    assert runs["0"]["makespan_s"] < base < runs["2"]["makespan_s"]
    res = cli("simulate", "-w", tmp / "workload.parquet", "-o", tmp_path / "bad", "--time-scale", "-1")
    assert res.exit_code == 2 and "time_scale must be a number >= 0" in said(res)


def test_calibrate_measures_the_client_round_trip_and_the_simulator_adds_it(known_run, tmp_path):
    """A run whose client answers each finished turn 50 ms late: calibrate given the workload finds those 50 ms
    (the tool waits, at replay's time scale, aside), and the simulator on the fitted preset adds them again."""
    from simulator.simulation import run_simulation

    tmp, preset, _ = known_run
    wl = tmp / "workload.parquet"
    late = run_simulation(small_workload(), "vllm-default", preset=str(preset), out_dir=tmp_path / "late",
                          progress=False, time_scale=0.5, round_trip_s=0.05)
    at_once = run_simulation(small_workload(), "vllm-default", preset=str(preset), progress=False, time_scale=0.5)
    assert late.summary.round_trip_s == 0.05 and at_once.summary.round_trip_s == 0.0
    assert late.summary.metrics.makespan_s > at_once.summary.metrics.makespan_s  # a follow-up on its critical path
    out = tmp_path / "fitted.toml"
    res = cli("calibrate", "--telemetry", tmp_path / "late", "-o", out, "--workload", wl, "--time-scale", "0.5")
    assert res.exit_code == 0, res.output
    assert "client round trip: median 50.00 ms, p90 50.00 ms" in said(res)
    assert read_preset_file(out).round_trip_quantiles_s == pytest.approx((0.05,) * 21, abs=1e-6)
    again = run_simulation(small_workload(), "vllm-default", preset=str(out), progress=False, time_scale=0.5)
    assert again.summary.round_trip_s == pytest.approx(0.05, abs=1e-6)
    assert again.summary.metrics.makespan_s == pytest.approx(late.summary.metrics.makespan_s, rel=0.01)
    # without --workload it is not measured, and the preset says 0
    res = cli("calibrate", "--telemetry", tmp_path / "late", "-o", tmp_path / "plain.toml")
    assert res.exit_code == 0 and "round trip: not measured" in said(res)
    assert read_preset_file(tmp_path / "plain.toml").round_trip_quantiles_s == ()
    # a workload that is not there
    res = cli("calibrate", "--telemetry", tmp_path / "late", "-o", tmp_path / "x.toml",
              "--workload", tmp_path / "missing.parquet")
    assert res.exit_code == 2 and "missing.parquet" in said(res)


def test_bad_input_gets_a_named_error(known_run, tmp_path):
    tmp, preset, _ = known_run
    # telemetry with no steps
    (tmp_path / "empty").mkdir()
    res = cli("calibrate", "--telemetry", tmp_path / "empty", "-o", tmp_path / "x.toml")
    assert res.exit_code == 2 and "no steps telemetry" in said(res)
    # telemetry written before the step-cost columns
    from data.io import read_telemetry, write_telemetry_part

    old = read_telemetry(tmp / "run" / "telemetry", "steps")
    old = old.drop_columns(["decode_context_tokens", "prefill_context_tokens"])
    write_telemetry_part(tmp_path / "old", "steps", old, 0)
    res = cli("calibrate", "--telemetry", tmp_path / "old", "-o", tmp_path / "x.toml")
    assert res.exit_code == 2 and "column prefill_context_tokens is empty" in said(res)
    # a preset file with a missing field, and one with a bad value
    text = Path(preset).read_text()
    for broken, message in ((text.replace("decode_token_s = ", "# "), "missing field cost.decode_token_s"),
                            (text.replace("block_size = 32", "block_size = 0"), "engine.block_size must be")):
        bad = tmp_path / "bad.toml"
        bad.write_text(broken)
        with pytest.raises(PresetFileError, match=message):
            read_preset_file(bad)
        for command in ("simulate", "evaluate"):
            res = cli(command, "-w", tmp / "workload.parquet", "-o", tmp_path / command, "--preset", bad)
            assert res.exit_code == 2 and message.split(" must")[0] in said(res), (command, res.output)
    res = cli("calibrate", "--telemetry", tmp / "run", "-o", tmp_path / "preset.json")
    assert res.exit_code == 2 and "ends in .toml" in said(res)


def test_round_trips_are_drawn_from_the_measured_quantiles(known_run, tmp_path):
    from simulator.round_trip import RoundTrip

    quantiles = tuple(0.01 * i for i in range(21))  # uniform on [0, 0.2]
    a, b = RoundTrip(quantiles, seed=1), RoundTrip(quantiles, seed=1)
    draws = [a.draw() for _ in range(2000)]
    assert draws == [b.draw() for _ in range(2000)]  # one seed, one sequence: a run is deterministic
    assert 0.0 <= min(draws) and max(draws) <= 0.2 and abs(sorted(draws)[1000] - 0.1) < 0.01
    assert RoundTrip((0.03,)).draw() == 0.03 and not RoundTrip((0.0,)) and RoundTrip(quantiles).median_s == 0.1
    with pytest.raises(ValueError, match="non-decreasing"):
        RoundTrip((0.2, 0.1))
    # the preset's [client] section is checked like the rest
    _, preset, _ = known_run
    bad = tmp_path / "bad.toml"
    bad.write_text(Path(preset).read_text() + "\n[client]\nround_trip_quantiles_s = [0.2, 0.1]\n")
    with pytest.raises(PresetFileError, match="client.round_trip_quantiles_s must be a list of non-decreasing"):
        read_preset_file(bad)


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_every_driver_waits_the_round_trip_and_stays_deterministic(driver):
    """A follow-up waits the client's round trip in the synchronous and the asynchronous driver alike; one seed
    gives one run."""
    from simulator.simulation import run_simulation

    def run(trip: float, seed: int = 0):
        return run_simulation(small_workload(), "vllm-default", progress=False, driver=driver, round_trip_s=trip,
                              round_trip_seed=seed, kv_fraction=0.5).summary

    at_once, late, again = run(0.0), run(0.2), run(0.2)
    assert late.round_trip_s == 0.2 and at_once.round_trip_s == 0.0
    assert late.metrics.makespan_s > at_once.metrics.makespan_s
    assert again.metrics.makespan_s == late.metrics.makespan_s
