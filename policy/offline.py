"""Fit the learned policy offline from logged decisions: imitation warm start, then doubly robust / IPS.

**Data.** Every ``admit`` / ``preempt`` decision with at least two candidates
in the ``decisions`` telemetry of each log directory. Candidate features are
the logged :data:`policy.interface.CANDIDATE_FEATURES`; the length predictor's
p50 / p90 are the logged ones when the behaviour policy logged them, else the
LightGBM model replayed on the ``requests`` table with decision-time features
(:func:`predictors.features.length_features` at arrival for waiting
candidates, at admission for running ones); the engine state comes from the
decision's ``steps`` row; the RL step's phase from the ``requests`` table. The
reward is :mod:`policy.rewards` (the makespan-to-go fall in the window after the
decision).

**Objective** (minimised, :class:`OfflineConfig` holds every weight):

* imitation of the hindsight oracle (admission only): a listwise cross-entropy
  towards ``softmax(log1p(true remaining output) / imitation_temperature)``,
  longest first (LPT, the makespan rule; ``oracle_rule="srpt"`` flips it).
  True lengths come from the same logs' ``requests`` table, in hindsight;
* minus the off-policy value of the softmax policy ``pi = softmax(score /
  temperature)``: doubly robust (``objective="dr"``: a ridge reward model on
  the candidate features gives ``q``) or IPS, with propensities clipped at
  ``propensity_clip``; rewards are standardised per decision kind;
* L2 on the weights.

**Held-out evaluation.** The last log directory (or, with one log, the last
``holdout_fraction`` of its decisions by time; with one log of a single RL step,
the decisions acting on the last ``holdout_fraction`` of its GRPO groups) is held
out (``trained_on.split`` in the manifest says which); :mod:`policy.ope`
estimates the greedy policy's value there (IPS, SNIPS, DR with bootstrap CIs).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
import pyarrow as pa

from policy.learned import RUNTIME_DEFAULTS, LearnedPolicy, build_scorer
from policy.learned_features import FEATURES, RAW, R, model_features
from policy.rewards import RewardModel, decision_rewards

__all__ = ["OfflineConfig", "Decisions", "load_decisions", "logged_rewards", "ope_on_log", "train_policy", "fit_scorer", "evaluate_policy_on"]

KINDS = {"admit": 0, "preempt": 1}


@dataclass
class OfflineConfig:
    """Every hyper-parameter of offline policy learning (stored in the POLICY_DIR manifest)."""

    hidden: tuple[int, ...] = (32, 32)
    epochs: int = 10
    batch_decisions: int = 256
    lr: float = 3e-3
    weight_decay: float = 1e-4
    #: the softmax temperature of the policy being optimised (and of log mode)
    temperature: float = 1.0
    objective: str = "dr"  # "dr" or "ips"
    dr_weight: float = 1.0
    propensity_clip: float = 0.01
    imitation_weight: float = 1.0
    imitation_temperature: float = 0.25
    oracle_rule: str = "lpt"  # "lpt" or "srpt"
    ridge: float = 1.0
    reward_window_s: float = 5.0
    max_decisions: int = 20_000
    max_candidates: int = 256
    holdout_fraction: float = 0.25
    #: a control (tests, promotion gates): rewards permuted across decisions and the hindsight
    #: labels across candidate rows, so nothing learned comes from outcomes
    shuffle_rewards: bool = False
    seed: int = 0
    #: torch threads while fitting. 1: a batch is ~10k rows x 32 units, where intra-op threads cost more than they
    #: give (measured on a shared 2-core machine: 4.2 s CPU per epoch with 1 thread, 17.1 s with 2)
    threads: int = 1
    #: whether the trained policy chooses preemption victims with its preemption head (``policy.json``'s runtime
    #: option ``preempt``). None (default): when the logs hold preemption decisions, i.e. every lever found in the
    #: logs is learned (issue #30); False: vLLM's own victim (the tail of the running list), as issue #7 measured
    #: the head's victims recomputing about 2x vLLM's. The head is trained either way.
    preempt: Optional[bool] = None
    #: whether the trained policy runs over vLLM's CPU offload tier (``policy.json``'s runtime option ``offload``).
    #: None (default): when the logs were taken over one (their ``steps`` stored blocks to it), so the plain recipe
    #: (``simulate --policy logging``, whose exploring policy uses the tier, then ``train``) serves over the tier.
    offload: Optional[bool] = None
    runtime: dict = field(default_factory=lambda: dict(RUNTIME_DEFAULTS))

    def __post_init__(self) -> None:
        if self.objective not in ("dr", "ips"):
            raise ValueError(f"objective must be 'dr' or 'ips', got {self.objective!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")
        if self.oracle_rule not in ("lpt", "srpt"):
            raise ValueError(f"oracle_rule must be 'lpt' or 'srpt', got {self.oracle_rule!r}")
        self.hidden = tuple(int(h) for h in self.hidden)

    @classmethod
    def from_json(cls, text: str | None) -> OfflineConfig:
        """A config from a JSON object of its fields (None or empty: the defaults); a bad one raises
        :class:`ValueError` naming the fields."""
        if not text:
            return cls()
        try:
            values = json.loads(text)
        except ValueError as err:
            raise ValueError(f"not valid JSON: {err}") from None
        if not isinstance(values, dict):
            raise ValueError(f"must be a JSON object of OfflineConfig fields, got {type(values).__name__}")
        try:
            return cls(**values)
        except (ValueError, TypeError) as err:
            known = ", ".join(f.name for f in fields(cls))
            raise ValueError(f"{err} (OfflineConfig fields: {known})") from None


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


# ------------------------------------------------------------------------------------------ loading


def _telemetry_dir(path: Path) -> Path:
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
    """:mod:`policy.rewards` of decisions ``d`` (columns replica, time_s), per replica."""
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
    tdir = _telemetry_dir(Path(log_dir))
    dec = read_telemetry(tdir, "decisions", columns=["kind", "candidate_ids", "chosen", "replica", "time_s"])
    d = dec.take(_usable(dec)).select(["replica", "time_s"]).to_pandas()
    return _rewards(d, read_telemetry(tdir, "requests").to_pandas(), read_telemetry(tdir, "steps").to_pandas(),
                    config)


#: Logged candidate feature columns (:data:`policy.interface.CANDIDATE_FEATURES`) and the raw columns they fill.
_LOGGED = {"prompt_tokens": 0, "computed_tokens": 2, "output_tokens": 3, "max_tokens": 4, "turn": 5,
           "group_size": 6, "group_finished": 7, "group_running": 8, "wait_s": 9, "preemptions": 10,
           "is_running": 11}
_N_LOGGED = 14


def _candidates(d: pa.Table, config: OfflineConfig, rng: np.random.Generator):
    """Flat candidate rows of decisions ``d``: (offsets, ids, logged features (rows, 14), chosen index per decision).

    A decision with more than ``max_candidates`` keeps its logged action and a random subset of the others.
    """
    import pyarrow.compute as pc

    ids_col = d.column("candidate_ids").combine_chunks()
    offsets = ids_col.offsets.to_numpy().astype(np.int64)
    offsets = offsets - offsets[0]
    ids = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False)
    feats = pc.list_flatten(pc.list_flatten(d.column("features").combine_chunks()))
    f = feats.to_numpy(zero_copy_only=False).astype(np.float64).reshape(len(ids), _N_LOGGED)
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
    tdir = _telemetry_dir(log_dir)
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
    running = f[:, 11] > 0.5
    logged = np.isfinite(f[:, 12])
    for col, j in (("pred_p50", 12), ("pred_p90", 13)):
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
    true_rem = _lookup(rid, ids, req["output_tokens"].astype(float).to_numpy()) - f[:, 3]
    rewards = _rewards(d, req, steps, config)
    from predictors.logs import group_keys

    pos = rid.get_indexer(ids[offsets[:-1] + chosen])  # the logged action's request
    known = pos >= 0
    acted_step = np.where(known, req["step"].fillna(0).astype(int).to_numpy()[np.maximum(pos, 0)], 0)
    acted_group = np.where(known, group_keys(req).to_numpy(object)[np.maximum(pos, 0)], None)
    return Decisions(x, true_rem, offsets, d["kind"].map(KINDS).to_numpy(np.int64), chosen,
                     d["propensity"].to_numpy(float), rewards, d["time_s"].to_numpy(float),
                     np.full(len(d), log_index, np.int64), acted_step.astype(np.int64), acted_group)


# ------------------------------------------------------------------------------------------ fitting


class RidgeQ:
    """The DR reward model: per decision kind, ridge regression of the reward on the chosen candidate's features."""

    def __init__(self, ridge: float) -> None:
        self.ridge = ridge
        self.coef: dict[int, np.ndarray] = {}

    @staticmethod
    def _design(x: np.ndarray) -> np.ndarray:
        return np.hstack([x.astype(np.float64), np.ones((len(x), 1))])

    def fit(self, data: Decisions) -> "RidgeQ":
        xc = data.x[data.offsets[:-1] + data.chosen]
        for k in (0, 1):
            m = data.kind == k
            if not m.any():
                self.coef[k] = np.zeros(xc.shape[1] + 2)  # weights of the design (features, 1), intercept
                continue
            A = self._design(xc[m])
            mu, sd = A.mean(0), A.std(0) + 1e-6
            mu[-1], sd[-1] = 0.0, 1.0
            Z = (A - mu) / sd
            w = np.linalg.solve(Z.T @ Z + self.ridge * np.eye(Z.shape[1]), Z.T @ data.reward[m])
            self.coef[k] = np.concatenate([w / sd, [-(w / sd) @ mu]])
        return self

    def predict_rows(self, x: np.ndarray, kind_rows: np.ndarray) -> np.ndarray:
        A = self._design(x)
        out = np.zeros(len(x))
        for k, c in self.coef.items():
            m = kind_rows == k
            out[m] = A[m] @ c[:-1] + c[-1]
        return out


