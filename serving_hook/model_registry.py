"""The MLflow model registry's read side, as the serving hook needs it: where the store is, versions, downloads.

One registered model, ``kvpilot``; each version is a pyfunc logged with ``artifacts={"policy_dir":
POLICY_DIR}`` (written by :mod:`training.registry`, the write side). The store is ``MLFLOW_TRACKING_URI``
when set, else an embedded SQLite file ``<cwd>/mlruns.db`` with artifacts under ``<cwd>/mlartifacts`` (no
server, no network). The hook does not go through pyfunc: it resolves a URI to a version
(:func:`resolve_version`), downloads that version's files (:func:`fetch_policy_dir`) and loads POLICY_DIR
itself (:mod:`serving_hook.model_source`). MLflow is imported only when a function needs it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional
from urllib.parse import unquote

if TYPE_CHECKING:  # mlflow takes seconds to import: only when used
    from mlflow.entities.model_registry import ModelVersion
    from mlflow.tracking import MlflowClient

MODEL_NAME = "kvpilot"
CHAMPION = "champion"
DEFAULT_MODEL_URI = f"models:/{MODEL_NAME}@{CHAMPION}"
POLICY_ARTIFACT = "policy_dir"
DB_FILE = "mlruns.db"
ARTIFACT_DIR = "mlartifacts"

logger = logging.getLogger("kvpilot.registry")
_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")


class RegistryError(RuntimeError):
    """A registry operation failed: no such model, version or alias, a bad bundle, or an unreachable store."""


class RegistryUnreachable(RegistryError):
    """The tracking/registry store could not be reached or read (a dead server, an unreadable SQLite file)."""


def _embedded_uri(cwd: Optional[Path]) -> str:
    return f"sqlite:///{(Path(cwd) if cwd else Path.cwd()).resolve() / DB_FILE}"


def tracking_uri(cwd: Optional[Path] = None) -> str:
    """``MLFLOW_TRACKING_URI`` when set, else the embedded ``sqlite:///<cwd>/mlruns.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI", "").strip() or _embedded_uri(cwd)


def artifact_root(cwd: Optional[Path] = None) -> Optional[Path]:
    """Where the embedded store keeps artifacts (``<cwd>/mlartifacts``); ``None`` for any other store.

    (``mlflow.set_tracking_uri`` exports ``MLFLOW_TRACKING_URI``, so the test is on the URI, not the variable.)
    """
    if tracking_uri(cwd) != _embedded_uri(cwd):
        return None
    return (Path(cwd) if cwd else Path.cwd()).resolve() / ARTIFACT_DIR


def configure(experiment: Optional[str] = None, cwd: Optional[Path] = None) -> str:
    """Point MLflow at :func:`tracking_uri` (and make ``experiment`` the active one); returns the URI.

    In the embedded store a new experiment keeps its artifacts under ``<cwd>/mlartifacts/<experiment>``.
    :data:`MLFLOW_DEFAULTS` apply unless set otherwise.
    """
    _mlflow_defaults()
    import mlflow

    uri = tracking_uri(cwd)
    mlflow.set_tracking_uri(uri)  # the registry follows it (unless MLFLOW_REGISTRY_URI says otherwise)
    _open_store(uri)
    if experiment:
        root = artifact_root(cwd)
        with _creation_lock(_sqlite_file(uri)):  # (two processes creating one experiment broke each other too)
            try:
                if mlflow.get_experiment_by_name(experiment) is None and root is not None:
                    mlflow.create_experiment(experiment, artifact_location=(root / experiment).as_uri())
                mlflow.set_experiment(experiment)
            except Exception as e:
                raise RegistryError(f"cannot open experiment {experiment!r} in the MLflow store {uri}: {e}") from e
    return uri


#: The SQLite stores this process has opened (:func:`_open_store`).
_OPENED: set[str] = set()
#: How long a process waits for another to finish opening an SQLite store before it goes on without the lock.
LOCK_WAIT_S = 60.0
_SQLITE = re.compile(r"^sqlite(\+\w+)?:///")


def _open_store(uri: str) -> None:
    """Open an SQLite store's tracking and registry tables once per process, under :func:`_creation_lock`: MLflow
    creates the schema at a store's first opening, by migrations, and two processes that opened a new store at
    once (two trainings, a server polling the store a training creates) broke each other's ("Online migration
    expected to match one row"). Nothing for other stores."""
    db = _sqlite_file(uri)
    if db is None or uri in _OPENED:
        return
    import mlflow
    from mlflow.tracking import MlflowClient

    with _creation_lock(db):
        try:
            mlflow.search_experiments(max_results=1)
            MlflowClient().search_registered_models(max_results=1)
        except Exception as e:
            raise RegistryUnreachable(f"cannot open the MLflow store {uri}: {e}") from e
    _OPENED.add(uri)


def _sqlite_file(uri: str) -> Optional[Path]:
    """The file of an SQLite store URI (``sqlite:///path``, ``sqlite+DRIVER:///path``), else None (a server, an
    in-memory database)."""
    m = _SQLITE.match(uri)
    if m is None:
        return None
    path = unquote(uri[m.end():].split("?", 1)[0])
    return Path(path) if path and path != ":memory:" else None


