"""LightGBM quantile model of a request's output tokens (p50, p90), and the online LengthPredictor.

``LengthModel.fit(logs)`` trains two boosters (quantile objectives 0.5 and 0.9) on
``log1p(output_tokens)`` (quantiles commute with the monotone transform) from
:func:`predictors.features.length_features` rows at two decision times (arrival
and admission). ``predict(X)`` scores a feature matrix (one call per booster for
the whole batch); ``predict(requests)`` is :class:`policy.predictors.LengthPredictor`:
it builds features from :class:`data.records.CandidateRequest` objects and the
state it keeps from :meth:`observe` events (finished siblings, earlier steps of the
prompt, the session's first prompt and last tool), and caches each request's
answer until that state changes.
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

from data.records import CandidateRequest, Event, EventKind
from predictors.compiled import CompiledScoring
from predictors.features import LENGTH_CATEGORICAL, LENGTH_FEATURES, Vocab, feature_matrix, length_features, prompt_key
from predictors.model_io import DEFAULT_TREES, load_boosters, read_manifest, training_threads, write_model

KIND = "length"
QUANTILES = (0.5, 0.9)
# (plain names: an Enum class attribute costs ~0.1 µs to read, per event)
_ARRIVED, _TOOL_STARTED, _FINISHED = EventKind.ARRIVED, EventKind.TOOL_CALL_STARTED, EventKind.FINISHED
DEFAULT_PARAMS: dict[str, Any] = {
    "learning_rate": 0.08, "num_leaves": 31, "min_data_in_leaf": 20, "feature_fraction": 0.9,
    "bagging_fraction": 0.8, "bagging_freq": 1, "lambda_l2": 1.0, "max_bin": 127, "verbose": -1, "seed": 0,
}


class _Stats:
    __slots__ = ("m", "n", "s")

    def __init__(self) -> None:
        self.n, self.s, self.m = 0, 0.0, -math.inf

    def add(self, x: float) -> None:
        self.n += 1
        self.s += x
        self.m = max(self.m, x)

    @property
    def mean(self) -> float:
        return self.s / self.n if self.n else math.nan


class LengthModel(CompiledScoring):
    """p50 / p90 output-token model; also a :class:`policy.predictors.LengthPredictor`."""

    features = LENGTH_FEATURES

    SCORED_BOOSTERS = ("p50", "p90")

    def __init__(self, boosters: dict[str, lgb.Booster], vocab: Vocab, info: dict | None = None,
                 num_threads: int = 1) -> None:
        self.boosters = boosters
        self.vocab = vocab
        self.info = dict(info or {})
        self.num_threads = num_threads
        self._compiled = None
        self.reset_state()

    # ------------------------------------------------------------------ training
    @classmethod
    def fit(cls, logs: pd.DataFrame, *, num_trees: int = DEFAULT_TREES, params: dict | None = None,
            num_threads: int = 2, at: Sequence[str] = ("arrival", "admit")) -> LengthModel:
        """Train on a prepared requests frame (:func:`predictors.logs.load_logs`); every row's step is used."""
        vocab = Vocab.fit(logs, LENGTH_CATEGORICAL)
        frames = [length_features(logs, at=a, vocab=vocab) for a in at]
        X = pd.concat(frames, ignore_index=True)
        X = X[X["done"]]
        if len(at) > 1:  # an identical snapshot twice adds nothing
            X = X.drop_duplicates(subset=["request_id", *LENGTH_FEATURES])
        return cls.fit_features(X, vocab, num_trees=num_trees, params=params, num_threads=num_threads)

    @classmethod
    def fit_features(cls, X: pd.DataFrame, vocab: Vocab, *, num_trees: int = DEFAULT_TREES, params: dict | None = None,
                     num_threads: int = 2) -> LengthModel:
        if len(X) == 0:
            raise ValueError("no finished requests to train the length model on")
        p = {**DEFAULT_PARAMS, **(params or {}), "num_threads": training_threads(len(X), num_threads)}
        boosters = {}
        for q in QUANTILES:
            ds = lgb.Dataset(X[list(LENGTH_FEATURES)].to_numpy(np.float32), label=X["y"].to_numpy(float),
                             feature_name=list(LENGTH_FEATURES), categorical_feature=list(LENGTH_CATEGORICAL),
                             free_raw_data=True)
            boosters[f"p{int(q * 100)}"] = lgb.train({**p, "objective": "quantile", "alpha": q}, ds, num_trees)
        info = {"num_trees": num_trees, "params": p, "train_rows": len(X)}
        return cls(boosters, vocab, info)

    # ------------------------------------------------------------------ scoring
    def predict_features(self, X) -> np.ndarray:
        """(n, 2) array of (p50, p90) output tokens for a feature matrix in :data:`LENGTH_FEATURES` order."""
        X = feature_matrix(X, LENGTH_FEATURES)
        out = np.empty((len(X), 2))
        if len(X) == 0:
            return out
        if self._compiled is not None:
            out = self._compiled.predict_raw(X)
        else:
            out[:, 0] = self.boosters["p50"].predict(X, num_threads=self.num_threads)
            out[:, 1] = self.boosters["p90"].predict(X, num_threads=self.num_threads)
        out = np.expm1(out)
        out[:, 1] = np.maximum(out[:, 1], out[:, 0])
        return np.maximum(out, 1.0)

    def predict(self, x):
        """A feature matrix (DataFrame or array) -> (n, 2) array; CandidateRequests -> [(p50, p90), ...]."""
        if isinstance(x, (np.ndarray, pd.DataFrame)):
            return self.predict_features(x)
        return self.predict_requests(x)

    # ------------------------------------------------------------------ online (LengthPredictor)
    def reset_state(self) -> None:
        self._turn_sibs: dict[tuple, _Stats] = defaultdict(_Stats)  # (group, turn)
        self._group: dict[Any, _Stats] = defaultdict(_Stats)
        self._session: dict[Any, _Stats] = defaultdict(_Stats)
        self._hist: dict[tuple, dict[int, _Stats]] = defaultdict(lambda: defaultdict(_Stats))  # (pkey, turn|None)
        self._first_prompt: dict[str, int] = {}
        self._last_tool: dict[str, str] = {}
        self._cache: dict[str, tuple[tuple, tuple[float, float]]] = {}
        self.rows_scored = 0

    #: The online state :meth:`export_state` hands over (what :meth:`observe` learned; not the prediction cache).
    _OBSERVED = ("_turn_sibs", "_group", "_session", "_hist", "_first_prompt", "_last_tool")

    def export_state(self) -> dict[str, Any]:
        """What :meth:`observe` learned from events (sibling, session and earlier-step lengths, tools), for a
        successor model at a hot swap (:meth:`import_state`); this model is not used afterwards."""
        return {k: getattr(self, k) for k in self._OBSERVED}

    def import_state(self, state: dict[str, Any]) -> None:
        """Take a predecessor's :meth:`export_state` over; ``ValueError`` (nothing changed) when it is not one."""
        if not isinstance(state, dict) or set(state) != set(self._OBSERVED):
            raise ValueError(f"not a LengthModel's observed state (expected the keys {list(self._OBSERVED)})")
        for k in self._OBSERVED:
            setattr(self, k, state[k])
        self._cache.clear()  # the predecessor's features are stale here

    def observe(self, event: Event) -> None:
        m = event.meta
        kind = event.kind
        if kind is _ARRIVED:
            if m.session_id is not None and (m.turn or 0) == 0:
                self._first_prompt.setdefault(m.session_id, event.num_prompt_tokens)
        elif kind is _TOOL_STARTED:
            if m.session_id is not None and m.tool is not None:
                self._last_tool[m.session_id] = m.tool
        elif kind is _FINISHED:
            self._cache.pop(event.request_id, None)
            if event.finish_reason == "abort":
                return
            y = math.log1p(max(event.num_output_tokens, 0))
            turn = m.turn or 0
            if m.group_id is not None:
                self._turn_sibs[(m.group_id, turn)].add(y)
                self._group[m.group_id].add(y)
            if m.session_id is not None:
                self._session[m.session_id].add(y)
            pk = prompt_key(m.prompt_id, m.group_id, m.step)
            if pk is not None:
                step = m.step or 0
                self._hist[(pk, None)][step].add(y)
                self._hist[(pk, turn)][step].add(y)

    def _hist_stats(self, key: tuple, step: int) -> tuple[int, float]:
        d = self._hist.get(key)
        if not d:
            return 0, math.nan
        n, s = 0, 0.0
        for st, v in d.items():
            if st < step:
                n += v.n
                s += v.s
        return n, (s / n if n else math.nan)

    def request_features(self, r: CandidateRequest) -> tuple[tuple, list[float]]:
        """(cache stamp, feature vector) of one candidate from its metadata and the observed state."""
        m = r.meta
        turn = m.turn or 0
        nan = math.nan
        sib = self._turn_sibs.get((m.group_id, turn)) if m.group_id is not None else None
        if sib is not None and sib.n:
            sib_n, sib_mean, sib_max = float(sib.n), sib.mean, sib.m
        elif r.sibling_output_tokens:  # no events observed: the hook's finished-sibling lengths
            ys = [math.log1p(x) for x in r.sibling_output_tokens]
            sib_n, sib_mean, sib_max = float(len(ys)), sum(ys) / len(ys), max(ys)
        else:
            sib_n, sib_mean, sib_max = 0.0, nan, nan
        grp = self._group.get(m.group_id) if m.group_id is not None else None
        sess = self._session.get(m.session_id) if m.session_id is not None else None
        pk = prompt_key(m.prompt_id, m.group_id, m.step)
        step = m.step or 0
        hn, hmean = self._hist_stats((pk, None), step) if pk is not None else (0, nan)
        _, htmean = self._hist_stats((pk, turn), step) if pk is not None else (0, nan)
        first = self._first_prompt.get(m.session_id) if m.session_id is not None else None
        if first is None and turn == 0:
            first = r.num_prompt_tokens
        tool = self._last_tool.get(m.session_id) if m.session_id is not None else None
        v = self.vocab
        feats = [
            v.code("domain", m.domain), v.code("paradigm", m.paradigm), v.code("tool_before", tool),
            float(r.num_prompt_tokens), float(turn),
            float(r.num_prompt_tokens - first) if first is not None else nan,
            float(r.max_tokens), float(m.group_size) if m.group_size is not None else nan,
            sib_n, sib_mean, sib_max,
            float(grp.n) if grp is not None else 0.0, grp.mean if grp is not None else nan,
            sess.mean if sess is not None else nan,
            float(hn), hmean, htmean,
        ]
        stamp = (r.group_finished, sib_n, grp.n if grp is not None else 0, hn)
        return stamp, feats

    def predict_requests(self, requests: Sequence[CandidateRequest]) -> list[tuple[float, float]]:
        """:class:`policy.predictors.LengthPredictor`: (p50, p90) per request, one batched call for the misses."""
        out: list[Any] = [None] * len(requests)
        miss, rows, stamps = [], [], []
        for i, r in enumerate(requests):
            stamp, feats = self.request_features(r)
            hit = self._cache.get(r.request_id)
            if hit is not None and hit[0] == stamp:
                out[i] = hit[1]
            else:
                miss.append(i)
                rows.append(feats)
                stamps.append(stamp)
        if miss:
            pred = self.predict_features(np.asarray(rows, dtype=np.float64))
            self.rows_scored += len(miss)
            if len(self._cache) > (1 << 17):
                self._cache.clear()
            for i, st, (a, b) in zip(miss, stamps, pred.tolist()):
                r = requests[i]
                hi = float(r.max_tokens) if r.max_tokens > 0 else math.inf
                res = (min(a, hi), min(b, hi))
                self._cache[r.request_id] = (st, res)
                out[i] = res
        return out

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> Path:
        return write_model(path, KIND, LENGTH_FEATURES, LENGTH_CATEGORICAL, self.boosters,
                           {"vocab": self.vocab.to_json(), "quantiles": list(QUANTILES), "info": self.info})

    @classmethod
    def load(cls, path: str | Path, num_threads: int = 1, compiled: bool = True) -> LengthModel:
        """Load and check the schema; ``compiled`` compiles the trees for fast batched scoring (if numba is there)."""
        m = read_manifest(path, KIND, LENGTH_FEATURES)
        model = cls(load_boosters(path, m), Vocab(m["vocab"]), m.get("info"), num_threads=num_threads)
        if compiled:
            model.compile()
        return model


