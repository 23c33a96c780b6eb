"""The training data of offline policy learning: the logged decisions of log directories as one flat batch.

Every ``admit`` / ``preempt`` decision with at least two candidates in the
``decisions`` telemetry of a log directory. Candidate features are the logged
:data:`policy.interface.CANDIDATE_FEATURES`; the length predictor's p50 / p90
are the logged ones when the behaviour policy logged them, else the LightGBM
model replayed on the ``requests`` table with decision-time features
(:func:`predictors.features.length_features` at arrival for waiting
candidates, at admission for running ones); the engine state comes from the
decision's ``steps`` row; the RL step's phase from the ``requests`` table. The
reward is :mod:`policy.learning.rewards` (the makespan-to-go fall in the window after the
decision).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
import pyarrow as pa

from policy.interface import CANDIDATE_FEATURES
from policy.learned.features import FEATURES, RAW, R, model_features
from policy.learning.config import OfflineConfig
from policy.learning.rewards import RewardModel, decision_rewards

__all__ = ["KINDS", "Decisions", "decision_telemetry", "load_decisions", "logged_rewards"]

KINDS = {"admit": 0, "preempt": 1}


@dataclass
class Decisions:
    """A flat batch of logged decisions: candidate rows ``x[offsets[d]:offsets[d+1]]`` belong to decision ``d``."""

    x: np.ndarray  # (rows, len(FEATURES)) float32
    true_rem: np.ndarray  # (rows,) true remaining output tokens (hindsight), NaN unknown
    offsets: np.ndarray  # (D + 1,)
    kind: np.ndarray  # (D,) 0 admit, 1 preempt
    chosen: np.ndarray  # (D,) index within the decision
    propensity: np.ndarray  # (D,)
    reward: np.ndarray  # (D,)
    time: np.ndarray  # (D,)
    log: np.ndarray  # (D,) index of the log directory
    #: (D,) the logged action's RL step and GRPO group (:func:`predictors.logs.group_keys`): the held-out split
    step: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    group: np.ndarray = field(default_factory=lambda: np.zeros(0, object))

    def __len__(self) -> int:
        return len(self.kind)

    def subset(self, idx: np.ndarray) -> "Decisions":
        idx = np.asarray(idx, dtype=np.int64)
        sizes = np.diff(self.offsets)[idx]
        rows = np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in idx]) if len(idx) else \
            np.empty(0, dtype=np.int64)
        return Decisions(self.x[rows], self.true_rem[rows], np.concatenate([[0], np.cumsum(sizes)]),
                         self.kind[idx], self.chosen[idx], self.propensity[idx], self.reward[idx], self.time[idx],
                         self.log[idx], self.step[idx], self.group[idx])

    @staticmethod
    def concat(parts: Sequence["Decisions"]) -> "Decisions":
        offs, base = [np.zeros(1, dtype=np.int64)], 0
        for p in parts:
            offs.append(p.offsets[1:] + base)
            base += p.offsets[-1]
        cat = lambda a: np.concatenate([getattr(p, a) for p in parts])  # noqa: E731
        return Decisions(cat("x"), cat("true_rem"), np.concatenate(offs), cat("kind"), cat("chosen"),
                         cat("propensity"), cat("reward"), cat("time"), cat("log"), cat("step"), cat("group"))


def decision_telemetry(path: Path) -> Path:
    """The telemetry directory of a log directory that holds ``decisions`` (FileNotFoundError without)."""
    from predictors.logs import telemetry_dir

    d = telemetry_dir(Path(path))
    if d is None or not (d / "decisions").is_dir():
        raise FileNotFoundError(f"{path}: no decisions telemetry (expected {path}/telemetry/decisions)")
    return d


def _offline_predictions(log_dir: Path, length_model: Any) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(p50, p90) per request id at arrival and at admission: the LightGBM model replayed on the log."""
    from predictors.features import length_features
    from predictors.logs import load_log

    df = load_log(log_dir)
    out = []
    for at in ("arrival", "admit"):
        X = length_features(df, at=at, vocab=length_model.vocab)
        p = np.asarray(length_model.predict_features(X), dtype=np.float64)
        p = pd.DataFrame(p[:, :2], index=pd.Index(X["request_id"]), columns=["p50", "p90"])
        out.append(p[~p.index.duplicated(keep="last")])
    return out[0], out[1]


