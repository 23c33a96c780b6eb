"""MLflow registry primitives: where the store is, the ``kvpilot`` pyfunc, versions and the ``champion`` alias.

One registered model, ``kvpilot``; each version is a pyfunc (:class:`KVPilotModel`) logged with
``artifacts={"policy_dir": POLICY_DIR}``, so one version is one consistent set of policy, predictors,
feature schema and telemetry schema version. The store is ``MLFLOW_TRACKING_URI`` when set, else an
embedded SQLite file ``<cwd>/mlruns.db`` with artifacts under ``<cwd>/mlartifacts`` (no server, no network).

The serving hook does not go through pyfunc: it resolves the alias to a version, downloads that version's
files (:func:`fetch_policy_dir`) and loads POLICY_DIR itself.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # mlflow takes seconds to import: only when used
    import pandas as pd
    from mlflow.entities import Run
    from mlflow.entities.model_registry import ModelVersion
    from mlflow.tracking import MlflowClient

MODEL_NAME = "kvpilot"
CHAMPION = "champion"
DEFAULT_MODEL_URI = f"models:/{MODEL_NAME}@{CHAMPION}"
POLICY_ARTIFACT = "policy_dir"
MANIFEST = "policy.json"
POLICY_FORMAT = "kvpilot-policy"
DB_FILE = "mlruns.db"
ARTIFACT_DIR = "mlartifacts"

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
    MLflow's own usage telemetry (its only network call) and its download progress bars are switched off
    unless set otherwise.
    """
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow

    uri = tracking_uri(cwd)
    mlflow.set_tracking_uri(uri)  # the registry follows it (unless MLFLOW_REGISTRY_URI says otherwise)
    if experiment:
        root = artifact_root(cwd)
        try:
            if mlflow.get_experiment_by_name(experiment) is None and root is not None:
                mlflow.create_experiment(experiment, artifact_location=(root / experiment).as_uri())
            mlflow.set_experiment(experiment)
        except Exception as e:
            raise RegistryError(f"cannot open experiment {experiment!r} in the MLflow store {uri}: {e}") from e
    return uri


