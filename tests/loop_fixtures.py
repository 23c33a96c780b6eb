"""Shared set-up of the loop tests: a tiny logged simulation, a trained POLICY_DIR, a worse one, an MLflow store."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from data.io import write_workload
from data.synth import generate
from tests.test_sim_run import small_config

#: KV size of the tiny runs: vLLM default preempts on them.
KV = 0.3


def tiny_workload(path: Path, seed: int, steps: int = 2) -> Path:
    write_workload(generate(small_config(seed, prompts=4, group=4, steps=steps)), path)
    return path


def logged_run(root: Path) -> Path:
    """The tiny training workload simulated with the exploring ``logging`` policy (its workload beside it)."""
    from data.io import read_workload
    from simulator.simulation import run_simulation

    wl = tiny_workload(root / "train.parquet", seed=0, steps=3)
    run = root / "logging"
    run_simulation(read_workload(wl), "logging", kv_fraction=KV, out_dir=run, progress=False, validate=False)
    shutil.copy(wl, run / "workload.parquet")
    return run


def most_recompute(policy_dir: Path, out: Path) -> Path:
    """A deliberately worse POLICY_DIR: its scorer rewired to preempt the running request with the most computed
    tokens (the most to recompute, again and again) and to admit in arrival order (all admission scores equal).

    Built from the manifest's feature schema and heads: the first hidden unit carries the standardised
    ``log_computed_tokens`` plus a large offset (so every ReLU passes it), the output's preempt head reads it."""
    import json

    import torch

    shutil.copytree(policy_dir, out)
    schema = json.loads((out / "policy.json").read_text())["feature_schema"]
    feature, head = schema["features"].index("log_computed_tokens"), schema["heads"].index("preempt")
    state = torch.load(out / "policy.pt", weights_only=True)
    layers = [k[: -len("weight")] for k, v in state.items() if k.endswith("weight") and v.dim() == 2]
    for i, layer in enumerate(layers):
        w, b = torch.zeros_like(state[layer + "weight"]), torch.zeros_like(state[layer + "bias"])
        if i == 0:
            w[0, feature], b[0] = 1.0, 100.0
        elif i < len(layers) - 1:
            w[0, 0] = 1.0
        else:
            w[head, 0] = 1.0
        state[layer + "weight"], state[layer + "bias"] = w, b
    torch.save(state, out / "policy.pt")
    return out


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory):
    """An empty embedded store (``<tmp>/mlruns.db``, ``<tmp>/mlartifacts``) for the module; the cwd is ``<tmp>``."""
    root = tmp_path_factory.mktemp("store")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlruns.db'}")
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        from training import registry

        registry.configure()
        yield root