# ---------------------------------------------------------------------- baselines


class DomainMeanBaseline:
    """Per-domain constant: p50 = exp(mean log1p tokens) of the domain in training, p90 = its 90th percentile."""

    name = "domain_mean"

    def fit(self, X: pd.DataFrame) -> DomainMeanBaseline:
        g = X.groupby("domain_name")["y"]
        self.p50 = g.mean().to_dict()
        self.p90 = g.quantile(0.9).to_dict()
        self.all50, self.all90 = float(X["y"].mean()), float(X["y"].quantile(0.9))
        return self

    def predict(self, X: pd.DataFrame) -> np.ndarray:
        d = X["domain_name"]
        a = d.map(self.p50).fillna(self.all50).to_numpy(float)
        b = d.map(self.p90).fillna(self.all90).to_numpy(float)
        return np.expm1(np.stack([a, np.maximum(a, b)], axis=1))

    def to_json(self) -> dict:
        return {"p50": self.p50, "p90": self.p90, "all50": self.all50, "all90": self.all90}

    @classmethod
    def from_json(cls, d: dict) -> DomainMeanBaseline:
        b = cls()
        b.p50, b.p90, b.all50, b.all90 = d["p50"], d["p90"], d["all50"], d["all90"]
        return b


class PromptHistoryBaseline:
    """This prompt's mean log length in earlier RL steps (same turn when known), else the domain's.

    p90 adds the domain's 90th percentile of the training residual around that mean.
    """

    name = "prompt_history"

    def fit(self, X: pd.DataFrame) -> PromptHistoryBaseline:
        self.dom = DomainMeanBaseline().fit(X)
        base = self._center(X)
        r = pd.DataFrame({"d": X["domain_name"].to_numpy(), "r": X["y"].to_numpy(float) - base})
        self.res90 = r.groupby("d")["r"].quantile(0.9).to_dict()
        self.res_all = float(r["r"].quantile(0.9))
        return self

    def _center(self, X: pd.DataFrame) -> np.ndarray:
        d = X["domain_name"].map(self.dom.p50).fillna(self.dom.all50).to_numpy(float)
        h = X["hist_turn_mean"].to_numpy(float)
        h = np.where(np.isnan(h), X["hist_mean"].to_numpy(float), h)
        return np.where(np.isnan(h), d, h)

    def predict(self, X: pd.DataFrame) -> np.ndarray:
        c = self._center(X)
        r = X["domain_name"].map(self.res90).fillna(self.res_all).to_numpy(float)
        return np.expm1(np.stack([c, c + np.maximum(r, 0.0)], axis=1))

    def to_json(self) -> dict:
        return {"dom": self.dom.to_json(), "res90": self.res90, "res_all": self.res_all}

    @classmethod
    def from_json(cls, d: dict) -> PromptHistoryBaseline:
        b = cls()
        b.dom, b.res90, b.res_all = DomainMeanBaseline.from_json(d["dom"]), d["res90"], d["res_all"]
        return b


LENGTH_BASELINES = (DomainMeanBaseline, PromptHistoryBaseline)
