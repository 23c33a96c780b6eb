"""The held-out evaluation runs on the engine the policy was trained on: ``train`` reads it from the logs'
summaries (where they agree), ``promote`` from the version's training run; options given win."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.loop_fixtures import mlflow_store  # noqa: F401 - a fixture
from training.cli import app
from training.train import HeldoutParams, logs_engine


def _log(root: Path, name: str, **summary) -> Path:
    d = root / name
    d.mkdir()
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def test_logs_engine_is_what_every_log_agrees_on(tmp_path: Path) -> None:
    """The preset, and KV and tier as shares of the logged workload's need (the same pressure on a held-out
    workload of another size); what the logs differ in, or do not say, is noted and not followed."""
    gpu = dict(preset="H200-32B", kv_fraction=None, kv_share_of_need=0.4706057, offload_gib=64.0,
               offload_blocks=16384, offload_share_of_need=0.4871985)
    a, b = _log(tmp_path, "a", **gpu), _log(tmp_path, "b", **gpu)
    assert logs_engine([a, b]) == ({"preset": "H200-32B", "kv_fraction": 0.4706, "offload_share": 0.4872}, [])
    # a log at another KV size and without the tier: only the preset is shared
    c = _log(tmp_path, "c", preset="H200-32B", kv_fraction=0.2, kv_share_of_need=0.2000008, offload_gib=64.0,
             offload_blocks=0, offload_share_of_need=None)
    engine, notes = logs_engine([a, c])
    assert engine == {"preset": "H200-32B"}
    assert any("kv_fraction" in n for n in notes) and any("offload_share" in n for n in notes)
    assert logs_engine([c]) == ({"preset": "H200-32B", "kv_fraction": 0.2}, [])  # no tier: none to follow
    # with the held-out step of the logs' own mix: the engine as set (the GPU's capacity, the tier in GiB)
    from simulator.cost_model import CostModel

    full = dict(gpu, kv_blocks=CostModel.preset("H200-32B").max_kv_blocks(16))
    d, e = _log(tmp_path, "d", **full), _log(tmp_path, "e", **{**full, "kv_share_of_need": 0.39})
    assert logs_engine([d, e], same_mix=True) == (
        {"preset": "H200-32B", "kv_fraction": None, "offload_gib": 64.0, "offload_share": None}, [])
    engine, notes = logs_engine([d, e])  # KV shares of needs that differ: not followed
    assert "kv_fraction" not in engine and any("kv_fraction" in n for n in notes)
    assert logs_engine([c], same_mix=True)[0] == {"preset": "H200-32B", "kv_fraction": 0.2}  # a fraction given
    # a missing summary says so
    engine, notes = logs_engine([tmp_path])
    assert engine == {} and "summary" in notes[0] and str(tmp_path) in notes[0]


def test_heldout_engine_is_validated_and_described(tmp_path: Path) -> None:
    from training.train import TrainError

    assert HeldoutParams(preset="H200-32B", kv_fraction=None, offload_gib=64.0).engine() == \
        "H200-32B, KV gpu, tier 64 GiB"
    assert HeldoutParams(preset="H200-32B", kv_fraction=0.47, offload_share=0.49).engine() == \
        "H200-32B, KV 0.47, tier 0.49 of the need"
    with pytest.raises(TrainError, match="unknown held-out preset 'B200-1T'"):
        HeldoutParams(preset="B200-1T")
    res = CliRunner().invoke(app, ["train", "--logs", str(tmp_path), "--kv-fraction", "lots"])
    assert res.exit_code == 2 and "--kv-fraction: expected a number or 'gpu', got 'lots'" in res.output
    res = CliRunner().invoke(app, ["promote", "--version", "1", "--preset", "B200-1T"])
    assert res.exit_code == 2 and "unknown held-out preset" in res.output


@pytest.mark.vllm
def test_a_tier_share_is_that_share_of_the_heldout_workloads_need(tmp_path: Path, vllm_engine) -> None:
    from tests.loop_fixtures import tiny_workload

    wl = tiny_workload(tmp_path / "w.parquet", seed=5)
    res = HeldoutParams(workload=wl, kv_fraction=0.3, offload_share=0.5).run(wl, ["vllm-offload"], tmp_path / "e",
                                                                              progress=False)
    row = next(r for r in res.rows if r["policy"] == "vllm-offload")
    assert row["offload_share_of_need"] == pytest.approx(0.5, abs=0.01), row


def test_the_heldout_step_is_a_fresh_step_of_the_logs_mix(tmp_path: Path) -> None:
    """Logs whose workloads were synthesized from one mix (any seed, any steps) give that mix to the held-out step,
    generated at the held-out seed: it has the logs' domains and sizes, so the memory pressure the policy learned
    is there to decide. Mixes that differ, or a workload that was imported, leave the default mix, with a note."""
    import dataclasses

    import pyarrow.parquet as pq

    from data.io import source_of, write_workload
    from data.synth import SynthConfig, generate
    from tests.test_sim_run import small_config
    from training.train import heldout_workload, logs_mix

    def log_of(name: str, cfg: SynthConfig) -> Path:
        d = _log(tmp_path, name, preset="H200-7B")
        write_workload(generate(cfg), d / "workload.parquet")
        return d

    mix = small_config(0, prompts=3, group=2, steps=1)
    a, b = log_of("a", dataclasses.replace(mix, seed=11)), log_of("b", dataclasses.replace(mix, seed=12, steps=2))
    got, notes = logs_mix([a, b])
    assert got == dataclasses.replace(mix, seed=0) and notes == []
    params = HeldoutParams(mix=got, seed=4242)
    assert params.describe_workload() == "a fresh step of the logs' synthetic mix (3 prompts, seed 4242)"
    path = heldout_workload(params, tmp_path)
    made = SynthConfig.from_dict(source_of(pq.read_table(path))["config"])
    assert made == dataclasses.replace(mix, seed=4242, steps=1)
    assert HeldoutParams().describe_workload().startswith("a step of the default synthetic mix (16 prompts")

    other = log_of("c", dataclasses.replace(mix, prompts_per_step=5))
    got, notes = logs_mix([a, other])
    assert got is None and "different synthetic mixes" in notes[0]
    bare = _log(tmp_path, "d", preset="H200-7B")  # a served log: no workload beside it
    got, notes = logs_mix([a, bare])
    assert got is None and str(bare) in notes[0] and "default mix" in notes[0]


@pytest.mark.usefixtures("mlflow_store")
def test_promote_follows_the_mix_its_training_held_out(tmp_path: Path) -> None:
    """The gate of a version runs the held-out mix its training ran (the run's artifact), its engine beside it."""
    import dataclasses

    import mlflow

    from data.synth import SynthConfig
    from training import registry
    from training.promote import trained_engine
    from training.train import HELDOUT_MIX_ARTIFACT

    mix = dataclasses.replace(SynthConfig.preset("agentic"), prompts_per_step=4, seed=0, steps=1)
    registry.configure("heldout-mix-test")
    with mlflow.start_run() as run:
        mlflow.log_params({"heldout.preset": "H200-32B", "heldout.kv_fraction": "None", "heldout.mix": "True"})
        mlflow.log_dict(dataclasses.asdict(mix), HELDOUT_MIX_ARTIFACT)
    client = registry.client()
    client.create_registered_model(registry.MODEL_NAME)
    version = client.create_model_version(registry.MODEL_NAME, f"runs:/{run.info.run_id}/policy", run.info.run_id)
    assert trained_engine(version.version) == {"preset": "H200-32B", "kv_fraction": None, "mix": mix}
