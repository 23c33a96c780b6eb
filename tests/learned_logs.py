"""Tiny logs for the learned-policy tests: a scaled-down workload simulated under the exploring policy.

:func:`tiny_workload` is the default domain mix with short code outputs;
:func:`simulate` runs it on vLLM's real scheduler through the hook and returns
the run directory (telemetry under ``run/telemetry``). :func:`learned_runs` is a
session fixture (import it into a test module) with exploring-policy logs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

#: A KV size at which the tiny workload preempts (so admission and preemption decisions are logged).
KV_FRACTION = 0.25


def tiny_workload(seed: int, prompts: int = 6, group: int = 4, steps: int = 2) -> pa.Table:
    from data.synth import SynthConfig, generate

    cfg = SynthConfig(steps=steps, prompts_per_step=prompts, group_size=group, seed=seed)
    d = dict(cfg.domains)
    d["code"] = dataclasses.replace(d["code"], output_tokens=dataclasses.replace(d["code"].output_tokens, median=400),
                                    max_tokens=1500)
    return generate(dataclasses.replace(cfg, domains=d))


def simulate(workload: pa.Table, policy: str, out_dir: Path, **policy_options: Any) -> Path:
    from simulator.simulation import run_simulation

    run_simulation(workload, policy, kv_fraction=KV_FRACTION, out_dir=out_dir, progress=False,
                   policy_options=policy_options or None)
    return out_dir


def predictors_from(log_dir: Path, out_dir: Path) -> Path:
    """A MODEL_DIR (length model only) trained on ``log_dir``'s requests."""
    from predictors.logs import load_logs
    from predictors.pipeline import train_bundle

    bundle = train_bundle(load_logs([log_dir]), num_trees=20, reuse=False)
    bundle.save(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def learned_runs(vllm_engine, tmp_path_factory) -> dict[str, Path]:
    """Logs of the exploring policy on two training workloads and one held-out workload (another seed), the
    predictors trained on the first, and the held-out workload itself (``"heldout_workload"``)."""
    root = tmp_path_factory.mktemp("learned")
    # without the CPU tier (the exploring policy's default uses it): these logs test what is learned from outcomes
    runs = {name: simulate(tiny_workload(seed), "logging", root / name, offload=False)
            for name, seed in (("train1", 1), ("train2", 2), ("heldout", 3))}
    runs["predictors"] = predictors_from(runs["train1"], root / "pred")
    runs["root"] = root
    return runs
