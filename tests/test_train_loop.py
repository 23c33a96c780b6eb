"""`kvpilot train --logs` into a real MLflow SQLite store, and the demo's whole loop on tiny workloads: the store it
leaves holds the run (params, metrics, artifacts), the registered model and its `champion` alias."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.loop_fixtures import KV, logged_run, mlflow_store, tiny_workload  # noqa: F401 - a fixture
from tests.test_sim_run import small_config
from training.cli import app


def test_train_group_keeps_its_subcommands(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["train", "--help"])
    assert res.exit_code == 0 and "--logs" in res.output and "predictors" in res.output and "policy" in res.output
    res = CliRunner().invoke(app, ["train", "predictors", "--help"])
    assert res.exit_code == 0 and "--test-steps" in res.output
    res = CliRunner().invoke(app, ["train", "policy", "--help"])
    assert res.exit_code == 0 and "--predictors" in res.output
    res = CliRunner().invoke(app, ["train", "--logs", str(tmp_path), "predictors", "--logs", str(tmp_path),
                                   "-o", str(tmp_path / "m")])
    assert res.exit_code == 2 and "--logs before `predictors`" in res.output
    res = CliRunner().invoke(app, ["train", "--logs", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "no such log" in res.output and "nope" in res.output
    for bad, said in (("0,3", "each > 0"), ("1,x", "comma-separated list of floats")):
        res = CliRunner().invoke(app, ["train", "--logs", str(tmp_path), "--tier-time-scales", bad,
                                       "-o", str(tmp_path / "w")])
        assert res.exit_code == 2 and said in " ".join(res.output.split()), res.output
        assert not (tmp_path / "w").exists()  # refused before anything ran
    for bad in ("lpt", "returning,x", ","):
        res = CliRunner().invoke(app, ["train", "--logs", str(tmp_path), "--admission-orders", bad,
                                       "-o", str(tmp_path / "w")])
        out = " ".join(res.output.split())
        assert res.exit_code == 2 and "--admission-orders: unknown order" in out and "returning, progress" in out, out
        assert not (tmp_path / "w").exists()


def test_demo_trains_the_preemption_head() -> None:
    """The demo trains with ``preempt=True`` (``train``'s search then serves the head only where it wins); the
    library default learns the head where the logs hold preemption decisions (``None``: every lever found)."""
    import dataclasses

    from policy.learning.config import OfflineConfig
    from training.demo import DemoConfig

    assert OfflineConfig().preempt is None
    cfg = dataclasses.replace(OfflineConfig(), **DemoConfig().policy_options)
    assert cfg.preempt is True


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, vllm_engine) -> Path:
    return logged_run(tmp_path_factory.mktemp("logs"))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_train_logs_one_run_and_registers_a_version(run_dir: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    heldout = tiny_workload(tmp_path / "heldout.parquet", seed=77)
    # no --kv-fraction or --preset: the held-out evaluation runs on the logs' engine (KV, H200-7B, no tier)
    res = CliRunner().invoke(app, ["train", "--logs", str(run_dir), "--experiment", "train-test", "-o",
                                   str(tmp_path / "work"), "--heldout-workload", str(heldout), "--trees", "20",
                                   "--search-iterations", "1", "--search-population", "2", "--jobs", "1",
                                   "--admission-orders", "none", "--no-progress"])
    assert res.exit_code == 0, res.output
    # the held-out table: the trained policy beside its prior (no trained network) and vLLM default
    assert "kvpilot v1" in res.output and "learned-prior v1" in res.output and "vllm-default" in res.output
    assert f"held-out evaluation on H200-7B, KV {KV:g} (preset, kv_fraction as the logs')" in res.output, res.output
    # these logs have no CPU tier: the tier training says it skipped, and the policy keeps the rule
    assert "tier: skipped" in res.output and "no CPU tier" in " ".join(res.output.split()), res.output
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("train-test").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    p, m = run.data.params, run.data.metrics
    assert int(p["data.requests_rows"]) > 0 and int(p["data.decisions_rows"]) > 0
    assert float(p["data.time_end_s"]) > float(p["data.time_start_s"]) >= 0.0
    assert p["predictors.num_trees"] == "20" and p["heldout.kv_fraction"] == str(KV)
    assert any(k.startswith("policy.") for k in p)  # OfflineConfig's hyper-parameters
    assert -1.0 <= m["predictors.length.kendall_tau"] <= 1.0 and 0.0 <= m["predictors.reuse.auc"] <= 1.0
    assert m["ope.dr_ci_low"] <= m["ope.dr"] <= m["ope.dr_ci_high"]
    assert m["heldout.makespan_ratio_vs_default"] > 0 and m["heldout.vllm-default.preemptions"] > 0
    assert m["heldout.makespan_ratio_vs_prior"] == pytest.approx(
        m["heldout.candidate.makespan_s"] / m["heldout.prior.makespan_s"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "heldout")}
    assert {"heldout/summary.md", "heldout/makespan.png"} <= artifacts
    # the policy search simulated the logged workload (shortest-first only: --admission-orders none): the zero
    # residual and two samples; what it kept is served
    assert m["search.samples"] == 3 and m["search.makespan_ratio_vs_trained_prior_order"] > 0
    assert m["search.admission.shortest"] == 1.0
    assert "policy/search.json" in {a.path for a in client.list_artifacts(run.info.run_id, "policy")}
    runtime = json.loads((tmp_path / "work" / "policy" / "policy.json").read_text())["config"]["runtime"]
    assert runtime["admission"] == "shortest"  # the order the search moved
    # the width was simulated with the levers kept, and is served exactly where the search kept it
    assert "'width': True}:" in " ".join(res.output.split()), res.output
    assert runtime.get("width", False) == (m.get("search.lever.width", 0.0) == 1.0)
    assert runtime["admission_residual"] == {k.removeprefix("search.residual."): v for k, v in m.items()
                                             if k.startswith("search.residual.")}
    version = client.get_model_version("kvpilot", "1")
    assert version.run_id == run.info.run_id
    from training.promote import trained_engine

    assert trained_engine("1") == {"preset": "H200-7B", "kv_fraction": KV, "offload_share": None,
                                   "offload_gib": None}  # the gate's


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_a_search_over_logs_without_their_workload_fails_before_fitting(run_dir: Path, tmp_path: Path) -> None:
    """The policy search replays the logged workloads: logs without one exit 2 naming what is missing, before any
    model is fitted or registered."""
    import shutil

    logs = tmp_path / "served"
    shutil.copytree(run_dir, logs)
    (logs / "workload.parquet").unlink()
    res = CliRunner().invoke(app, ["train", "--logs", str(logs), "-o", str(tmp_path / "work"),
                                   "--search-iterations", "1", "--no-progress"])
    assert res.exit_code == 2 and "noworkload.parquet" in "".join(res.output.split()), res.output
    assert not (tmp_path / "work" / "policy").exists()
    # the default (no CEM asked for) trains anyway: the admission order is not chosen, with a note, shortest-first
    res = CliRunner().invoke(app, ["train", "--logs", str(logs), "-o", str(tmp_path / "work"), "--trees", "5",
                                   "--tier-rounds", "0", "--jobs", "1", "--no-progress"])
    out = " ".join(res.output.split())
    assert res.exit_code == 0 and "no workload.parquet" in out, out
    assert "admission order, levers and width: not chosen" in out, out
    runtime = json.loads((tmp_path / "work" / "policy" / "policy.json").read_text())["config"]["runtime"]
    assert runtime["admission"] == "shortest"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_a_servers_logs_choose_their_order_on_the_preset_fitted_to_that_server(run_dir: Path, tmp_path: Path) -> None:
    """A server's telemetry (its workload beside it, no simulator summary): without ``--engine-preset`` the order is
    not chosen and the note names the option; with it, the order and the width are simulated on that engine and
    served as kept, and the tier (which a fitted engine lacks) is skipped with a note."""
    import ast
    import shutil

    from simulator.fitted_cost import write_preset_file
    from tests.test_calibrate import KNOWN

    logs = tmp_path / "served"
    shutil.copytree(run_dir, logs)
    (logs / "summary.json").unlink()
    args = ["train", "--logs", str(logs), "--trees", "5", "--jobs", "1", "--no-progress"]
    res = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "plain")])
    out = " ".join(res.output.split())
    assert res.exit_code == 0 and "--engine-preset" in out, out
    assert "admission order, levers and width: not chosen" in out, out
    preset = tmp_path / "server.toml"
    write_preset_file(KNOWN, preset)
    res = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "work"), "--engine-preset", str(preset)])
    out = " ".join(res.output.split())
    assert res.exit_code == 0, out
    assert "search: {'admission': 'queue'}:" in out and "search: kept" in out, out
    assert "tier: skipped (a server's logs replay on its fitted engine, which has no CPU tier)" in out, out
    runtime = json.loads((tmp_path / "work" / "policy" / "policy.json").read_text())["config"]["runtime"]
    kept = ast.literal_eval(out.split("search: kept ")[1].split(" (")[0])
    assert runtime["admission"] == kept["admission"] and runtime.get("width", False) == kept.get("width", False)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_demo_loop_leaves_run_model_and_alias(tmp_path: Path, vllm_engine) -> None:
    from mlflow.tracking import MlflowClient

    from training.demo import DemoConfig, run_demo

    cfg = DemoConfig(train=small_config(0, prompts=8, group=4, steps=3), heldout=small_config(77, 8, 4, 1),
                     kv_fraction=KV, baselines=("sortedrl", "heddle"), jobs=1, experiment="demo-test",
                     policy_options={})
    result = run_demo(tmp_path / "demo", cfg)
    labels = [r["label"] for r in result.rows]
    assert labels[0].startswith("vLLM default") and labels[1].startswith("best baseline: ")
    assert "from the registry" in labels[-1] and labels[-2].startswith("learned-prior")  # beside its prior
    assert result.rows[0]["gap_closed"] == 0.0 and all(r["makespan_over_bound"] >= 1.0 for r in result.rows)
    served = result.rows[-1]
    assert served["makespan_s"] == pytest.approx(served["direct_makespan_s"])  # registry = the same model loaded
    assert served.get("hook_fallbacks", 0) == 0
    assert (tmp_path / "demo" / "before_after.md").is_file() and (tmp_path / "demo" / "before_after.png").is_file()
    # what `mlflow ui` shows: the run, the registered model and its alias
    client = MlflowClient(tracking_uri=result.tracking_uri)
    exp = client.get_experiment_by_name("demo-test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].data.metrics
    # train chose the admission order by simulating the logged workload (one of those tried, served as kept)
    m = runs[0].data.metrics
    orders = ("shortest", "siblings", "returning", "progress", "queue")
    chosen = [o for o in orders if m.get(f"search.admission.{o}") == 1.0]
    runtime = json.loads((tmp_path / "demo" / "train" / "policy" / "policy.json").read_text())["config"]["runtime"]
    assert len(chosen) == 1 and runtime["admission"] == chosen[0], (chosen, runtime["admission"])
    assert runtime.get("width", False) == (m.get("search.lever.width", 0.0) == 1.0)
    champion = client.get_model_version_by_alias("kvpilot", "champion")
    assert str(champion.version) == result.version and champion.run_id == runs[0].info.run_id
    assert "champion" in client.get_registered_model("kvpilot").aliases
