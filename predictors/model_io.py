"""Saving and loading predictor models: LightGBM boosters plus a JSON manifest checked on load.

A model directory holds ``manifest.json`` (kind, model format version, the feature
schema: names, categorical columns, feature-schema version, the telemetry
``data.schemas.SCHEMA_VERSION``, vocabularies and model parameters) and one text
file per booster. :func:`read_manifest` refuses a directory whose kind, format,
feature-schema version or feature names differ from the code's: a model saved
under another schema fails loudly instead of scoring garbage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightgbm as lgb

from data.schemas import SCHEMA_VERSION as DATA_SCHEMA_VERSION

#: Bumped whenever the meaning or order of a feature changes (features.py).
FEATURE_SCHEMA_VERSION = 1
#: Bumped whenever the on-disk layout changes.
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


#: Boosting rounds per model by default: 100 trees of 31 leaves keep batched scoring of the two
#: boosters of a model near 15 µs per candidate (compiled) while the quality has levelled off.
DEFAULT_TREES = 100

#: Below this many rows LightGBM trains on one thread: its OpenMP barriers cost more than they save on
#: small data, and on a shared 2-core machine two threads were measured up to 80x slower (spinning).
MULTITHREAD_MIN_ROWS = 200_000


def training_threads(rows: int, requested: int) -> int:
    return max(1, requested) if rows >= MULTITHREAD_MIN_ROWS else 1


class ModelSchemaError(ValueError):
    """A saved model does not match this code's feature schema (or is not a model of this kind)."""


def write_model(path: str | Path, kind: str, features: tuple[str, ...], categorical: tuple[str, ...],
                boosters: dict[str, lgb.Booster], extra: dict[str, Any]) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, booster in boosters.items():
        f = f"{kind}_{name}.txt"
        booster.save_model(str(path / f))
        files[name] = f
    manifest = {
        "kind": kind,
        "format_version": FORMAT_VERSION,
        "feature_schema_version": FEATURE_SCHEMA_VERSION,
        "data_schema_version": DATA_SCHEMA_VERSION,
        "features": list(features),
        "categorical": list(categorical),
        "boosters": files,
        **extra,
    }
    tmp = path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(path / MANIFEST)
    return path


def read_manifest(path: str | Path, kind: str, features: tuple[str, ...]) -> dict[str, Any]:
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        raise ModelSchemaError(f"{path}: no {MANIFEST}; not a kvpilot {kind} model directory")
    try:
        m = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ModelSchemaError(f"{file}: corrupt manifest ({err})") from None
    problems = []
    if m.get("kind") != kind:
        problems.append(f"kind {m.get('kind')!r}, expected {kind!r}")
    if m.get("format_version") != FORMAT_VERSION:
        problems.append(f"format version {m.get('format_version')}, expected {FORMAT_VERSION}")
    if m.get("feature_schema_version") != FEATURE_SCHEMA_VERSION:
        problems.append(f"feature schema version {m.get('feature_schema_version')}, this code has "
                        f"{FEATURE_SCHEMA_VERSION}")
    if m.get("data_schema_version") != DATA_SCHEMA_VERSION:
        problems.append(f"telemetry schema version {m.get('data_schema_version')}, this code has "
                        f"{DATA_SCHEMA_VERSION}")
    if tuple(m.get("features", ())) != tuple(features):
        problems.append(f"features {m.get('features')} differ from this code's {list(features)}")
    if problems:
        raise ModelSchemaError(f"{path}: model saved under another schema: " + "; ".join(problems))
    return m


def load_boosters(path: str | Path, manifest: dict[str, Any]) -> dict[str, lgb.Booster]:
    path = Path(path)
    out = {}
    for name, f in manifest["boosters"].items():
        file = path / f
        if not file.is_file():
            raise ModelSchemaError(f"{file}: booster file missing")
        out[name] = lgb.Booster(model_file=str(file))
    return out
