"""``kvpilot simulate --policy registry`` (the hook loading ``models:/kvpilot@champion``) gives exactly the numbers
of the same POLICY_DIR loaded directly (``--policy learned --policy-options '{"model": DIR}'``)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from training import registry as reg

pytestmark = pytest.mark.vllm

#: Keys that legitimately differ: the policy's name, wall-clock timings, and the registry's own report.
NOT_COMPARED = {"policy", "wall_s", "scheduler_s", "hook_s", "router_s", "simulator_overhead", "setup_s",
                "model_version", "model_swaps"}


def test_registry_champion_reproduces_the_direct_policy(vllm_engine, tmp_path, monkeypatch):
    import mlflow

    from data.io import write_workload
    from data.synth import generate
    from tests.test_model_source import make_learned_dir, train_predictors
    from tests.test_sim_run import small_config
    from training.cli import app

    policy_dir = make_learned_dir(tmp_path / "P", train_predictors(tmp_path / "pred"), seed=3)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "unset")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("KVPILOT_MODEL_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # the embedded default store: ./mlruns.db
    reg.configure("kvpilot")
    with mlflow.start_run() as run:
        version = reg.log_policy_model(policy_dir, run)
    reg.set_champion(version.version)

    workload = tmp_path / "w.parquet"
    write_workload(generate(small_config(11, prompts=4, group=4, steps=1)), workload)
    common = ["simulate", "--workload", str(workload), "--kv-fraction", "0.3", "--json", "--no-progress"]
    runner = CliRunner()
    direct = runner.invoke(app, [*common, "--policy", "learned", "--policy-options",
                                 json.dumps({"model": str(policy_dir)}), "-o", str(tmp_path / "direct")])
    assert direct.exit_code == 0, direct.output
    served = runner.invoke(app, [*common, "--policy", "registry", "-o", str(tmp_path / "registry")])
    assert served.exit_code == 0, served.output
    a, b = json.loads(direct.stdout), json.loads(served.stdout)

    assert b["policy"] == "registry" and b["model_version"] == "1" and b["model_swaps"] == 0 == b["model_failures"]
    assert b["hook_fallbacks"] == 0
    assert a["preemptions"] > 0  # the learned policy's preemption lever was exercised
    assert {k: v for k, v in a.items() if k not in NOT_COMPARED} == {
        k: v for k, v in b.items() if k not in NOT_COMPARED}


def test_a_missing_champion_runs_vllms_behaviour_and_is_counted(vllm_engine, tmp_path, monkeypatch):
    """A registry with no such model: the run completes on vLLM's own behaviour, every step a fallback, and the
    summary counts the failed load of each replica, those that never ran a step (more replicas than requests)
    included."""
    from data.io import write_workload
    from data.synth import generate
    from tests.test_sim_run import small_config
    from training.cli import app

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("KVPILOT_MODEL_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # the embedded default store: ./mlruns.db, with nothing registered
    workload = tmp_path / "w.parquet"
    write_workload(generate(small_config(11, prompts=1, group=2, steps=1)), workload)  # 2 requests
    out = CliRunner().invoke(app, ["simulate", "--workload", str(workload), "--kv-fraction", "0.8", "--json",
                                   "--no-progress", "--replicas", "4", "--policy", "registry", "--policy-options",
                                   json.dumps({"uri": "models:/absent@champion"}), "-o", str(tmp_path / "run")])
    assert out.exit_code == 0, out.output
    s = json.loads(out.stdout)
    assert s["model_version"] is None and s["model_failures"] == 4
    assert s["hook_fallbacks"] == s["engine_steps"] > 0
