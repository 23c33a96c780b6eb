"""MLflow registry primitives on a real embedded SQLite store (training/registry.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training import registry as reg


def make_policy_dir(path: Path, *, schema_version: int | None = None, tag: str = "a") -> Path:
    """A POLICY_DIR-shaped folder (manifest, weights file, predictors/); the registry only carries files."""
    from data.schemas import SCHEMA_VERSION

    path.mkdir(parents=True)
    (path / "predictors").mkdir()
    (path / "predictors" / "length.txt").write_text(f"booster {tag}\n")
    (path / "policy.pt").write_bytes(b"weights " + tag.encode())
    manifest = {
        "format": "kvpilot-policy",
        "format_version": 1,
        "policy": "learned",
        "telemetry_schema_version": SCHEMA_VERSION if schema_version is None else schema_version,
        "feature_schema": {"admit": ["x"]},
        "config": {"tag": tag},
        "trained_on": {},
    }
    (path / "policy.json").write_text(json.dumps(manifest))
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """An embedded store in a fresh working directory (no MLFLOW_TRACKING_URI), shared by this module."""
    root = tmp_path_factory.mktemp("store")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", "unset")  # so that the teardown restores the original state
        mp.delenv("MLFLOW_TRACKING_URI")
        mp.chdir(root)
        uri = reg.configure("kvpilot-test")
        yield root, uri


def test_embedded_default_store_and_artifacts(store):
    import mlflow

    root, uri = store
    assert uri == f"sqlite:///{root.resolve() / 'mlruns.db'}"
    assert (root / "mlruns.db").is_file()
    exp = mlflow.get_experiment_by_name("kvpilot-test")
    assert exp.artifact_location == (root.resolve() / "mlartifacts" / "kvpilot-test").as_uri()


def test_tracking_uri_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert reg.tracking_uri(tmp_path) == "http://mlflow.example:5000"
    assert reg.artifact_root(tmp_path) is None
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert reg.tracking_uri(tmp_path) == f"sqlite:///{tmp_path.resolve() / 'mlruns.db'}"
    assert reg.artifact_root(tmp_path) == tmp_path.resolve() / "mlartifacts"


def test_versions_alias_and_policy_dir(store):
    import mlflow

    root, _ = store
    assert reg.get_champion() is None  # no registered model yet
    dirs = [make_policy_dir(root / f"P{i}", tag=str(i)) for i in (1, 2)]
    versions = []
    for d in dirs:
        with mlflow.start_run() as run:
            versions.append(reg.log_policy_model(d, run))
    assert [int(v.version) for v in versions] == [1, 2]
    assert versions[0].name == reg.MODEL_NAME
    assert versions[0].tags["telemetry_schema_version"] == str(json.loads((dirs[0] / "policy.json").read_text())[
        "telemetry_schema_version"])
    assert reg.get_champion() is None  # registering does not promote

    reg.set_champion(1)
    assert int(reg.get_champion().version) == 1
    local, mv = reg.fetch_policy_dir(reg.DEFAULT_MODEL_URI, root / "dl1")
    assert int(mv.version) == 1
    assert (local / "policy.pt").read_bytes() == b"weights 1"
    assert (local / "predictors" / "length.txt").read_text() == "booster 1\n"

    reg.set_champion(2)
    local, mv = reg.fetch_policy_dir(reg.DEFAULT_MODEL_URI, root / "dl2")
    assert int(mv.version) == 2 and (local / "policy.pt").read_bytes() == b"weights 2"
    fixed, _ = reg.fetch_policy_dir("models:/kvpilot/1", root / "dl3")
    assert (fixed / "policy.pt").read_bytes() == b"weights 1"

    # The contract's pyfunc path: load_model(uri).unwrap_python_model().policy_dir
    pdir = reg.load_pyfunc_policy_dir(reg.DEFAULT_MODEL_URI)
    assert json.loads((pdir / "policy.json").read_text())["config"] == {"tag": "2"}
    described = mlflow.pyfunc.load_model("models:/kvpilot/1").predict(None)
    assert described.loc[0, "policy"] == "learned"
    assert json.loads(described.loc[0, "feature_schema"]) == {"admit": ["x"]}


def test_errors_name_what_is_wrong(store):
    import mlflow

    root, _ = store
    with pytest.raises(reg.RegistryError, match="expected models:/NAME@ALIAS"):
        reg.resolve_version("runs:/abc/model")
    with pytest.raises(reg.RegistryError, match="nosuchmodel"):
        reg.fetch_policy_dir("models:/nosuchmodel@champion", root / "x")
    with pytest.raises(reg.RegistryError, match="nosuchalias"):
        reg.resolve_version("models:/kvpilot@nosuchalias")
    with pytest.raises(reg.RegistryError, match="version 99"):
        reg.set_champion(99)
    empty = root / "empty"
    empty.mkdir()
    with mlflow.start_run() as run:
        with pytest.raises(reg.RegistryError, match=r"empty/policy.json: missing"):
            reg.log_policy_model(empty, run)
    (empty / "policy.json").write_text('{"format": "other"}')
    with pytest.raises(reg.RegistryError, match="format is 'other'"):
        reg.read_manifest(empty)


def test_unreachable_store_is_a_registry_error(store, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead)
    mlflow.set_tracking_uri(dead)
    try:
        with pytest.raises(reg.RegistryUnreachable, match="127.0.0.1:9 is unreachable"):
            reg.resolve_version(reg.DEFAULT_MODEL_URI)
    finally:
        mlflow.set_tracking_uri(store[1])


def test_processes_that_create_one_store_at_once_all_open_it(tmp_path):
    """Three processes opening a new embedded store at once (trainings started together, a server polling the
    store a training creates): each creates or finds the schema and the experiment. Without the lock beside the
    file, MLflow's schema migrations of one broke another's ("Online migration expected to match one row")."""
    import os
    import subprocess
    import sys

    code = ("import sys; from serving_hook.model_registry import configure; configure('race'); "
            "import mlflow; assert mlflow.get_experiment_by_name('race') is not None; print('opened')")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    assert all(rc == 0 and out.strip() == "opened" for out, _, rc in results), [err[-500:] for _, err, _ in results]


def test_a_store_whose_lock_is_held_too_long_is_opened_without_it(tmp_path, monkeypatch, caplog):
    """A process that holds the lock beside an SQLite store and never lets go (stopped) does not block the others
    for ever: they open the store without it after ``LOCK_WAIT_S``, with a warning."""
    import fcntl
    import logging

    from serving_hook import model_registry as mr

    db = tmp_path / "held" / "mlruns.db"
    db.parent.mkdir()
    monkeypatch.setattr(mr, "LOCK_WAIT_S", 0.3)
    caplog.set_level(logging.WARNING, logger="kvpilot.registry")
    with open(f"{db}.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with mr._creation_lock(db):
            entered = True
    assert entered and any("held past" in r.getMessage() for r in caplog.records)
    # a URI with a driver or an escaped path names the file SQLAlchemy opens
    assert mr._sqlite_file("sqlite+pysqlite:///a%20b/x.db?mode=ro") == Path("a b/x.db")
    assert mr._sqlite_file("http://mlflow:5000") is None and mr._sqlite_file("sqlite:///:memory:") is None


def test_importing_the_registry_prints_nothing():
    """Every `kvpilot train` and `promote` imports the pyfunc class; MLflow used to log a note and warn about its
    ``predict`` type hints each time (three lines of noise before any output)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run([sys.executable, "-c", "import training.registry"], env=env, capture_output=True,
                         text=True, timeout=300)
    noise = [ln for ln in (res.stdout + res.stderr).splitlines() if "mlflow" in ln.lower() or "type hint" in ln]
    assert res.returncode == 0 and not noise, noise
