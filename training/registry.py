"""The MLflow model registry's write side: the ``kvpilot`` pyfunc, registering versions, the ``champion`` alias.

Each version is a pyfunc (:class:`KVPilotModel`) logged with ``artifacts={"policy_dir": POLICY_DIR}``, so
one version is one consistent set of policy, predictors, feature schema and telemetry schema version. Where
the store is, URIs, versions and downloads are the read side, :mod:`serving_hook.model_registry`, which the
serving hook uses too; its names are re-exported here for the training commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import pandas as pd  # (mlflow.pyfunc, imported below, imports it anyway)

from serving_hook.model_registry import (
    ARTIFACT_DIR,
    CHAMPION,
    DB_FILE,
    DEFAULT_MODEL_URI,
    MODEL_NAME,
    POLICY_ARTIFACT,
    ModelRef,
    RegistryError,
    RegistryUnreachable,
    artifact_root,
    client,
    configure,
    fetch_policy_dir,
    is_not_found,
    resolve_version,
    tracking_uri,
)

if TYPE_CHECKING:  # mlflow takes seconds to import: only when used
    from mlflow.entities import Run
    from mlflow.entities.model_registry import ModelVersion

__all__ = [
    "ARTIFACT_DIR", "CHAMPION", "DB_FILE", "DEFAULT_MODEL_URI", "MODEL_NAME", "POLICY_ARTIFACT", "KVPilotModel",
    "ModelRef", "RegistryError", "RegistryUnreachable", "artifact_root", "client", "configure", "fetch_policy_dir",
    "get_champion", "load_pyfunc_policy_dir", "log_policy_model", "read_manifest", "resolve_version",
    "set_champion", "tracking_uri",
]


def read_manifest(policy_dir: Path) -> dict[str, Any]:
    """POLICY_DIR's ``policy.json`` (:func:`policy.learned.bundle.read_manifest`, its format only: a version written by
    another build can be registered and described); :class:`RegistryError` naming the file otherwise."""
    from policy.learned.bundle import PolicyLoadError
    from policy.learned.bundle import read_manifest as read_policy_manifest

    try:
        return read_policy_manifest(Path(policy_dir), check_schema=False)
    except PolicyLoadError as e:
        raise RegistryError(str(e)) from None


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
    ``policy.learned.policy.LearnedPolicy.load(model.unwrap_python_model().policy_dir)``.
    """

    policy_dir: Optional[Path] = None

    def load_context(self, context: Any) -> None:
        self.policy_dir = Path(context.artifacts[POLICY_ARTIFACT])

    def predict(self, context: Any, model_input: pd.DataFrame,
                params: Optional[dict[str, Any]] = None) -> pd.DataFrame:
        # (a hint MLflow resolves to a DataFrame infers no schema, silently: any other type logged a note and a
        # warning at every import of this module, in every train and promote)
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
        if is_not_found(e):
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


def load_pyfunc_policy_dir(uri: str) -> Path:
    """POLICY_DIR through pyfunc (``mlflow.pyfunc.load_model(uri).unwrap_python_model().policy_dir``).

    Slower than :func:`fetch_policy_dir` (it imports the pyfunc machinery); for tools and tests.
    """
    import mlflow

    client()
    return Path(mlflow.pyfunc.load_model(uri).unwrap_python_model().policy_dir)