def client() -> "MlflowClient":
    """An ``MlflowClient`` on the configured store (:func:`configure` first if nothing set it)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    if not mlflow.is_tracking_uri_set():
        configure()
    return MlflowClient()


def read_manifest(policy_dir: Path) -> dict[str, Any]:
    """POLICY_DIR's ``policy.json``; :class:`RegistryError` naming the file when it is missing or not a manifest."""
    path = Path(policy_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise RegistryError(f"{path}: missing (not a POLICY_DIR written by `kvpilot train policy`)") from None
    except (OSError, ValueError) as e:
        raise RegistryError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != POLICY_FORMAT:
        raise RegistryError(f"{path}: field 'format' must be {POLICY_FORMAT!r}")
    return manifest


try:
    from mlflow.pyfunc import PythonModel as _PythonModel
except ImportError:  # pragma: no cover - mlflow is a dependency
    _PythonModel = object  # type: ignore[assignment,misc]


class KVPilotModel(_PythonModel):  # type: ignore[misc,valid-type]
    """The ``kvpilot`` pyfunc: a carrier for one POLICY_DIR (artifact ``policy_dir``).

    ``predict`` does not score: the policy ranks candidates inside the scheduler, with the engine's live
    state, which a DataFrame cannot carry. It describes the bundle instead: one row with the POLICY_DIR
    path, the format and telemetry schema versions and the feature names per decision kind (JSON), so
    ``mlflow models predict`` and the UI show what a version holds. Load POLICY_DIR with
    ``policy.learned.LearnedPolicy.load(model.unwrap_python_model().policy_dir)``.
    """

    policy_dir: Optional[Path] = None

    def load_context(self, context: Any) -> None:
        self.policy_dir = Path(context.artifacts[POLICY_ARTIFACT])

    def predict(self, context: Any, model_input: Any, params: Optional[dict[str, Any]] = None) -> "pd.DataFrame":
        import pandas as pd

        if self.policy_dir is None:
            self.load_context(context)
        m = read_manifest(self.policy_dir)
        return pd.DataFrame(
            [
                {
                    "policy_dir": str(self.policy_dir),
                    "policy": m.get("policy"),
                    "format_version": m.get("format_version"),
                    "telemetry_schema_version": m.get("telemetry_schema_version"),
                    "feature_schema": json.dumps(m.get("feature_schema")),
                }
            ]
        )


def log_policy_model(
    policy_dir: Path, run: Optional["Run"] = None, *, name: str = MODEL_NAME, artifact_name: str = "policy"
) -> "ModelVersion":
    """Log POLICY_DIR as a :class:`KVPilotModel` pyfunc into ``run`` (else the active run) and register it.

    Returns the new version of the registered model ``name``; its tags record the manifest's
    telemetry schema version and format version.
    """
    import mlflow

    policy_dir = Path(policy_dir)
    manifest = read_manifest(policy_dir)
    active = mlflow.active_run()
    if run is not None and active is not None and active.info.run_id != run.info.run_id:
        raise RegistryError(f"run {run.info.run_id} is not the active run ({active.info.run_id})")
    if run is None and active is None:
        raise RegistryError("log_policy_model needs a run: pass one or call it inside mlflow.start_run()")
    ctx = mlflow.start_run(run_id=run.info.run_id) if active is None else _Nothing()
    with ctx:
        info = mlflow.pyfunc.log_model(
            name=artifact_name,
            python_model=KVPilotModel(),
            artifacts={POLICY_ARTIFACT: str(policy_dir)},
            pip_requirements=["kvpilot", "mlflow==3.17.2"],
        )
    try:
        mv = mlflow.register_model(
            info.model_uri,
            name,
            tags={
                "telemetry_schema_version": str(manifest.get("telemetry_schema_version")),
                "format_version": str(manifest.get("format_version")),
            },
        )
    except Exception as e:
        raise RegistryError(f"cannot register {info.model_uri} as {name!r}: {e}") from e
    return mv


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def get_champion(name: str = MODEL_NAME) -> Optional["ModelVersion"]:
    """The version the ``champion`` alias points at, or ``None`` (no such model or no alias yet)."""
    from mlflow.exceptions import MlflowException

    try:
        return client().get_model_version_by_alias(name, CHAMPION)
    except MlflowException as e:
        if e.error_code in _NOT_FOUND:
            return None
        raise RegistryError(f"cannot read alias {name}@{CHAMPION}: {e}") from e


def set_champion(version: int | str, name: str = MODEL_NAME) -> "ModelVersion":
    """Move the ``champion`` alias to ``version`` of ``name``; returns that version."""
    from mlflow.exceptions import MlflowException

    c = client()
    try:
        mv = c.get_model_version(name, str(version))
        c.set_registered_model_alias(name, CHAMPION, str(version))
    except MlflowException as e:
        raise RegistryError(f"cannot make {name} version {version} the {CHAMPION}: {e}") from e
    return mv


@dataclass(frozen=True)
class ModelRef:
    """A parsed ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` URI."""

    name: str
    alias: Optional[str] = None
    version: Optional[str] = None

    @classmethod
    def parse(cls, uri: str) -> "ModelRef":
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
        if e.error_code in _NOT_FOUND:
            raise RegistryError(f"{uri}: {e.message}") from None
        raise RegistryUnreachable(f"{uri}: the registry at {_uri_now()} is unreachable ({e.message})") from None
    except Exception as e:  # a missing driver, a locked or corrupt SQLite file
        raise RegistryUnreachable(
            f"{uri}: the registry at {_uri_now()} is unreachable ({type(e).__name__}: {e})"
        ) from None


_NOT_FOUND = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND")


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


def load_pyfunc_policy_dir(uri: str) -> Path:
    """POLICY_DIR through pyfunc (``mlflow.pyfunc.load_model(uri).unwrap_python_model().policy_dir``).

    Slower than :func:`fetch_policy_dir` (it imports the pyfunc machinery); for tools and tests.
    """
    import mlflow

    client()
    return Path(mlflow.pyfunc.load_model(uri).unwrap_python_model().policy_dir)
