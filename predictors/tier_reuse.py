"""LightGBM model of when a CPU-tier owner's blocks are next used, from its session's state (LRB-style).

The learned policy's CPU tier keeps what returns soonest (Belady on predictions). The rule that orders it,
:class:`policy.session_reuse.SessionStateNextUse`, reads each owner's session state: a queued turn's place in the
queue over the admission rate, a paused tool's expected return. This model takes that rule's estimate as one
input, beside the state it reads, and predicts the realised next use: trained on replays of the logged
workloads (:mod:`training.tier_training`), where each snapshot of the tier's owners is labelled with the time
its session was next scheduled.

Times are in admissions, not seconds (seconds times the engine's admission rate over its last admissions), so one
model serves engines of other speeds: the label is ``log1p`` of the admissions until the next use, and so are the
time features. :data:`FEATURES` names the columns; :func:`policy.session_reuse.tier_features` builds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np

from predictors.compiled import CompiledScoring
from predictors.model_io import load_boosters, read_manifest, training_threads, write_model

KIND = "tier_reuse"
#: The model's inputs, in order (times in admissions: seconds times the admission rate; ``log1p`` throughout).
FEATURES: tuple[str, ...] = (
    "state",  # 0 its next turn is queued, 1 paused on a tool, 2 running a turn that calls a tool
    "log_rule_adm",  # the session-state rule's estimate of the time to the next use
    "log_queue_position",  # queued: its place in the served order (NaN otherwise)
    "log_latency_adm",  # the expected latency of its tool (NaN without one)
    "log_paused_adm",  # paused: how long it has been paused (NaN otherwise)
    "log_idle_adm",  # since its blocks were last stored or reused
    "log_tier_blocks",  # its blocks in the tier
    "log_owners",  # owners listed in this decision
    "waiting_share",  # the share of them whose next turn is queued
    "turn",  # its session's turn
)
CATEGORICAL: tuple[str, ...] = ("state",)
#: LightGBM's parameters (regression of the label's log1p, squared error).
LEARNING_RATE = 0.05
PARAMS: dict[str, Any] = {"objective": "regression", "learning_rate": LEARNING_RATE, "num_leaves": 31,
                          "min_data_in_leaf": 50, "feature_fraction": 1.0, "verbose": -1, "seed": 0}
DEFAULT_TREES = 200


class TierReuseModel(CompiledScoring):
    """``predict(X)``: log1p of the admissions until each owner's next use (X: rows of :data:`FEATURES`)."""

    SCORED_BOOSTERS = ("next_use",)

    def __init__(self, booster: lgb.Booster, info: dict | None = None) -> None:
        self.boosters = {"next_use": booster}
        self.info = dict(info or {})
        self._compiled = None

    @classmethod
    def fit(cls, X: np.ndarray, y_adm: np.ndarray, *, num_trees: int = DEFAULT_TREES, params: dict | None = None,
            num_threads: int = 2) -> TierReuseModel:
        """Fit on snapshots ``X`` (rows of :data:`FEATURES`) and ``y_adm``, the admissions until each next use."""
        X = np.asarray(X, dtype=np.float64)
        y = np.asarray(y_adm, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != len(FEATURES):
            raise ValueError(f"tier snapshots need {len(FEATURES)} columns ({', '.join(FEATURES)}), got shape "
                             f"{X.shape}")
        if len(X) != len(y) or not len(X):
            raise ValueError(f"no tier snapshots to fit (rows {len(X)}, labels {len(y)})")
        if not np.isfinite(y).all() or (y < 0).any():
            raise ValueError("tier snapshot labels must be finite admissions >= 0")
        p = {**PARAMS, **(params or {}), "num_threads": training_threads(len(X), num_threads)}
        data = lgb.Dataset(X, label=np.log1p(y), feature_name=list(FEATURES), categorical_feature=list(CATEGORICAL))
        booster = lgb.train(p, data, num_trees)
        return cls(booster, {"num_trees": num_trees, "params": p, "train_rows": len(X)})

    def predict(self, X: np.ndarray) -> np.ndarray:
        """log1p of the predicted admissions until the next use, one per row."""
        if self._compiled is not None:
            return self._compiled.predict_raw(X)[:, 0]
        return self.boosters["next_use"].predict(np.asarray(X, dtype=np.float64), num_threads=1)

    def save(self, path: str | Path) -> Path:
        return write_model(path, KIND, FEATURES, CATEGORICAL, self.boosters, {"info": self.info})

    @classmethod
    def load(cls, path: str | Path, compiled: bool = True) -> TierReuseModel:
        """Load and check the schema; ``compiled`` walks the trees in a jitted loop (no per-call overhead)."""
        m = read_manifest(path, KIND, FEATURES)
        model = cls(load_boosters(path, m)["next_use"], m.get("info"))
        if compiled:
            model.compile()
        return model
