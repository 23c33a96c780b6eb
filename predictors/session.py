"""Session models (LightGBM): the tool latency of a finished turn, whether its session continues, turns left,
and when its paused blocks are next used; their baselines; a vectorised online API (:meth:`SessionModel.predict_rows`).

Rows and labels are :func:`predictors.session_features.session_rows` (a turn, at
the time it finishes). Three boosters score one feature matrix:

* ``latency``: ``log1p`` of the tool latency (L1 objective: the conditional
  median, which minimises the absolute error), trained on turns with a next turn;
* ``cont``: P(the session has another turn) (binary);
* ``remaining``: ``log1p`` of the turns left after this one (L1: the median).

Each booster boosts from its baseline (LightGBM ``init_score``): the trees learn
corrections to the per-tool median latency and to the domain's turn-count prior
(logit of P(continue | turn, domain), log1p of its median turns left), which the
model keeps and adds back when it scores; on few training sessions this keeps it
near the prior where the features carry nothing.

``cont`` and ``remaining`` are trained with the ``tool`` column blanked: in logs
the tool is known exactly on the turns that call one, which would give the
answer away (they never split on it, so its value does not matter when they
score). Time to next use is ``latency + queue offset``, where the offset is the
domain's median wait of a returning turn (``first_scheduled_s - arrival_s`` of
the next turn) on the training steps.

Baselines (fitted on the training steps, saved in the model): :class:`ToolMedian` (per tool key,
the median latency; also the next-use baseline) and :class:`TurnCountPrior`
(the domain's empirical distribution of session turn counts).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import pandas as pd

from predictors import metrics
from predictors.compiled import CompiledScoring
from predictors.features import Vocab, feature_matrix
from predictors.model_io import DEFAULT_TREES, load_boosters, read_manifest, training_threads, write_model
from predictors.session_features import SESSION_CATEGORICAL, SESSION_FEATURES, check_columns, tool_key

KIND = "session"
DEFAULT_PARAMS: dict[str, Any] = {
    "learning_rate": 0.04, "num_leaves": 15, "min_data_in_leaf": 40, "feature_fraction": 0.9,
    "bagging_fraction": 0.8, "bagging_freq": 1, "lambda_l2": 10.0, "max_bin": 127, "verbose": -1, "seed": 0,
}
#: Numeric inputs of :meth:`SessionModel.predict_rows` that must be given; the others default to NaN (unknown).
REQUIRED_INPUTS: tuple[str, ...] = ("domain", "turn", "prompt_tokens", "output_tokens")
_TOOL = SESSION_FEATURES.index("tool")


def _fit_queue_offsets(R: pd.DataFrame) -> tuple[dict[str, float], float]:
    q = R[R["cont"] > 0]
    if not len(q):
        return {}, 0.0
    return q.groupby("domain_name")["queue_s"].median().to_dict(), float(q["queue_s"].median())


# ---------------------------------------------------------------------- baselines


class ToolMedian:
    """Per tool key (:func:`~predictors.session_features.tool_key`), the median tool latency on training calls."""

    name = "tool_median"

    def fit(self, R: pd.DataFrame) -> ToolMedian:
        calls = R[R["cont"] > 0]
        self.median = calls.groupby("tool_key")["latency_s"].median().to_dict()
        self.default = float(calls["latency_s"].median()) if len(calls) else 0.0
        return self

    def predict(self, R: pd.DataFrame) -> np.ndarray:
        return self.predict_keys(R["tool_key"])

    def predict_keys(self, keys) -> np.ndarray:
        return np.fromiter((self.median.get(k, self.default) for k in keys), float)

    def to_json(self) -> dict:
        return {"median": self.median, "default": self.default}

    @classmethod
    def from_json(cls, d: dict) -> ToolMedian:
        b = cls()
        b.median, b.default = d["median"], d["default"]
        return b


class TurnCountPrior:
    """The domain's empirical turn-count distribution: P(continue | turn, domain), median turns remaining.

    From the training rows (one per turn a session reached): at turn ``k``, the
    sessions that reached it and the share that went on, smoothed towards the
    domain's pooled share with ``alpha`` pseudo-sessions; the median of the
    turns they had left. A turn never reached in training: the pooled share, 0 left.
    """

    name = "turn_count_prior"

    def __init__(self, alpha: float = 2.0) -> None:
        self.alpha = alpha

    def fit(self, R: pd.DataFrame) -> TurnCountPrior:
        g = R.groupby(["domain_name", "turn"])
        self.pooled = R.groupby("domain_name")["cont"].mean().to_dict()
        self.all = float(R["cont"].mean()) if len(R) else 0.0
        n, k = g["cont"].count(), g["cont"].sum()
        prior = np.array([self.pooled[d] for d, _ in n.index])
        p = (k.to_numpy(float) + self.alpha * prior) / (n.to_numpy(float) + self.alpha)
        self.p = {f"{d}|{int(t)}": float(v) for (d, t), v in zip(n.index, p)}
        self.rem = {f"{d}|{int(t)}": float(v) for (d, t), v in g["remaining"].median().items()}
        return self

    def predict_proba(self, R: pd.DataFrame) -> np.ndarray:
        return self.lookup(R["domain_name"], R["turn"])[0]

    def predict_remaining(self, R: pd.DataFrame) -> np.ndarray:
        return self.lookup(R["domain_name"], R["turn"])[1]

    def lookup(self, domains, turns) -> tuple[np.ndarray, np.ndarray]:
        """(P(continue), median turns left) per (domain, turn)."""
        keys = [f"{d}|{int(t)}" for d, t in zip(domains, turns)]
        p = np.fromiter((self.p.get(k, self.pooled.get(d, self.all)) for k, d in zip(keys, domains)), float)
        return p, np.fromiter((self.rem.get(k, 0.0) for k in keys), float)

    def to_json(self) -> dict:
        return {"alpha": self.alpha, "pooled": self.pooled, "all": self.all, "p": self.p, "rem": self.rem}

    @classmethod
    def from_json(cls, d: dict) -> TurnCountPrior:
        b = cls(d["alpha"])
        b.pooled, b.all, b.p, b.rem = d["pooled"], d["all"], d["p"], d["rem"]
        return b


def _init_scores(tm: ToolMedian, prior: TurnCountPrior, domains, turns, tool_keys) -> np.ndarray:
    """(n, 3) margins the boosters start from: log1p median latency, logit P(continue), log1p median turns left."""
    p, rem = prior.lookup(domains, turns)
    p = np.clip(p, 1e-4, 1 - 1e-4)
    return np.stack([np.log1p(tm.predict_keys(tool_keys)), np.log(p / (1 - p)), np.log1p(rem)], axis=1)


class SessionModel(CompiledScoring):
    """Tool latency, P(continue), turns remaining and time to next use of a turn that just finished."""

    features = SESSION_FEATURES
    SCORED_BOOSTERS = ("latency", "cont", "remaining")

    def __init__(self, boosters: dict[str, lgb.Booster], vocab: Vocab, tool_median: ToolMedian,
                 prior: TurnCountPrior, queue_offset: dict[str, float], queue_default: float,
                 info: dict | None = None, num_threads: int = 1) -> None:
        self.boosters = boosters
        self.vocab = vocab
        self.tool_median = tool_median
        self.prior = prior
        self.queue_offset = dict(queue_offset)
        self.queue_default = float(queue_default)
        self.info = dict(info or {})
        self.num_threads = num_threads
        self._compiled = None

    # ------------------------------------------------------------------ training
    @classmethod
    def fit_rows(cls, R: pd.DataFrame, vocab: Vocab, *, num_trees: int = DEFAULT_TREES, params: dict | None = None,
                 num_threads: int = 1) -> SessionModel:
        """Train on :func:`~predictors.session_features.session_rows` rows (every row's step is used)."""
        check_columns(R, (*SESSION_FEATURES, "cont", "remaining", "latency_s", "queue_s", "domain_name", "tool_key"),
                      "session rows")
        calls = R[R["cont"] > 0]
        if len(calls) == 0:
            raise ValueError("no turn with a next turn (no multi-turn session) to train the session models on")
        tm, prior = ToolMedian().fit(R), TurnCountPrior().fit(R)
        p = {**DEFAULT_PARAMS, **(params or {}), "num_threads": training_threads(len(R), num_threads)}
        kw = dict(feature_name=list(SESSION_FEATURES), categorical_feature=list(SESSION_CATEGORICAL))
        X_all = R[list(SESSION_FEATURES)].to_numpy(np.float32)
        X_all[:, _TOOL] = np.nan
        init = _init_scores(tm, prior, R["domain_name"], R["turn"], R["tool_key"])
        lat = lgb.train({**p, "objective": "regression_l1"},
                        lgb.Dataset(calls[list(SESSION_FEATURES)].to_numpy(np.float32),
                                    init_score=np.ascontiguousarray(init[(R["cont"] > 0).to_numpy(), 0]),
                                    label=np.log1p(calls["latency_s"].to_numpy(float)), **kw), num_trees)
        cont = lgb.train({**p, "objective": "binary"},
                         lgb.Dataset(X_all, label=R["cont"].to_numpy(float),
                                     init_score=np.ascontiguousarray(init[:, 1]), **kw), num_trees)
        rem = lgb.train({**p, "objective": "regression_l1"},
                        lgb.Dataset(X_all, label=np.log1p(R["remaining"].to_numpy(float)),
                                    init_score=np.ascontiguousarray(init[:, 2]), **kw),
                        num_trees)
        offsets, default = _fit_queue_offsets(R)
        info = {"num_trees": num_trees, "params": p, "train_rows": len(R), "train_calls": len(calls)}
        return cls({"latency": lat, "cont": cont, "remaining": rem}, vocab, tm, prior, offsets, default, info)

    # ------------------------------------------------------------------ scoring
    def _decode(self, X: np.ndarray, column: str) -> list:
        names = self.vocab.values.get(column, [])
        return [names[int(c)] if c == c and 0 <= c < len(names) else None
                for c in X[:, SESSION_FEATURES.index(column)].tolist()]

    def _encode(self, column: str, values) -> np.ndarray:
        index = self.vocab._index.get(column, {})
        return np.fromiter((index.get(str(v), np.nan) if v is not None and v == v else np.nan for v in values), float)

    def predict_features(self, X) -> dict[str, np.ndarray]:
        """Predictions (see :meth:`predict_rows`) for a feature matrix in :data:`SESSION_FEATURES` order."""
        X = feature_matrix(X, SESSION_FEATURES)
        if len(X) == 0:
            z = np.zeros(0)
            return {"tool_latency_s": z, "p_continue": z, "turns_remaining": z, "next_use_s": z}
        domains = self._decode(X, "domain")
        keys = tool_key(self._decode(X, "tool"), self._decode(X, "paradigm"), domains)
        if self._compiled is not None:
            raw = self._compiled.predict_raw(X)
        else:
            raw = np.stack([self.boosters[k].predict(X, raw_score=True, num_threads=self.num_threads)
                            for k in self.SCORED_BOOSTERS], axis=1)
        raw = raw + _init_scores(self.tool_median, self.prior, domains, X[:, SESSION_FEATURES.index("turn")], keys)
        latency = np.maximum(np.expm1(raw[:, 0]), 0.0)
        queue = np.fromiter((self.queue_offset.get(d, self.queue_default) for d in domains), float)
        return {"tool_latency_s": latency, "p_continue": 1.0 / (1.0 + np.exp(-raw[:, 1])),
                "turns_remaining": np.maximum(np.expm1(raw[:, 2]), 0.0), "next_use_s": latency + queue}

    def predict(self, X) -> dict[str, np.ndarray]:
        return self.predict_features(X)

    def predict_rows(self, columns: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Vectorised online scoring of ``n`` turns at the time each finished.

        ``columns`` maps input names to length-``n`` arrays (or lists):

        * ``domain`` (str, required), ``paradigm`` (str), ``tool`` (str: the tool the
          turn called, if the RL framework passes it; None: unknown);
        * ``turn`` (0-based index of the turn that finished), ``prompt_tokens`` (its
          context at the start), ``output_tokens`` (its output): required;
        * ``out_total`` (output tokens of the session so far, this turn included;
          default ``output_tokens``), ``context_growth`` (prompt tokens beyond the
          session's first prompt), ``group_size``;
        * this session's earlier tool calls, in ``log1p`` seconds: ``lat_mean``,
          ``lat_last``; the group's completed calls: ``grp_lat_n`` (count),
          ``grp_lat_mean`` (mean ``log1p`` seconds);
        * sibling sessions of the group that already ended: ``sib_done_n`` (count),
          ``sib_done_turns_mean`` / ``_min`` / ``_max`` (their turn counts);
          ``grp_turn_mean`` (turns of the group started per session started);
        * this prompt in earlier RL steps: ``hist_n`` (sessions ended),
          ``hist_turns_mean`` (their mean turn count).

        Any numeric input left out is unknown (NaN), counts included. Returns
        arrays: ``tool_latency_s`` (median latency of the call this turn ends
        with), ``p_continue``, ``turns_remaining`` (median), ``next_use_s``
        (seconds from the turn's finish until its session's next turn is
        scheduled). ValueError names a missing required input or a length mismatch.
        """
        missing = [c for c in REQUIRED_INPUTS if c not in columns]
        if missing:
            raise ValueError(f"predict_rows: missing input column(s): {', '.join(missing)}")
        unknown = [c for c in columns if c not in SESSION_FEATURES]
        if unknown:
            raise ValueError(f"predict_rows: unknown input column(s): {', '.join(unknown)}")
        n = len(columns["domain"])
        X = np.full((n, len(SESSION_FEATURES)), np.nan)
        for name, col in columns.items():
            if len(col) != n:
                raise ValueError(f"predict_rows: column {name!r} has {len(col)} values, 'domain' has {n}")
        for j, name in enumerate(SESSION_FEATURES):
            if name not in columns:
                continue
            if name in SESSION_CATEGORICAL:
                X[:, j] = self._encode(name, columns[name])
            else:
                X[:, j] = np.asarray(columns[name], dtype=np.float64)
        if "out_total" not in columns:
            X[:, SESSION_FEATURES.index("out_total")] = X[:, SESSION_FEATURES.index("output_tokens")]
        return self.predict_features(X)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> Path:
        return write_model(path, KIND, SESSION_FEATURES, SESSION_CATEGORICAL, self.boosters,
                           {"vocab": self.vocab.to_json(), "tool_median": self.tool_median.to_json(),
                            "turn_count_prior": self.prior.to_json(), "queue_offset": self.queue_offset,
                            "queue_default": self.queue_default, "info": self.info})

    @classmethod
    def load(cls, path: str | Path, num_threads: int = 1, compiled: bool = True) -> SessionModel:
        """Load and check the schema; ``compiled`` compiles the trees for fast batched scoring (if numba is there)."""
        m = read_manifest(path, KIND, SESSION_FEATURES)
        model = cls(load_boosters(path, m), Vocab(m["vocab"]), ToolMedian.from_json(m["tool_median"]),
                    TurnCountPrior.from_json(m["turn_count_prior"]), m["queue_offset"], m["queue_default"],
                    m.get("info"), num_threads=num_threads)
        if compiled:
            model.compile()
        return model


# ---------------------------------------------------------------------- report


def _abs_errors(y: np.ndarray, p: np.ndarray) -> dict:
    e = np.abs(np.asarray(y, float) - np.asarray(p, float))
    return {"mae": float(e.mean()) if len(e) else float("nan"),
            "median_ae": float(np.median(e)) if len(e) else float("nan")}


def _binary(y: np.ndarray, p: np.ndarray) -> dict:
    p = np.clip(np.asarray(p, float), 1e-6, 1 - 1e-6)
    y = np.asarray(y, float)
    ll = float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))) if len(y) else float("nan")
    return {"auc": metrics.auc(y, p), "log_loss": ll, "brier": metrics.brier(y, p)}


def session_report(model: SessionModel, R: pd.DataFrame) -> dict:
    """Metrics of each session model on rows ``R`` beside its baseline (the ones the model was fitted with), and
    per domain for continuation."""
    tm, prior = model.tool_median, model.prior
    pred = model.predict_features(R[list(SESSION_FEATURES)])
    calls = (R["cont"] > 0).to_numpy()
    C = R[calls]
    lat_base = tm.predict(C)
    rep: dict[str, Any] = {"n_turns": len(R), "n_calls": int(calls.sum())}
    rep["tool_latency"] = {"model": _abs_errors(C["latency_s"], pred["tool_latency_s"][calls]),
                           "tool_median": _abs_errors(C["latency_s"], lat_base)}
    y = R["cont"].to_numpy(float)
    rep["continue"] = {"positive_rate": float(y.mean()) if len(y) else float("nan"),
                       "model": _binary(y, pred["p_continue"]), "turn_count_prior": _binary(y, prior.predict_proba(R))}
    per = {}
    for d in sorted(R["domain_name"].unique()):
        m = (R["domain_name"] == d).to_numpy()
        if 0 < y[m].sum() < m.sum():
            per[d] = {"n": int(m.sum()), "model": _binary(y[m], pred["p_continue"][m]),
                      "turn_count_prior": _binary(y[m], prior.predict_proba(R[m]))}
    rep["continue"]["per_domain"] = per
    rem = R["remaining"].to_numpy(float)
    rep["turns_remaining"] = {"model": _abs_errors(rem, pred["turns_remaining"]),
                              "turn_count_prior": _abs_errors(rem, prior.predict_remaining(R))}
    rep["next_use"] = {"model": _abs_errors(C["next_use_s"], pred["next_use_s"][calls]),
                       "tool_median": _abs_errors(C["next_use_s"], lat_base)}
    return rep


def session_ok(rep: dict) -> dict[str, bool]:
    """Whether each model beats its baseline in the report (latency / next use: MAE; continuation: AUC or log loss;
    turns remaining: MAE)."""
    c = rep["continue"]
    return {
        "tool_latency": rep["tool_latency"]["model"]["mae"] < rep["tool_latency"]["tool_median"]["mae"],
        "continue": (c["model"]["auc"] > c["turn_count_prior"]["auc"]
                     or c["model"]["log_loss"] < c["turn_count_prior"]["log_loss"]),
        "turns_remaining": rep["turns_remaining"]["model"]["mae"] < rep["turns_remaining"]["turn_count_prior"]["mae"],
        "next_use": rep["next_use"]["model"]["mae"] < rep["next_use"]["tool_median"]["mae"],
    }
