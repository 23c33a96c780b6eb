"""Shared set-up of the loop tests: tiny workloads, a logged simulation, hand-wired POLICY_DIRs, an MLflow store."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from data.io import write_workload
from data.synth import generate
from tests.test_sim_run import small_config
from training.train import HELDOUT_DECODE_STRIDE

#: KV size of the tiny runs: vLLM default preempts on them, and the policies' choices move the makespan.
KV = 0.15


def tiny_workload(path: Path, seed: int, steps: int = 1, prompts: int = 8) -> Path:
    write_workload(generate(small_config(seed, prompts=prompts, group=4, steps=steps)), path)
    return path


def logged_run(root: Path, steps: int = 3) -> Path:
    """A tiny training workload (``steps`` RL steps) simulated with the exploring ``logging`` policy (its workload
    beside it)."""
    from simulator.simulation import run_simulation
    from simulator.workload import load_workload

    wl = tiny_workload(root / "train.parquet", seed=0, steps=steps, prompts=8)
    run = root / "logging"
    run_simulation(load_workload(wl), "logging", kv_fraction=KV, out_dir=run, progress=False,
                   decode_stride=HELDOUT_DECODE_STRIDE, policy_options={"offload": False})  # the loop, not the tier
    shutil.copy(wl, run / "workload.parquet")
    return run


def base_policy_dir(root: Path) -> Path:
    """A POLICY_DIR with real predictors (fitted on a workload file) and an untrained scorer."""
    from policy.learned.policy import LearnedPolicy
    from policy.learned.scorer import build_scorer
    from predictors.logs import load_logs
    from predictors.pipeline import train_bundle

    wl = tiny_workload(root / "predictors-train.parquet", seed=1, steps=4, prompts=8)
    predictors = train_bundle(load_logs([wl]), num_trees=20, num_threads=1).save(root / "predictors")
    state = build_scorer().state_dict()
    # preempt=True: the wired scorers below choose victims with their preemption head; resume_preempted=False:
    # their admission head orders every waiting request, the preempted ones too (with the rule on, the wired
    # "worse" policy re-admitted its own costly victims first and ran the gate's workload faster than the
    # "better" one: 19.1 s against 19.7 s)
    return LearnedPolicy(state, None, predictors_dir=predictors, preempt=True,
                         resume_preempted=False).save(root / "base")


def wired(base: Path, out: Path, admit: tuple[str, float] | None, preempt: tuple[str, float]) -> Path:
    """A copy of POLICY_DIR ``base`` whose scorer is rewired to rank by one feature per head: ``(name, sign)``.

    Each head's first hidden unit carries its standardised feature plus a large offset (so every ReLU passes it)
    and the output layer reads it times ``sign``; ``admit=None`` makes every admission score equal (the
    waiting queue's own order). Its runtime admission order is the scorer's (``admission="scorer"``)."""
    import torch

    shutil.copytree(base, out)
    manifest = json.loads((out / "policy.json").read_text())
    manifest["config"].setdefault("runtime", {})["admission"] = "scorer"
    (out / "policy.json").write_text(json.dumps(manifest, indent=2))
    schema = manifest["feature_schema"]
    state = torch.load(out / "policy.pt", weights_only=True)
    layers = [k[: -len("weight")] for k, v in state.items() if k.endswith("weight") and v.dim() == 2]
    heads = {schema["heads"].index("admit"): admit, schema["heads"].index("preempt"): preempt}
    for i, layer in enumerate(layers):
        w, b = torch.zeros_like(state[layer + "weight"]), torch.zeros_like(state[layer + "bias"])
        for head, spec in heads.items():
            if spec is None:
                continue
            if i == 0:
                w[head, schema["features"].index(spec[0])], b[head] = 1.0, 100.0
            elif i < len(layers) - 1:
                w[head, head] = 1.0
            else:
                w[head, head] = spec[1]
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
