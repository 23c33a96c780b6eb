"""The offline learner: fit the scorer on logged decisions, and estimate the greedy policy's value off-policy.

**Objective** (minimised, :class:`policy.learning.config.OfflineConfig` holds every weight):

* imitation of the hindsight oracle (admission only): a listwise cross-entropy
  towards ``softmax(log1p(true remaining output) / imitation_temperature)``,
  longest first (LPT, the makespan rule; ``oracle_rule="srpt"`` flips it).
  True lengths come from the same logs' ``requests`` table, in hindsight;
* minus the off-policy value of the softmax policy ``pi = softmax(score /
  temperature)``: doubly robust (``objective="dr"``: a ridge reward model on
  the candidate features gives ``q``) or IPS, with propensities clipped at
  ``propensity_clip``; rewards are standardised per decision kind;
* L2 on the weights.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import numpy as np

from policy.learned.features import FEATURES
from policy.learned.scorer import build_scorer
from policy.learning.config import OfflineConfig
from policy.learning.data import Decisions

__all__ = ["RidgeQ", "fit_scorer", "greedy_choice", "row_scores", "evaluate_policy_on"]


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

    mx = torch.full((n,), -1e30).scatter_reduce(0, seg, s.detach(), "amax", include_self=True)  # (not beta)
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
    from policy.learning.ope import estimates

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
