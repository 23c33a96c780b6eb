"""`kvpilot train` from what a user has after one RL step: the held-out data is split by GRPO group instead of by
RL step (said in a printed line and in the reports), and a single group is a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from predictors.logs import split_heldout
from tests.loop_fixtures import KV, logged_run, mlflow_store, tiny_workload  # noqa: F401 - a fixture
from training.cli import app


def _requests(steps: list[int], groups: list[str | None]) -> pd.DataFrame:
    n = len(steps)
    return pd.DataFrame({"request_id": [f"r{i}" for i in range(n)], "step": steps, "group_id": groups,
                         "session_id": [None] * n, "arrival_s": np.arange(n, dtype=float)})


def test_one_step_is_split_by_group_and_several_by_step() -> None:
    one = _requests([0] * 8, [f"g{i // 2}" for i in range(8)])
    split = split_heldout(one)
    assert split.by == "group"
    assert list(one.loc[split.test, "group_id"].unique()) == ["g3"]  # the last quarter of the groups, whole
    assert "held out by GRPO group" in split.describe(one) and "3 train groups -> 1 test groups" in split.describe(one)
    many = _requests([0, 0, 1, 1, 2, 2, 3, 3], ["g0"] * 8)
    assert split_heldout(many).by == "step" and many.loc[split_heldout(many).test, "step"].unique().tolist() == [3]
    # requests without a group are groups of their own
    lone = split_heldout(_requests([0, 0], [None, None]))
    assert lone.by == "group" and lone.test.tolist() == [False, True]


def test_one_step_of_one_group_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="at least 2 groups.*g0.*group_id"):
        split_heldout(_requests([0] * 4, ["g0"] * 4))


def test_policy_split_of_one_step_by_the_acted_groups() -> None:
    from policy.learning.data import Decisions
    from policy.learning.offline import heldout_mask, heldout_split

    d = 8
    data = Decisions(np.zeros((2 * d, 1), np.float32), np.zeros(2 * d), np.arange(0, 2 * d + 1, 2), np.zeros(d, int),
                     np.zeros(d, int), np.ones(d), np.zeros(d), np.arange(d, dtype=float), np.zeros(d, int),
                     np.zeros(d, int), np.array([f"g{i // 2}" for i in range(d)], object))
    assert heldout_split(data, 1) == "group"
    mask = heldout_mask(data, "group", 0.25, 1)
    assert mask.tolist() == [False] * 6 + [True] * 2
    with pytest.raises(ValueError, match="one GRPO group.*g0.*group_id"):
        heldout_split(data.subset(np.arange(2)), 1)
    data.step[-1] = 1
    assert heldout_split(data, 1) == "time" and heldout_split(data, 2) == "log"


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory: pytest.TempPathFactory, vllm_engine) -> Path:
    """The exploring policy's logs of one RL step (8 prompts x 4 samples), its workload beside it."""
    return logged_run(tmp_path_factory.mktemp("one-step"), steps=1)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_train_from_one_rl_step(one_step_run: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from data.io import read_telemetry

    assert set(read_telemetry(one_step_run / "telemetry", "requests", ["step"])["step"].to_pylist()) == {0}
    heldout = tiny_workload(tmp_path / "heldout.parquet", seed=77)
    res = CliRunner().invoke(app, ["train", "--logs", str(one_step_run), "--experiment", "one-step", "-o",
                                   str(tmp_path / "work"), "--heldout-workload", str(heldout), "--kv-fraction",
                                   str(KV), "--trees", "20", "--no-progress"])
    assert res.exit_code == 0, res.output
    out = res.output + (res.stderr if res.stderr_bytes is not None else "")
    assert "held out by GRPO group (the logs hold one RL step, 0)" in out
    assert "policy: held out by GRPO group" in out
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("one-step").experiment_id])
    assert run.data.params["predictors.split"] == "group" and run.data.params["policy.split"] == "group"
    report = client.download_artifacts(run.info.run_id, "predictors/report.json", str(tmp_path))
    report = json.loads(Path(report).read_text())
    assert report["split"] == "group" and report["train_steps"] == report["test_steps"] == [0]
    assert report["length"]["n"] > 0
    manifest = json.loads((tmp_path / "work" / "policy" / "policy.json").read_text())
    assert manifest["trained_on"]["split"] == "group" and manifest["trained_on"]["decisions_test"] > 0
    assert -1.0 <= run.data.metrics["predictors.length.kendall_tau"] <= 1.0


@pytest.mark.vllm
def test_train_into_a_store_mlflow_cannot_open_is_a_named_error(one_step_run: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://nowhere")
    res = CliRunner().invoke(app, ["train", "--logs", str(one_step_run), "-o", str(tmp_path / "work"),
                                   "--no-progress"])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "in the MLflow store bogus://nowhere" in said, res.output


@pytest.mark.vllm
def test_a_failed_training_leaves_the_earlier_policy_in_place(one_step_run: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    earlier = tmp_path / "work" / "policy"
    earlier.mkdir(parents=True)
    (earlier / "policy.json").write_text('{"earlier": true}')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://nowhere")  # fails after the training has started
    res = CliRunner().invoke(app, ["train", "--logs", str(one_step_run), "-o", str(tmp_path / "work"),
                                   "--no-progress"])
    assert res.exit_code == 2, res.output
    assert sorted(p.name for p in (tmp_path / "work").iterdir() if not p.name.startswith(".")) == ["policy"]
    assert (earlier / "policy.json").read_text() == '{"earlier": true}'


def test_a_new_policy_replaces_the_earlier_one_when_it_is_written(tmp_path: Path) -> None:
    """Success replaces it (and says so); a training killed mid-run leaves the earlier one set aside, and the next
    training takes that one as the earlier one (the killed run's partial output goes)."""
    import io

    from rich.console import Console

    from training.train import replacing

    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "policy.json").write_text("earlier")
    said = io.StringIO()
    with replacing(policy, Console(file=said)):
        assert not policy.exists()
        policy.mkdir()
        (policy / "policy.json").write_text("new")
    assert (policy / "policy.json").read_text() == "new" and not (tmp_path / "policy.earlier").exists()
    assert "replaced the earlier policy" in said.getvalue()
    (tmp_path / "policy.earlier").mkdir()  # a killed training: the earlier one set aside, a partial one written
    (tmp_path / "policy.earlier" / "policy.json").write_text("complete")
    (policy / "policy.json").write_text("partial")
    with pytest.raises(RuntimeError), replacing(policy, Console(file=io.StringIO())):
        assert not policy.exists()
        raise RuntimeError("fails too")
    assert (policy / "policy.json").read_text() == "complete" and not (tmp_path / "policy.earlier").exists()


@pytest.mark.vllm
def test_a_second_training_into_the_same_folder_is_refused(one_step_run: Path, tmp_path: Path) -> None:
    """A training holds its -o folder: a second one there would delete the first one's POLICY_DIR mid-run."""
    import fcntl

    from training.train import TrainError, train_and_register

    work = tmp_path / "work"
    work.mkdir()
    with open(work / ".kvpilot-train.lock", "w") as held:  # the first training, still running
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(TrainError, match="is in use by another `kvpilot train`"):
            train_and_register([one_step_run], work, progress=False)