def _lookup(index: pd.Index, ids: np.ndarray, values: np.ndarray, missing: float = np.nan) -> np.ndarray:
    """``values`` (aligned with ``index``) at each of ``ids``; ``missing`` where an id is not in ``index``."""
    pos = index.get_indexer(ids)
    out = values[np.maximum(pos, 0)].astype(np.float64)
    out[pos < 0] = missing
    return out


def _step_phase(req: pd.DataFrame, steps: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Per row: finished / arrived requests of RL step ``steps[i]`` by time ``t[i]`` (0 before any arrived)."""
    out = np.zeros(len(t))
    rs = req["step"].fillna(0).astype(int).to_numpy()
    arr = req["arrival_s"].astype(float).to_numpy()
    fin = req["finish_s"].astype(float).fillna(np.inf).to_numpy()
    for s in np.unique(steps):
        m = steps == s
        a, f = np.sort(arr[rs == s]), np.sort(fin[rs == s])
        na = np.searchsorted(a, t[m], side="right")
        nf = np.searchsorted(f, t[m], side="right")
        out[m] = np.where(na > 0, np.minimum(1.0, nf / np.maximum(na, 1)), 0.0)
    return out


def _usable(dec) -> np.ndarray:
    """Row indices of the decisions that can be learned from: admit / preempt, >= 2 candidates, an action."""
    kinds = dec.column("kind").to_numpy(zero_copy_only=False)
    import pyarrow.compute as pc

    ncand = pc.list_value_length(dec.column("candidate_ids")).to_numpy(zero_copy_only=False)
    keep = np.isin(kinds, list(KINDS)) & (ncand >= 2) & (dec.column("chosen").to_numpy() >= 0)
    return np.nonzero(keep)[0]


def _rewards(d: pd.DataFrame, req: pd.DataFrame, steps: pd.DataFrame, config: OfflineConfig) -> np.ndarray:
    """:mod:`policy.learning.rewards` of decisions ``d`` (columns replica, time_s), per replica."""
    out = np.zeros(len(d))
    for rep in sorted(req["replica"].unique()):
        m = RewardModel.from_log(req[req["replica"] == rep], steps[steps["replica"] == rep])
        sel = (d["replica"] == rep).to_numpy()
        out[sel] = decision_rewards(d.loc[sel, "time_s"].to_numpy(float), m, config.reward_window_s)
    return out


def logged_rewards(log_dir: str | Path, config: OfflineConfig | None = None) -> np.ndarray:
    """The rewards of a run's own usable decisions: the value the simulator measured for the policy that ran."""
    from data.io import read_telemetry

    config = config or OfflineConfig()
    tdir = decision_telemetry(Path(log_dir))
    dec = read_telemetry(tdir, "decisions", columns=["kind", "candidate_ids", "chosen", "replica", "time_s"])
    d = dec.take(_usable(dec)).select(["replica", "time_s"]).to_pandas()
    return _rewards(d, read_telemetry(tdir, "requests").to_pandas(), read_telemetry(tdir, "steps").to_pandas(),
                    config)


#: Each logged candidate feature's column (:data:`policy.interface.CANDIDATE_FEATURES`).
_L = {name: i for i, name in enumerate(CANDIDATE_FEATURES)}
#: The :data:`RAW` values logged under their own name, and the logged length predictions: raw name -> logged column.
_LOGGED = {name: _L[name] for name in RAW if name in _L}
_LOGGED_PRED = {"pred_p50": _L["pred_len_p50"], "pred_p90": _L["pred_len_p90"]}


def _candidates(d: pa.Table, config: OfflineConfig, rng: np.random.Generator):
    """Flat candidate rows of decisions ``d``: (offsets, ids, logged features (rows, len(CANDIDATE_FEATURES)), chosen
    index per decision).

    A decision with more than ``max_candidates`` keeps its logged action and a random subset of the others.
    """
    import pyarrow.compute as pc

    ids_col = d.column("candidate_ids").combine_chunks()
    offsets = ids_col.offsets.to_numpy().astype(np.int64)
    offsets = offsets - offsets[0]
    ids = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False)
    feats = pc.list_flatten(pc.list_flatten(d.column("features").combine_chunks()))
    f = feats.to_numpy(zero_copy_only=False).astype(np.float64).reshape(len(ids), len(CANDIDATE_FEATURES))
    chosen = d.column("chosen").to_numpy().astype(np.int64)
    sizes = np.diff(offsets)
    big = np.flatnonzero(sizes > config.max_candidates)
    if len(big):
        keep = np.ones(len(ids), dtype=bool)
        for i in big.tolist():
            n, ch = int(sizes[i]), int(chosen[i])
            others = rng.choice(np.delete(np.arange(n), ch), config.max_candidates - 1, replace=False)
            sel = np.sort(np.concatenate([[ch], others]))
            m = np.zeros(n, dtype=bool)
            m[sel] = True
            keep[offsets[i]:offsets[i + 1]] = m
            chosen[i] = int(np.searchsorted(sel, ch))
            sizes[i] = len(sel)
        ids, f = ids[keep], f[keep]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return offsets, ids, f, chosen