@contextmanager
def _creation_lock(db: Optional[Path]) -> Iterator[None]:
    """An exclusive lock on ``<db>.lock`` beside an SQLite store's file while the caller opens or changes it;
    nothing for other stores, nor where the lock file cannot be written (a read-only place, where no store can be
    created either). A holder that keeps it past :data:`LOCK_WAIT_S` (a stopped process) is not waited for."""
    f = None
    if db is not None:
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
            f = open(f"{db}.lock", "a")
        except OSError:
            f = None
    if f is None:
        yield
        return
    with f:
        locked = False
        deadline = time.monotonic() + LOCK_WAIT_S
        while not locked:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning("kvpilot: %s.lock is held past %.0f s; opening the store without it", db,
                                   LOCK_WAIT_S)
                    break
                time.sleep(0.05)
        try:
            yield
        finally:
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)


#: MLflow's settings that kvpilot sets unless the environment does: no usage telemetry (MLflow's only network
#: call of its own), no download progress bars, and a store server that does not answer fails in about ten
#: seconds, not four minutes (MLflow's own 7 retries with a backoff factor of 2).
MLFLOW_DEFAULTS = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}


def _mlflow_defaults() -> None:
    for k, v in MLFLOW_DEFAULTS.items():
        os.environ.setdefault(k, v)


def client() -> "MlflowClient":
    """An ``MlflowClient`` on the configured store (:func:`configure` first if nothing set it)."""
    _mlflow_defaults()
    import mlflow
    from mlflow.tracking import MlflowClient

    if not mlflow.is_tracking_uri_set():
        configure()
    else:
        _open_store(mlflow.get_tracking_uri())
    return MlflowClient()


@dataclass(frozen=True)
class ModelRef:
    """A parsed ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` URI."""

    name: str
    alias: Optional[str] = None
    version: Optional[str] = None

    @classmethod
    def parse(cls, uri: str) -> "ModelRef":
        if not isinstance(uri, str):
            raise RegistryError(f"model URI {uri!r}: expected a string, models:/NAME@ALIAS or models:/NAME/VERSION")
        m = _URI.match(uri.strip())
        if m is None:
            raise RegistryError(f"model URI {uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
        return cls(m["name"], m["alias"], m["version"])


def resolve_version(uri: str) -> "ModelVersion":
    """The registered version ``uri`` names now (an alias is read from the registry)."""
    from mlflow.exceptions import MlflowException

    ref = ModelRef.parse(uri)
    try:
        c = client()
        if ref.alias is not None:
            return c.get_model_version_by_alias(ref.name, ref.alias)
        return c.get_model_version(ref.name, ref.version)
    except MlflowException as e:
        if is_not_found(e):
            raise RegistryError(f"{uri}: {e.message}") from None
        raise RegistryUnreachable(f"{uri}: the registry at {_uri_now()} is unreachable ({e.message})") from None
    except Exception as e:  # a missing driver, a locked or corrupt SQLite file
        raise RegistryUnreachable(
            f"{uri}: the registry at {_uri_now()} is unreachable ({type(e).__name__}: {e})"
        ) from None


_NOT_FOUND = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND")


def is_not_found(error: Exception) -> bool:
    """Whether an ``MlflowException`` says that the model, version or alias does not exist."""
    return getattr(error, "error_code", None) in _NOT_FOUND


def _uri_now() -> str:
    import mlflow

    return mlflow.get_tracking_uri()


def fetch_policy_dir(uri: str, dst: Optional[Path] = None) -> tuple[Path, "ModelVersion"]:
    """Resolve ``uri`` to a version and download its POLICY_DIR; returns ``(local POLICY_DIR, version)``.

    The alias is resolved first and the fixed version downloaded, so a promotion in between cannot mix two
    versions. ``dst``: where to download (a new temporary folder by default).
    """
    import mlflow

    mv = resolve_version(uri)
    ref = ModelRef.parse(uri)
    dst = Path(dst) if dst is not None else Path(tempfile.mkdtemp(prefix="kvpilot-model-"))
    fixed = f"models:/{ref.name}/{mv.version}"
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=fixed, dst_path=str(dst)))
    except Exception as e:
        raise RegistryError(f"{fixed}: cannot download its files ({type(e).__name__}: {e})") from e
    return _policy_dir_in(local, fixed), mv


def _policy_dir_in(model_dir: Path, uri: str) -> Path:
    """The POLICY_DIR inside a downloaded pyfunc model folder (its MLmodel names the artifact's path)."""
    import yaml

    mlmodel = model_dir / "MLmodel"
    try:
        spec = yaml.safe_load(mlmodel.read_text())
        rel = spec["flavors"]["python_function"]["artifacts"][POLICY_ARTIFACT]["path"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise RegistryError(f"{uri}: {mlmodel} does not name a {POLICY_ARTIFACT!r} artifact ({e})") from None
    path = model_dir / rel
    if not path.is_dir():
        raise RegistryError(f"{uri}: its {POLICY_ARTIFACT!r} artifact {path} is missing")
    return path
