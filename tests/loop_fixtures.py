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


def inverted(policy_dir: Path, out: Path) -> Path:
    """A deliberately worse POLICY_DIR: the same one with its scorer's last layer negated (every ranking reversed)."""
    import torch

    shutil.copytree(policy_dir, out)
    state = torch.load(out / "policy.pt", weights_only=True)
    last = [k for k, v in state.items() if k.endswith("weight") and v.dim() == 2][-1]
    state[last] = -state[last]
    bias = last[: -len("weight")] + "bias"
    if bias in state:
        state[bias] = -state[bias]
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
