"""LightGBM reuse model of a cached prefix: P(next use within H) and time to next use; the online ReusePredictor.

See :mod:`predictors.features` for the cached-prefix unit, the sharing key and the
label. ``ReuseModel.fit(logs, horizon_s=H)`` trains a binary classifier (label
``hit``: next use within ``H`` seconds) and a regressor of ``log1p`` of the time
to next use (censored at :data:`CENSOR_S`). ``predict(X)`` returns (probability,
seconds to next use). As :class:`policy.predictors.ReusePredictor`,
``next_use_s(prefixes, now)`` builds the same features from
:class:`data.records.CachedPrefix` objects and the state kept from
:meth:`observe` events, and answers ``now + predicted time to next use`` (``inf``
when the prediction reaches the censoring cap).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import pandas as pd

from data.records import CachedPrefix, Event, EventKind, OwnerState
from predictors.compiled import CompiledScoring
from predictors.features import (
    EDC_HALF_LIVES_S,
    FINISH_CODES,
    REUSE_CATEGORICAL,
    REUSE_FEATURES,
    REUSE_OFFSETS_S,
    Vocab,
    feature_matrix,
    reuse_rows,
)
from predictors.model_io import DEFAULT_TREES, load_boosters, read_manifest, training_threads, write_model

KIND = "reuse"
CENSOR_S = 3600.0
DEFAULT_PARAMS: dict[str, Any] = {
    "learning_rate": 0.08, "num_leaves": 31, "min_data_in_leaf": 20, "feature_fraction": 0.9,
    "bagging_fraction": 0.8, "bagging_freq": 1, "lambda_l2": 1.0, "max_bin": 127, "verbose": -1, "seed": 0,
}
_RATES = np.log(2) / np.asarray(EDC_HALF_LIVES_S)
#: the first of the EDC columns in :data:`REUSE_FEATURES` (one per half-life, in order)
_EDC_COL = REUSE_FEATURES.index(f"edc_{EDC_HALF_LIVES_S[0]:g}")


class _KeyState:
    __slots__ = ("arrived", "edc", "last", "scheduled", "uses")

    def __init__(self) -> None:
        self.uses: list[float] = []  # last few use times
        self.edc = np.zeros(len(_RATES))
        self.last = -math.inf
        self.arrived = 0
        self.scheduled = 0


class ReuseModel(CompiledScoring):
    """P(hit within horizon) and time-to-next-hit model; also a :class:`policy.predictors.ReusePredictor`."""

    features = REUSE_FEATURES

    SCORED_BOOSTERS = ("hit", "tnext")

    def __init__(self, boosters: dict[str, lgb.Booster], vocab: Vocab, horizon_s: float,
                 info: dict | None = None, num_threads: int = 1) -> None:
        self.boosters = boosters
        self.vocab = vocab
        self.horizon_s = float(horizon_s)
        self.info = dict(info or {})
        self.num_threads = num_threads
        self._compiled = None
        self.reset_state()

    @classmethod
    def fit(cls, logs: pd.DataFrame, *, horizon_s: float = 10.0, num_trees: int = DEFAULT_TREES,
            params: dict | None = None, num_threads: int = 2,
            offsets: Sequence[float] = REUSE_OFFSETS_S) -> ReuseModel:
        vocab = Vocab.fit(logs, REUSE_CATEGORICAL)
        return cls.fit_rows(reuse_rows(logs, offsets, horizon_s, vocab), vocab, horizon_s=horizon_s,
                            num_trees=num_trees, params=params, num_threads=num_threads)

    @classmethod
    def fit_rows(cls, R: pd.DataFrame, vocab: Vocab, *, horizon_s: float, num_trees: int = DEFAULT_TREES,
                 params: dict | None = None, num_threads: int = 2) -> ReuseModel:
        if len(R) == 0:
            raise ValueError("no cached-prefix snapshots to train the reuse model on")
        p = {**DEFAULT_PARAMS, **(params or {}), "num_threads": training_threads(len(R), num_threads)}
        X = R[list(REUSE_FEATURES)].to_numpy(np.float32)
        kw = dict(feature_name=list(REUSE_FEATURES), categorical_feature=list(REUSE_CATEGORICAL))
        clf = lgb.train({**p, "objective": "binary"}, lgb.Dataset(X, label=R["hit"].to_numpy(float), **kw),
                        num_trees)
        ty = np.log1p(np.minimum(R["tnext"].to_numpy(float), CENSOR_S))
        reg = lgb.train({**p, "objective": "regression"}, lgb.Dataset(X, label=ty, **kw), num_trees)
        info = {"num_trees": num_trees, "params": p, "train_rows": len(R), "censor_s": CENSOR_S}
        return cls({"hit": clf, "tnext": reg}, vocab, horizon_s, info)

    # ------------------------------------------------------------------ scoring
    def predict_features(self, X) -> np.ndarray:
        """(n, 2) array: P(next use within the horizon), predicted seconds to the next use."""
        X = feature_matrix(X, REUSE_FEATURES)
        out = np.empty((len(X), 2))
        if len(X) and self._compiled is not None:
            raw = self._compiled.predict_raw(X)
            out[:, 0] = 1.0 / (1.0 + np.exp(-raw[:, 0]))
            out[:, 1] = np.expm1(raw[:, 1])
        elif len(X):
            out[:, 0] = self.boosters["hit"].predict(X, num_threads=self.num_threads)
            out[:, 1] = np.expm1(self.boosters["tnext"].predict(X, num_threads=self.num_threads))
        return out

    def predict(self, X) -> np.ndarray:
        return self.predict_features(X)

    # ------------------------------------------------------------------ online (ReusePredictor)
    def reset_state(self) -> None:
        self._keys: dict[str, _KeyState] = defaultdict(_KeyState)
        self._scheduled: set[str] = set()
        self._started: dict[str, int] = defaultdict(int)  # group -> sessions started
        self._ended: dict[str, int] = defaultdict(int)  # group -> sessions ended
        self._turns_arrived: dict[str, int] = defaultdict(int)  # session -> turns arrived
        self._finished: dict[str, tuple[float, str, int]] = {}  # request -> (finish time, reason, prompt tokens)
        self._last_tool: dict[str, str] = {}

    @staticmethod
    def _key(meta, request_id: str) -> str:
        return meta.group_id if meta.group_id is not None else f"req:{request_id}"

    def observe(self, event: Event) -> None:
        m, k = event.meta, event.kind
        key = self._key(m, event.request_id)
        if k is EventKind.ARRIVED:
            self._keys[key].arrived += 1
            if m.session_id is not None:
                self._turns_arrived[m.session_id] += 1
            if (m.turn or 0) == 0 and m.group_id is not None and m.domain != "reward":
                self._started[m.group_id] += 1
        elif k is EventKind.SCHEDULED:
            if event.request_id in self._scheduled:
                return
            self._scheduled.add(event.request_id)
            st = self._keys[key]
            st.scheduled += 1
            t = event.time_s
            st.edc = 1.0 + st.edc * np.exp(-_RATES * max(t - st.last, 0.0)) if st.uses else np.ones(len(_RATES))
            st.last = t
            st.uses.append(t)
            if len(st.uses) > 4:
                del st.uses[0]
        elif k is EventKind.TOOL_CALL_STARTED:
            if m.tool is not None:
                self._last_tool[event.request_id] = m.tool
        elif k is EventKind.FINISHED:
            self._scheduled.discard(event.request_id)
            self._finished[event.request_id] = (event.time_s, event.finish_reason or "stop", event.num_prompt_tokens)
            if (m.group_id is not None and m.domain != "reward" and event.finish_reason != "tool_call"):
                self._ended[m.group_id] += 1

    def prefix_features(self, prefixes: Sequence[CachedPrefix], now_s: float) -> np.ndarray:
        """(n, features) at ``now_s``: one row per prefix, its decayed-use counts (EDC) computed for all at once."""
        nan = math.nan
        n_rates = len(_RATES)
        rows, edc, edc_age, edc_rows = [], [], [], []
        keys, finished, turns, last_tool = self._keys, self._finished, self._turns_arrived, self._last_tool
        started, ended, v = self._started, self._ended, self.vocab
        blank = [0.0] * n_rates
        for i, p in enumerate(prefixes):
            m = p.meta
            fin = finished.get(p.owner_request_id)
            finish_s, reason, prompt_tokens = fin if fin is not None else (p.last_used_s, None, nan)
            if reason is None:
                reason = "tool_call" if p.owner_state is OwnerState.PAUSED_TOOL else "stop"
            st = keys.get(self._key(m, p.owner_request_id))
            hits = st.scheduled if st is not None else 0
            last = st.last if st is not None and st.uses else -math.inf
            gaps = [nan, nan, nan]
            if st is not None and st.uses:
                prev = now_s
                for j, u in enumerate(reversed(st.uses[-3:])):
                    gaps[j] = prev - u
                    prev = u
                edc.append(st.edc)
                edc_age.append(now_s - last)
                edc_rows.append(i)
            paused = 0.0
            if reason == "tool_call" and m.session_id is not None:
                paused = 1.0 if turns.get(m.session_id, 0) <= (m.turn or 0) + 1 else 0.0
            g = m.group_id
            grp_pending = float(started.get(g, 0) - ended.get(g, 0)) if g is not None else 0.0
            rows.append([
                v.code("domain", m.domain), float(FINISH_CODES.get(reason, nan)),
                v.code("tool", last_tool.get(p.owner_request_id, m.tool)),
                float(len(p.block_hashes)), float(prompt_tokens), float(m.turn or 0), now_s - finish_s,
                float(hits), now_s - max(last, finish_s), *gaps, *blank,
                float(st.arrived - st.scheduled) if st is not None else 0.0, grp_pending, paused,
            ])
        X = np.asarray(rows, dtype=np.float64)
        if edc_rows:
            X[edc_rows, _EDC_COL:_EDC_COL + n_rates] = np.asarray(edc) * np.exp(-_RATES * np.asarray(edc_age)[:, None])
        return X

    def score_prefixes(self, prefixes: Sequence[CachedPrefix], now_s: float) -> np.ndarray:
        """(n, 2): P(next use within the horizon) and predicted seconds to it, one batched call."""
        if not prefixes:
            return np.empty((0, 2))
        return self.predict_features(self.prefix_features(prefixes, now_s))

    def reuse_probability(self, prefixes: Sequence[CachedPrefix], now_s: float) -> list[float]:
        return self.score_prefixes(prefixes, now_s)[:, 0].tolist()

    def next_use_s(self, prefixes: Sequence[CachedPrefix], now_s: float) -> list[float]:
        """:class:`policy.predictors.ReusePredictor`: absolute predicted next-use time per prefix (inf: never)."""
        dt = self.score_prefixes(prefixes, now_s)[:, 1]
        return [now_s + d if d < 0.9 * CENSOR_S else math.inf for d in dt.tolist()]

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> Path:
        return write_model(path, KIND, REUSE_FEATURES, REUSE_CATEGORICAL, self.boosters,
                           {"vocab": self.vocab.to_json(), "horizon_s": self.horizon_s, "info": self.info})

    @classmethod
    def load(cls, path: str | Path, num_threads: int = 1, compiled: bool = True) -> ReuseModel:
        """Load and check the schema; ``compiled`` compiles the trees for fast batched scoring (if numba is there)."""
        m = read_manifest(path, KIND, REUSE_FEATURES)
        model = cls(load_boosters(path, m), Vocab(m["vocab"]), m["horizon_s"], m.get("info"), num_threads)
        if compiled:
            model.compile()
        return model


# ---------------------------------------------------------------------- baselines


class BinnedRate:
    """P(hit) as the training hit rate in quantile bins of one feature (recency-only or frequency-only)."""

    def __init__(self, name: str, feature: str, bins: int = 20) -> None:
        self.name, self.feature, self.bins = name, feature, bins

    def fit(self, R: pd.DataFrame) -> BinnedRate:
        x = R[self.feature].to_numpy(float)
        x = np.where(np.isnan(x), -1.0, x)
        self.edges = np.unique(np.quantile(x, np.linspace(0, 1, self.bins + 1)[1:-1]))
        idx = np.searchsorted(self.edges, x, side="right")
        y = R["hit"].to_numpy(float)
        prior = float(y.mean())
        self.rates = [(y[idx == b].sum() + prior) / ((idx == b).sum() + 1) for b in range(len(self.edges) + 1)]
        return self

    def predict(self, R: pd.DataFrame) -> np.ndarray:
        x = R[self.feature].to_numpy(float)
        x = np.where(np.isnan(x), -1.0, x)
        return np.asarray(self.rates)[np.searchsorted(self.edges, x, side="right")]

    def to_json(self) -> dict:
        return {"name": self.name, "feature": self.feature, "edges": self.edges.tolist(), "rates": list(self.rates)}

    @classmethod
    def from_json(cls, d: dict) -> BinnedRate:
        b = cls(d["name"], d["feature"])
        b.edges, b.rates = np.asarray(d["edges"]), list(d["rates"])
        return b


def reuse_baselines() -> list[BinnedRate]:
    """Recency-only (time since last use) and frequency-only (uses so far, decayed over 60 s)."""
    return [BinnedRate("recency", "since_use"), BinnedRate("frequency", "edc_60")]
