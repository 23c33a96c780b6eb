"""POLICY_DIR, the learned policy's bundle: ``policy.json`` (manifest), ``policy.pt`` (the scorer's state_dict)
and ``predictors/`` (a ``kvpilot train predictors`` model directory); its writer and its readers.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import numpy as np

from policy.learned.features import FEATURES, RAW
from policy.learned.scorer import build_scorer
from policy.predictors import LENGTH_PREDICTOR, REUSE_PREDICTOR

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "PolicyLoadError",
    "manifest_for",
    "read_manifest",
    "read_state",
    "read_predictor",
    "read_reuse",
    "read_tier_reuse",
    "update_runtime",
    "TIER_REUSE_DIR",
    "write_bundle",
]

FORMAT = "kvpilot-policy"
FORMAT_VERSION = 1
#: Where POLICY_DIR/predictors keeps the trained CPU-tier next-use model (predictors.tier_reuse), when it has one.
TIER_REUSE_DIR = "tier_reuse"


class PolicyLoadError(ValueError):
    """A POLICY_DIR that cannot be used: missing or corrupt file, or a schema / version mismatch."""


def write_bundle(policy_dir: str | Path, scorer_state: Mapping[str, Any], predictors_dir: Optional[Path],
                 config: Mapping[str, Any], trained_on: Mapping[str, Any]) -> Path:
    """Write POLICY_DIR: ``policy.json``, ``policy.pt`` and ``predictors/`` (copied from ``predictors_dir``).

    Over an existing POLICY_DIR the old manifest goes first and the new one is written last, so a write cut short
    leaves a folder that refuses to load, never the old manifest over new weights."""
    import torch

    out = Path(policy_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / "policy.json"
    manifest.unlink(missing_ok=True)
    torch.save({k: torch.as_tensor(np.asarray(v)) if not hasattr(v, "detach") else v
                for k, v in scorer_state.items()}, out / "policy.pt")
    pred_out = out / "predictors"
    if predictors_dir is not None and predictors_dir.resolve() != pred_out.resolve():
        if pred_out.exists():
            shutil.rmtree(pred_out)
        shutil.copytree(predictors_dir, pred_out)
    m = manifest_for(config, trained_on)
    tmp = out / ".policy.json.partial"
    tmp.write_text(json.dumps(m, indent=2, default=float))
    os.replace(tmp, manifest)
    return out


def manifest_for(config: Mapping[str, Any], trained_on: Mapping[str, Any]) -> dict[str, Any]:
    """The ``policy.json`` manifest (the contract's keys)."""
    from data.schemas import SCHEMA_VERSION

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "policy": "learned",
        "telemetry_schema_version": SCHEMA_VERSION,
        "feature_schema": {"features": list(FEATURES), "raw": list(RAW), "heads": ["admit", "preempt"]},
        "config": dict(config),
        "trained_on": dict(trained_on),
    }


def read_manifest(policy_dir: Path, *, check_schema: bool = True) -> dict[str, Any]:
    """POLICY_DIR's ``policy.json``: the one reader of policy manifests (training, the registry, the hook).

    :class:`PolicyLoadError` naming the file when it is missing, not JSON or not a kvpilot policy manifest;
    with ``check_schema`` also when its format or telemetry schema version or its features are not this
    build's (without: a bundle another build wrote can still be registered and described).
    """
    from data.schemas import SCHEMA_VERSION

    f = Path(policy_dir) / "policy.json"
    if not f.is_file():
        raise PolicyLoadError(f"{f}: missing (not a POLICY_DIR written by `kvpilot train policy`)")
    try:
        m = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise PolicyLoadError(f"{f}: corrupt manifest: {e}") from e
    if not isinstance(m, dict):
        raise PolicyLoadError(f"{f}: corrupt manifest: not a JSON object")
    expect = {"format": FORMAT, "format_version": FORMAT_VERSION, "policy": "learned",
              "telemetry_schema_version": SCHEMA_VERSION} if check_schema else {"format": FORMAT}
    for key, want in expect.items():
        if m.get(key) != want:
            raise PolicyLoadError(f"{f}: {key} is {m.get(key)!r}, this kvpilot reads {want!r}")
    feats = (m.get("feature_schema") or {}).get("features")
    if check_schema and feats != list(FEATURES):
        raise PolicyLoadError(f"{f}: feature_schema.features {feats!r} differ from this kvpilot's {list(FEATURES)!r}")
    return m