def load_decisions(log_dir: str | Path, length_model: Any, config: OfflineConfig, log_index: int = 0,
                   rng: Optional[np.random.Generator] = None) -> Decisions:
    """The decisions of one log directory as a :class:`Decisions` batch (see the module docstring).

    Vectorised over candidate rows: no Python work per decision or candidate (but for oversized decisions).
    """
    from data.io import read_telemetry

    log_dir = Path(log_dir)
    tdir = decision_telemetry(log_dir)
    rng = rng or np.random.default_rng(config.seed)
    dec = read_telemetry(tdir, "decisions")
    req = read_telemetry(tdir, "requests").to_pandas()
    steps = read_telemetry(tdir, "steps").to_pandas()
    idx = _usable(dec)
    if len(idx) > config.max_decisions:
        idx = np.sort(rng.choice(idx, config.max_decisions, replace=False))
    dec = dec.take(idx)
    if dec.num_rows == 0:
        return Decisions(np.zeros((0, len(FEATURES)), np.float32), np.zeros(0), np.zeros(1, np.int64),
                         np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0),
                         np.zeros(0, np.int64))
    d = dec.select(["replica", "engine_step", "time_s", "kind", "propensity"]).to_pandas()
    offsets, ids, f, chosen = _candidates(dec, config, rng)
    seg = np.repeat(np.arange(len(d)), np.diff(offsets))
    raw = np.full((len(ids), len(RAW)), np.nan)
    for name, j in _LOGGED.items():
        raw[:, R[name]] = f[:, j]
    # length predictions: the logged ones, else the model replayed (at arrival if waiting, at admission if running)
    arr_pred, adm_pred = _offline_predictions(log_dir, length_model)
    running = f[:, _L["is_running"]] > 0.5
    logged = np.isfinite(f[:, _LOGGED_PRED["pred_p50"]])
    for col, j in _LOGGED_PRED.items():
        k = col[-3:]
        replay = np.where(running, _lookup(adm_pred.index, ids, adm_pred[k].to_numpy()),
                          _lookup(arr_pred.index, ids, arr_pred[k].to_numpy()))
        raw[:, R[col]] = np.where(logged, f[:, j], replay)
    # engine state of the decision's step; total blocks per replica = free blocks at their most free
    total = steps.groupby("replica")["free_blocks"].transform("max").clip(lower=1.0)
    st = d[["replica", "engine_step"]].merge(
        steps.assign(pinned_frac=steps["pinned_blocks"] / total).drop_duplicates(["replica", "engine_step"]),
        on=["replica", "engine_step"], how="left")
    for col, name in (("kv_usage", "kv_usage"), ("pinned_frac", "pinned_frac"), ("num_running", "running"),
                      ("num_waiting", "waiting")):
        raw[:, R[col]] = st[name].to_numpy(np.float64)[seg]
    rid = pd.Index(req["request_id"])
    cand_step = _lookup(rid, ids, req["step"].fillna(0).astype(int).to_numpy(), missing=0).astype(np.int64)
    raw[:, R["step_phase"]] = _step_phase(req, cand_step, d["time_s"].to_numpy(float)[seg])
    x = model_features(raw, offsets)
    true_rem = _lookup(rid, ids, req["output_tokens"].astype(float).to_numpy()) - f[:, _L["output_tokens"]]
    rewards = _rewards(d, req, steps, config)
    from predictors.logs import group_keys

    pos = rid.get_indexer(ids[offsets[:-1] + chosen])  # the logged action's request
    known = pos >= 0
    acted_step = np.where(known, req["step"].fillna(0).astype(int).to_numpy()[np.maximum(pos, 0)], 0)
    acted_group = np.where(known, group_keys(req).to_numpy(object)[np.maximum(pos, 0)], None)
    return Decisions(x, true_rem, offsets, d["kind"].map(KINDS).to_numpy(np.int64), chosen,
                     d["propensity"].to_numpy(float), rewards, d["time_s"].to_numpy(float),
                     np.full(len(d), log_index, np.int64), acted_step.astype(np.int64), acted_group)