def _segments(data: Decisions):
    seg = np.repeat(np.arange(len(data)), np.diff(data.offsets))
    return seg


def _segment_log_softmax(s, seg, n: int):
    """log softmax of ``s`` within each segment (candidate rows of one decision)."""
    import torch

    mx = torch.full((n,), -1e30).index_reduce(0, seg, s.detach(), "amax", include_self=True)
    e = torch.exp(s - mx[seg])
    z = torch.zeros(n).index_add(0, seg, e)
    return s - mx[seg] - torch.log(z[seg])


def fit_scorer(train: Decisions, config: OfflineConfig, progress: bool = False) -> tuple[Any, RidgeQ, dict]:
    """Fit the scorer (torch) on ``train`` with ``config.threads`` torch threads; returns (scorer, reward model,
    training metrics)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _fit(train, config, progress)
    finally:
        torch.set_num_threads(before)


def _fit(train: Decisions, config: OfflineConfig, progress: bool) -> tuple[Any, RidgeQ, dict]:
    import torch

    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    reward = train.reward.copy()
    true_rem = train.true_rem
    if config.shuffle_rewards:  # the control: every outcome permuted (rewards and hindsight labels)
        reward = rng.permutation(reward)
        true_rem = rng.permutation(true_rem)
    # standardised rewards per kind (the policy's objective is scale-free)
    rz = np.zeros_like(reward)
    for k in (0, 1):
        m = train.kind == k
        if m.any():
            rz[m] = (reward[m] - reward[m].mean()) / (reward[m].std() + 1e-9)
    data = replace(train, true_rem=true_rem, reward=rz)
    q = RidgeQ(config.ridge).fit(data)
    q_rows = q.predict_rows(data.x, data.kind[_segments(data)])
    scorer = build_scorer(len(FEATURES), config.hidden)
    x_all = torch.from_numpy(data.x)
    mean = x_all.mean(0)
    scale = x_all.std(0).clamp_min(1e-3)
    scorer.mean.copy_(mean)
    scorer.scale.copy_(scale)
    # imitation targets (admission only): listwise softmax of the true remaining output
    tr = np.nan_to_num(data.true_rem, nan=0.0)
    sign = 1.0 if config.oracle_rule == "lpt" else -1.0
    imit_logit = sign * np.log1p(np.maximum(tr, 0.0)) / config.imitation_temperature
    opt = torch.optim.Adam(scorer.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    D = len(data)
    metrics: dict[str, float] = {}
    ep_iter = range(config.epochs)
    if progress:
        from tqdm import tqdm

        ep_iter = tqdm(ep_iter, desc="train policy", leave=False)
    sizes = np.diff(data.offsets)
    ranges = [np.arange(data.offsets[i], data.offsets[i + 1]) for i in range(D)]
    x_t = torch.from_numpy(data.x)
    kind_t = torch.from_numpy(data.kind)
    p_t = torch.from_numpy(np.maximum(data.propensity, config.propensity_clip)).float()
    r_t = torch.from_numpy(data.reward).float()
    q_t = torch.from_numpy(q_rows).float()
    il_t = torch.from_numpy(imit_logit).float()
    for ep in ep_iter:
        perm = rng.permutation(D)
        tot_loss = tot_imit = tot_val = 0.0
        for b0 in range(0, D, config.batch_decisions):
            bidx = perm[b0:b0 + config.batch_decisions]
            nb = len(bidx)
            bs = sizes[bidx]
            rows = torch.from_numpy(np.concatenate([ranges[i] for i in bidx]))
            bseg = torch.from_numpy(np.repeat(np.arange(nb), bs))
            starts = np.concatenate([[0], np.cumsum(bs)[:-1]])
            first = torch.from_numpy(starts + data.chosen[bidx])
            bidx_t = torch.from_numpy(bidx)
            kind_b = kind_t[bidx_t]
            kind_r = kind_b[bseg]
            out = scorer(x_t[rows])
            s = torch.where(kind_r == 0, out[:, 0], out[:, 1]) / config.temperature
            logp = _segment_log_softmax(s, bseg, nb)
            pi = torch.exp(logp)
            w = pi[first] / p_t[bidx_t]
            r = r_t[bidx_t]
            if config.objective == "dr":
                qr = q_t[rows]
                v = torch.zeros(nb).index_add(0, bseg, pi * qr)
                value = (v + w * (r - qr[first])).mean()
            else:
                value = (w * r).mean()
            loss = -config.dr_weight * value
            imit = torch.zeros(())
            am = kind_r == 0
            if config.imitation_weight > 0 and bool(am.any()):
                qt = torch.exp(_segment_log_softmax(il_t[rows], bseg, nb))
                ce = torch.where(am, -(qt * logp), torch.zeros_like(logp))
                imit = ce.sum() / max(int((kind_b == 0).sum()), 1)
                loss = loss + config.imitation_weight * imit
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot_loss += float(loss.detach()) * nb
            tot_imit += float(imit.detach()) * nb
            tot_val += float(value.detach()) * nb
        metrics = {"train.loss": tot_loss / max(D, 1), "train.imitation_ce": tot_imit / max(D, 1),
                   "train.value_z": tot_val / max(D, 1), "train.epochs": float(ep + 1)}
    return scorer, q, metrics


def greedy_choice(scores: np.ndarray, data: Decisions) -> np.ndarray:
    """The greedy policy's action (index within each decision) from per-row scores of the decision's head."""
    out = np.empty(len(data), dtype=np.int64)
    for i in range(len(data)):
        a, b = data.offsets[i], data.offsets[i + 1]
        out[i] = int(np.argmax(scores[a:b]))
    return out


def row_scores(scorer_fn, data: Decisions) -> np.ndarray:
    """Each candidate row's score of its decision's head, with the numpy scorer."""
    seg = _segments(data)
    out = scorer_fn(data.x) if len(data.x) else np.zeros((0, 2))
    return np.where(data.kind[seg] == 0, out[:, 0], out[:, 1])


def evaluate_policy_on(scorer_fn, q: Optional[RidgeQ], data: Decisions, config: OfflineConfig,
                       n_boot: int = 500) -> dict[str, float]:
    """OPE of the greedy policy on ``data`` (raw rewards); ``ope.*`` keys."""
    from policy.ope import estimates

    if len(data) == 0:
        return {"ope.n": 0.0}
    s = row_scores(scorer_fn, data)
    act = greedy_choice(s, data)
    pi = (act == data.chosen).astype(float)
    seg = _segments(data)
    if q is not None:
        qr = q.predict_rows(data.x, data.kind[seg])
        q_logged = qr[data.offsets[:-1] + data.chosen]
        v = qr[data.offsets[:-1] + act]
    else:
        q_logged = v = None
    # block bootstrap: decisions of one reward window share their outcome
    groups = data.log * 10**9 + np.floor(data.time / config.reward_window_s).astype(np.int64)
    est = estimates(pi, data.propensity, data.reward, q_logged, v, clip=config.propensity_clip, groups=groups,
                    n_boot=n_boot, seed=config.seed)
    return {("behaviour.value" if k == "behaviour.value" else f"ope.{k}"): v for k, v in est.items()}


def ope_on_log(policy_dir: str | Path, log_dir: str | Path, config: OfflineConfig | None = None,
               n_boot: int = 500) -> dict[str, float]:
    """OPE of the greedy policy in ``policy_dir`` on one held-out log (``ope.*`` keys and ``behaviour.value``).

    The DR reward model is fitted on the log itself (ridge on the logged actions' features).
    """
    policy = LearnedPolicy.load(policy_dir)
    config = config or OfflineConfig()
    data = load_decisions(log_dir, policy.predictor, config)
    return evaluate_policy_on(policy.scorer, RidgeQ(config.ridge).fit(data), data, config, n_boot=n_boot)


#: How :func:`train_policy` holds decisions out (its manifest's ``trained_on.split``), as printed.
SPLITS = {"log": "log (the last log directory)", "time": "time (the last decisions of the log)",
          "group": "GRPO group (the logs hold one RL step; the groups of the logged actions)"}


def heldout_split(data: Decisions, n_logs: int) -> str:
    """How to hold decisions out: by ``log`` with several logs; with one, by ``time`` when it spans several RL
    steps, else by ``group`` (a clear error when the one step's decisions all act on one GRPO group)."""
    if n_logs > 1:
        return "log"
    if len(np.unique(data.step)) > 1:
        return "time"
    groups = np.unique(data.group.astype(str))
    if len(groups) < 2:
        raise ValueError(f"the logs hold one RL step ({int(data.step[0])}) whose decisions all act on one GRPO group "
                         f"({groups[0]}): a held-out split needs 2 groups or 2 steps (requests column group_id)")
    return "group"


def heldout_mask(data: Decisions, split: str, holdout_fraction: float, n_logs: int) -> np.ndarray:
    """The held-out decisions of ``split``: the last of ``n_logs`` logs, the last ``holdout_fraction`` by time, or
    the decisions acting on the last ``holdout_fraction`` of the groups (by their first decision)."""
    if split == "log":
        return data.log == n_logs - 1
    if split == "time":
        return data.time > np.quantile(data.time, 1.0 - holdout_fraction)
    g = data.group.astype(str)
    first = pd.Series(data.time).groupby(g).min().sort_values(kind="stable")
    k = max(1, round(holdout_fraction * len(first)))
    return np.isin(g, first.index[-k:].to_numpy())


def logged_levers(log_dirs: Sequence[Path], data: "Decisions") -> dict[str, bool]:
    """Which levers the logs exercised: ``preempt`` (preemption decisions to learn from) and ``offload`` (a CPU
    offload tier: some ``steps`` row stored blocks to it)."""
    from data.io import read_telemetry

    tier = False
    for log in log_dirs:
        try:
            steps = read_telemetry(_telemetry_dir(log), "steps", ["offload_stored_blocks"])
        except Exception:  # noqa: BLE001 - logs from before the tier's columns: no tier
            continue
        if steps.num_rows and sum(v or 0 for v in steps.column("offload_stored_blocks").to_pylist()) > 0:
            tier = True
            break
    return {"preempt": bool(np.any(data.kind == KINDS["preempt"])), "offload": tier}


def train_policy(
    log_dirs: Sequence[Path],
    predictors_dir: Path,
    out_dir: Path,
    config: OfflineConfig | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Fit the learned policy from ``log_dirs`` and write POLICY_DIR ``out_dir``; returns flat metrics."""
    from policy.learned import _read_predictor
    from predictors.logs import existing_logs

    t0 = time.perf_counter()
    config = config or OfflineConfig()
    log_dirs = existing_logs(log_dirs)
    if not log_dirs:
        raise ValueError("no logs given")
    predictors_dir = Path(predictors_dir)
    length_model = _read_predictor(predictors_dir)
    rng = np.random.default_rng(config.seed)
    parts = [load_decisions(p, length_model, config, i, rng) for i, p in enumerate(log_dirs)]
    data = Decisions.concat(parts)
    if len(data) == 0:
        raise ValueError(f"no usable decisions (admit/preempt with >= 2 candidates) in {[str(p) for p in log_dirs]}")
    split = heldout_split(data, len(log_dirs))
    test_mask = heldout_mask(data, split, config.holdout_fraction, len(log_dirs))
    if test_mask.all() or not test_mask.any():
        test_mask = np.zeros(len(data), bool)
        test_mask[int(len(data) * (1 - config.holdout_fraction)):] = True
    train, test = data.subset(np.nonzero(~test_mask)[0]), data.subset(np.nonzero(test_mask)[0])
    t_load = time.perf_counter() - t0
    scorer, _, metrics = fit_scorer(train, config, progress=progress)
    from policy.learned import NumpyScorer

    state = {k: v.detach().cpu().numpy() for k, v in scorer.state_dict().items()}
    fn = NumpyScorer(state)
    q_train = RidgeQ(config.ridge).fit(train)  # DR's reward model in raw units, fitted on the training split
    metrics.update(evaluate_policy_on(fn, q_train, test, config))
    cfg = asdict(config)
    cfg["hidden"] = list(config.hidden)
    levers = logged_levers(log_dirs, data)
    runtime = {**RUNTIME_DEFAULTS, **config.runtime, "temperature": config.temperature,
               "preempt": levers["preempt"] if config.preempt is None else config.preempt,
               "offload": levers["offload"] if config.offload is None else config.offload}
    cfg["preempt"], cfg["offload"] = runtime["preempt"], runtime["offload"]
    cfg["runtime"] = runtime
    trained_on = {"logs": [str(p) for p in log_dirs], "predictors": str(predictors_dir), "split": split,
                  "decisions_train": int(len(train)), "decisions_test": int(len(test)),
                  "candidate_rows": int(len(data.x))}
    policy = LearnedPolicy(state, length_model, manifest={"config": cfg, "trained_on": trained_on},
                           predictors_dir=predictors_dir, **runtime)
    policy.save(out_dir)
    metrics.update({"data.decisions_train": float(len(train)), "data.decisions_test": float(len(test)),
                    "data.load_s": t_load, "train.total_s": time.perf_counter() - t0})
    (Path(out_dir) / "metrics.json").write_text(json.dumps({**metrics, "split": split}, indent=2, default=float))
    return {k: (float(v) if v is not None and not (isinstance(v, float) and math.isnan(v)) else float("nan"))
            for k, v in metrics.items()}