def read_state(f: Path) -> dict[str, Any]:
    """A ``policy.pt``'s scorer state_dict, checked against the scorer, as numpy arrays."""
    if not f.is_file():
        raise PolicyLoadError(f"{f}: missing")
    import torch

    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is a corrupt file
        raise PolicyLoadError(f"{f}: corrupt scorer state_dict: {e}") from e
    if not isinstance(state, dict):
        raise PolicyLoadError(f"{f}: corrupt scorer state_dict: not a dict")
    try:
        scorer = build_scorer(len(FEATURES), _hidden_of(state))
        scorer.load_state_dict(state)
    except Exception as e:  # noqa: BLE001
        raise PolicyLoadError(f"{f}: scorer state_dict does not match the scorer: {e}") from e
    return {k: v.detach().cpu().numpy() for k, v in scorer.state_dict().items()}


def _hidden_of(state: Mapping[str, Any]) -> list[int]:
    idx = sorted({int(k.split(".")[1]) for k in state if k.startswith("net.") and k.endswith(".weight")})
    return [int(state[f"net.{i}.weight"].shape[0]) for i in idx[:-1]]


def read_predictor(d: Path) -> Any:
    """The length predictor of a ``kvpilot train predictors`` MODEL_DIR (a POLICY_DIR's ``predictors/``)."""
    f = d / LENGTH_PREDICTOR.model
    if not f.is_dir():
        raise PolicyLoadError(f"{f}: missing (POLICY_DIR/predictors must hold a `kvpilot train predictors` model)")
    try:
        return LENGTH_PREDICTOR.load(f)
    except Exception as e:  # noqa: BLE001 - ModelSchemaError, corrupt model files
        raise PolicyLoadError(f"{f}: cannot load the length predictor: {e}") from e


def read_reuse(d: Path) -> Any:
    """The reuse predictor of a POLICY_DIR's predictors (None when it was trained without one)."""
    f = d / REUSE_PREDICTOR.model
    if not f.is_dir():
        return None
    try:
        return REUSE_PREDICTOR.load(f)
    except Exception as e:  # noqa: BLE001 - ModelSchemaError, corrupt model files
        raise PolicyLoadError(f"{f}: cannot load the reuse predictor: {e}") from e


def read_tier_reuse(d: Path) -> Any:
    """The trained CPU-tier next-use model of a POLICY_DIR's predictors (``reuse_predictor="session-trained"``)."""
    from predictors.tier_reuse import TierReuseModel

    f = d / TIER_REUSE_DIR
    if not f.is_dir():
        raise PolicyLoadError(f"{f}: missing: reuse_predictor \"session-trained\" needs the tier model `kvpilot train` "
                              "fits (or set reuse_predictor to \"session-state\")")
    try:
        return TierReuseModel.load(f)
    except Exception as e:  # noqa: BLE001 - ModelSchemaError, corrupt model files
        raise PolicyLoadError(f"{f}: cannot load the tier model: {e}") from e


def update_runtime(policy_dir: Path, options: Mapping[str, Any]) -> dict[str, Any]:
    """Set runtime ``options`` in POLICY_DIR's ``policy.json`` (what training learned after the bundle was
    written); the runtime options now in it."""
    policy_dir = Path(policy_dir)
    manifest = read_manifest(policy_dir)
    runtime = manifest.setdefault("config", {}).setdefault("runtime", {})
    runtime.update(options)
    (policy_dir / "policy.json").write_text(json.dumps(manifest, indent=2))
    return runtime
