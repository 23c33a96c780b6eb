"""`kvpilot train predictors` and `kvpilot predictors eval`, and Search-R1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from data.io import write_telemetry_part, write_workload
from tests.test_predictors_features import fake_telemetry, small_workload
from training.cli import app

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
SEARCH_R1 = TRACES / "polytrace" / "search_r1"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A telemetry run directory (hand-made times) with its workload beside it."""
    d = tmp_path_factory.mktemp("run")
    w = small_workload(steps=4, prompts=8)
    write_telemetry_part(d / "telemetry", "requests", fake_telemetry(w), 0)
    write_workload(w, d / "workload.parquet")
    return d


def test_train_then_eval_json(run_dir, tmp_path):
    runner = CliRunner()
    model = tmp_path / "model"
    res = runner.invoke(app, ["train", "predictors", "--logs", str(run_dir), "-o", str(model), "--trees", "15",
                                    "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["train_steps"] == [0, 1, 2] and rep["test_steps"] == [3]  # held out by RL step
    for key in ("kendall_tau", "pinball_p50", "mae"):
        assert key in rep["length"]
    for name in ("domain_mean", "prompt_history"):
        assert "kendall_tau" in rep["length"]["baselines"][name]
    assert "auc" in rep["reuse"] and "brier" in rep["reuse"]
    for name in ("recency", "frequency"):
        assert "brier" in rep["reuse"]["baselines"][name]
    assert (model / "length" / "manifest.json").is_file() and (model / "reuse" / "manifest.json").is_file()
    assert (model / "session" / "manifest.json").is_file()
    for name, base in (("tool_latency", "tool_median"), ("turns_remaining", "turn_count_prior"),
                       ("next_use", "tool_median")):
        assert {"model", base} <= set(rep["session"][name])

    res = runner.invoke(app, ["predictors", "eval", "--model", str(model), "--logs", str(run_dir), "--steps", "3",
                                         "--json"])
    assert res.exit_code == 0, res.output
    ev = json.loads(res.stdout)
    assert ev["length"]["mae"] == pytest.approx(rep["length"]["mae"])
    assert ev["reuse"]["brier"] == pytest.approx(rep["reuse"]["brier"])
    assert ev["session"]["continue"]["model"]["log_loss"] == pytest.approx(
        rep["session"]["continue"]["model"]["log_loss"])
    assert ev["length"]["baselines"]["prompt_history"]["pinball_p50"] == pytest.approx(
        rep["length"]["baselines"]["prompt_history"]["pinball_p50"])

    res = runner.invoke(app, ["predictors", "eval", "--model", str(model), "--logs", str(run_dir)])
    assert res.exit_code == 0, res.output
    assert "pinball" in res.stdout and "AUC" in res.stdout and "tool_median" in res.stdout
    res = runner.invoke(app, ["predictors", "eval", "--model", str(model), "--logs", str(run_dir), "--steps", "7-9"])
    assert res.exit_code == 2 and "steps 7, 8, 9: the logs hold no request of them" in " ".join(res.output.split())


def test_cli_errors_are_clean(run_dir, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["train", "predictors", "--logs", str(tmp_path / "nope"), "-o", str(tmp_path / "m")])
    assert res.exit_code == 2 and "no such log" in res.output
    res = runner.invoke(app, ["train", "predictors", "--logs", str(run_dir), "-o", str(tmp_path / "m"),
                                    "--test-steps", "9"])
    assert res.exit_code == 2 and "empty" in res.output
    res = runner.invoke(app, ["train", "predictors", "--logs", str(run_dir), "-o", str(tmp_path / "m"),
                              "--test-steps", "1-x"])
    assert res.exit_code == 2 and "RL steps must be integers or ranges" in res.output
    res = runner.invoke(app, ["predictors", "eval", "--model", str(tmp_path / "none"), "--logs", str(run_dir)])
    assert res.exit_code == 2 and "no such model directory" in res.output
    (tmp_path / "bad").mkdir()
    res = runner.invoke(app, ["predictors", "eval", "--model", str(tmp_path / "bad"), "--logs", str(run_dir)])
    assert res.exit_code == 2 and "manifest" in res.output


@pytest.mark.slow
@pytest.mark.skipif(not SEARCH_R1.is_dir(), reason=f"PolyTrace Search-R1 trace not found at {SEARCH_R1}")
def test_search_r1_length_model_beats_baselines(tmp_path):
    """Search-R1: train on steps 0-1, test on step 2, from the workload table (no simulation)."""
    from data.importers import import_polytrace_multiturn

    files = sorted(SEARCH_R1.glob("*.jsonl"))
    if len(files) < 3:
        pytest.skip(f"expected 3 step files in {SEARCH_R1}, found {len(files)}")
    write_workload(import_polytrace_multiturn(files).table, tmp_path / "search_r1.parquet")
    res = CliRunner().invoke(app, ["train", "predictors", "--logs", str(tmp_path / "search_r1.parquet"), "-o",
                                   str(tmp_path / "m"), "--test-steps", "2", "--no-reuse", "--trees", "60", "--json"])
    assert res.exit_code == 0, res.output
    L = json.loads(res.stdout)["length"]
    assert L["kendall_tau"] > 0.25
    for b in L["baselines"].values():
        assert L["pinball_p50"] < b["pinball_p50"] and L["mae"] < b["mae"]
