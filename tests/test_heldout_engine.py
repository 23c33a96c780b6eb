"""The held-out evaluation runs on the engine the policy was trained on: ``train`` reads it from the logs'
summaries (where they agree), ``promote`` from the version's training run; options given win."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

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
