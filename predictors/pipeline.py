"""Train and evaluate both predictors on telemetry logs, with baselines, split by RL step.

A model directory (``Bundle.save``) holds ``length/``, ``reuse/`` and ``session/``
(each a model with its manifest, see :mod:`predictors.model_io`; ``reuse/`` and
``session/`` are optional, and a directory without them still loads), ``baselines.json``
(the baselines fitted on the same training steps, so ``eval`` compares like with
like) and ``report.json`` (the held-out report of training).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from predictors import metrics
from predictors.features import LENGTH_CATEGORICAL, REUSE_CATEGORICAL, Vocab, length_features, reuse_rows
from predictors.length import DomainMeanBaseline, LengthModel, PromptHistoryBaseline
from predictors.logs import split_heldout
from predictors.model_io import DEFAULT_TREES
from predictors.reuse import BinnedRate, ReuseModel, reuse_baselines
from predictors.session import SessionModel, session_ok, session_report
from predictors.session_features import SESSION_CATEGORICAL, session_rows


@dataclass
class Bundle:
    length: LengthModel
    reuse: ReuseModel | None
    length_baselines: list = field(default_factory=list)
    reuse_baselines: list = field(default_factory=list)
    report: dict = field(default_factory=dict)
    session: SessionModel | None = None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.length.save(path / "length")
        if self.reuse is not None:
            self.reuse.save(path / "reuse")
        if self.session is not None:
            self.session.save(path / "session")
        b = {"length": {x.name: x.to_json() for x in self.length_baselines},
             "reuse": {x.name: x.to_json() for x in self.reuse_baselines}}
        (path / "baselines.json").write_text(json.dumps(b))
        (path / "report.json").write_text(json.dumps(self.report, indent=2, default=float))
        return path

    @classmethod
    def load(cls, path: str | Path, num_threads: int = 1, compiled: bool = True) -> Bundle:
        """The bundle saved in model directory ``path`` (:class:`FileNotFoundError` when there is none)."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"no such model directory: {path}")
        length = LengthModel.load(path / "length", num_threads=num_threads, compiled=compiled)
        reuse = (ReuseModel.load(path / "reuse", num_threads=num_threads, compiled=compiled)
                 if (path / "reuse").exists() else None)
        session = (SessionModel.load(path / "session", num_threads=num_threads, compiled=compiled)
                   if (path / "session").exists() else None)
        lb, rb = [], []
        bfile = path / "baselines.json"
        if bfile.is_file():
            b = json.loads(bfile.read_text())
            kinds = {"domain_mean": DomainMeanBaseline, "prompt_history": PromptHistoryBaseline}
            lb = [kinds[k].from_json(v) for k, v in b.get("length", {}).items() if k in kinds]
            rb += [BinnedRate.from_json(v) for v in b.get("reuse", {}).values()]
        return cls(length, reuse, lb, rb, session=session)


def length_eval_rows(df: pd.DataFrame, vocab: Vocab) -> pd.DataFrame:
    """Evaluation rows: finished requests at admission time."""
    X = length_features(df, at="admit", vocab=vocab)
    return X[X["done"]].reset_index(drop=True)


def evaluate_length(model: LengthModel, baselines: Sequence, X: pd.DataFrame, df: pd.DataFrame) -> dict:
    cells = pd.DataFrame({"step": X["step"].to_numpy(), "domain": X["domain_name"].to_numpy()})
    y = X["output_tokens"].to_numpy(float)
    pred = model.predict_features(X)
    rep = metrics.length_report(y, pred[:, 0], pred[:, 1], cells)
    rep["baselines"] = {}
    for b in baselines:
        p = b.predict(X)
        rep["baselines"][b.name] = metrics.length_report(y, p[:, 0], p[:, 1], cells)
    # hindsight reference (not a predictor): the true mean log length of the other members of the group & turn
    sub = df.set_index("request_id").loc[X["request_id"], ["group_id", "turn", "y"]].reset_index()
    g = sub.groupby(["group_id", "turn"])["y"]
    s, n = g.transform("sum").to_numpy(float), g.transform("count").to_numpy(float)
    ref = np.where(n > 1, (s - sub["y"].to_numpy(float)) / np.maximum(n - 1, 1), np.nan)
    ref = np.where(np.isnan(ref), -1.0, ref)
    oracle = metrics.kendall_within(y, ref, cells)
    rep["reference_group_oracle_tau"] = oracle["kendall_tau"]
    rep["reference_group_oracle_tau_per_domain"] = metrics._per_domain(oracle["per_cell"])
    return rep


def evaluate_reuse(model: ReuseModel, baselines: Sequence, R: pd.DataFrame) -> dict:
    y = R["hit"].to_numpy(float)
    p = model.predict_features(R)
    rep = metrics.reuse_report(y, p[:, 0])
    rep["horizon_s"] = model.horizon_s
    fin = np.isfinite(R["tnext"].to_numpy(float))
    if fin.any():
        t = R["tnext"].to_numpy(float)[fin]
        rep["tnext_mae_log1p"] = metrics.mae(np.log1p(t), np.log1p(p[fin, 1]))
    rep["baselines"] = {b.name: metrics.reuse_report(y, b.predict(R)) for b in baselines}
    return rep


#: At most this many training rows per model (a seeded random sample beyond it); LightGBM's
#: cost is linear in rows and the quantiles stop moving long before.
MAX_TRAIN_ROWS = 250_000
#: At most this many reuse snapshots are built (train and test together, a seeded sample).
MAX_REUSE_SNAPSHOTS = 1_000_000


def _cap(frame: pd.DataFrame, max_rows: int | None) -> pd.DataFrame:
    if max_rows is None or len(frame) <= max_rows:
        return frame
    return frame.sample(n=max_rows, random_state=0)


def train_bundle(df: pd.DataFrame, *, test_steps: Sequence[int] | None = None, horizon_s: float = 10.0,
                 num_trees: int = DEFAULT_TREES, num_threads: int = 2, reuse: bool = True,
                 max_train_rows: int | None = MAX_TRAIN_ROWS, session: bool = True) -> Bundle:
    """Fit on the training requests, report on the held-out ones: whole RL steps, or whole GRPO groups when the
    logs hold one RL step (:func:`predictors.logs.split_heldout`; the report's ``split`` says which), never rows.

    ``session``: also the session models, when the training part has a multi-turn session (else the report
    says why they were skipped)."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    split = split_heldout(df, test_steps)
    train_mask, test_mask = split.train, split.test
    train_steps = sorted(df.loc[train_mask, "step"].unique().tolist())
    held_steps = sorted(df.loc[test_mask, "step"].unique().tolist())
    train_ids = set(df.loc[train_mask, "request_id"])
    held_ids = set(df.loc[test_mask, "request_id"])
    lvocab = Vocab.fit(df[train_mask], LENGTH_CATEGORICAL)
    feats = [length_features(df, at=a, vocab=lvocab) for a in ("arrival", "admit")]
    Xall = pd.concat(feats, ignore_index=True)
    Xall = Xall[Xall["done"]].drop_duplicates(subset=["request_id", *LengthModel.features])
    Xtr = _cap(Xall[Xall["request_id"].isin(train_ids)], max_train_rows)
    timings["length_features_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    lm = LengthModel.fit_features(Xtr, lvocab, num_trees=num_trees, num_threads=num_threads)
    timings["length_fit_s"] = time.perf_counter() - t1
    Xtr_eval = feats[1][feats[1]["done"] & feats[1]["request_id"].isin(train_ids)]
    lbs = [DomainMeanBaseline().fit(Xtr_eval), PromptHistoryBaseline().fit(Xtr_eval)]
    Xte = feats[1][feats[1]["done"] & feats[1]["request_id"].isin(held_ids)].reset_index(drop=True)
    report: dict[str, Any] = {"split": split.by, "split_note": split.describe(df), "train_steps": train_steps,
                              "test_steps": held_steps, "length": evaluate_length(lm, lbs, Xte, df)}
    report["length"]["train_rows"] = len(Xtr)
    report["telemetry_rows"] = len(df)
    rm, rbs = None, []
    if reuse:
        t2 = time.perf_counter()
        rvocab = Vocab.fit(df[train_mask], REUSE_CATEGORICAL)
        R = reuse_rows(df, horizon_s=horizon_s, vocab=rvocab, max_rows=MAX_REUSE_SNAPSHOTS)
        Rtr, Rte = R[R["request_id"].isin(train_ids)], R[R["request_id"].isin(held_ids)].reset_index(drop=True)
        Rtr = _cap(Rtr, max_train_rows)
        timings["reuse_features_s"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        rm = ReuseModel.fit_rows(Rtr, rvocab, horizon_s=horizon_s, num_trees=num_trees, num_threads=num_threads)
        timings["reuse_fit_s"] = time.perf_counter() - t3
        rbs = [b.fit(Rtr) for b in reuse_baselines()]
        report["reuse"] = evaluate_reuse(rm, rbs, Rte)
        report["reuse"]["train_rows"] = len(Rtr)
    sm = None
    if session:
        t4 = time.perf_counter()
        svocab = Vocab.fit(df[train_mask], SESSION_CATEGORICAL)
        S = session_rows(df, svocab)
        Str, Ste = S[S["request_id"].isin(train_ids)], S[S["request_id"].isin(held_ids)].reset_index(drop=True)
        if (Str["cont"] > 0).any():
            sm = SessionModel.fit_rows(_cap(Str, max_train_rows), svocab, num_trees=num_trees, num_threads=num_threads)
            report["session"] = session_report(sm, Ste)
            report["session"]["train_rows"] = len(Str)
        else:
            report["session"] = {"skipped": "no multi-turn session in the training part"}
        timings["session_s"] = time.perf_counter() - t4
    timings["total_s"] = time.perf_counter() - t0
    report["timings"] = timings
    return Bundle(lm, rm, lbs, rbs, report, session=sm)


def evaluate_bundle(bundle: Bundle, df: pd.DataFrame, steps: Sequence[int] | None = None) -> dict:
    """Report a saved bundle on logs (all steps, or ``steps``)."""
    X = length_eval_rows(df, bundle.length.vocab)
    if steps is not None:
        held = sorted(X["step"].unique().tolist())
        X = X[X["step"].isin(list(steps))].reset_index(drop=True)
        if X.empty:
            raise ValueError(f"steps {', '.join(map(str, steps))}: the logs hold no request of them "
                             f"(their steps: {', '.join(map(str, held)) or 'none'})")
    report: dict[str, Any] = {"steps": sorted(X["step"].unique().tolist()),
                              "length": evaluate_length(bundle.length, bundle.length_baselines, X, df)}
    if bundle.reuse is not None:
        R = reuse_rows(df, horizon_s=bundle.reuse.horizon_s, vocab=bundle.reuse.vocab, max_rows=MAX_REUSE_SNAPSHOTS)
        if steps is not None:
            R = R[R["step"].isin(list(steps))].reset_index(drop=True)
        report["reuse"] = evaluate_reuse(bundle.reuse, bundle.reuse_baselines, R)
    if bundle.session is not None:
        S = session_rows(df, bundle.session.vocab)
        if steps is not None:
            S = S[S["step"].isin(list(steps))].reset_index(drop=True)
        report["session"] = session_report(bundle.session, S)
    return report


def tau_ratios(L: dict) -> dict[str, float]:
    """The length model's Kendall tau over the group oracle's, overall and per domain (NaN where the oracle is 0)."""
    def ratio(a: float, b: float) -> float:
        return a / b if b and b == b and b > 0 else float("nan")

    out = {"overall": ratio(L["kendall_tau"], L["reference_group_oracle_tau"])}
    per = L.get("reference_group_oracle_tau_per_domain", {})
    for d, t in L["kendall_tau_per_domain"].items():
        if d in per:
            out[d] = ratio(t, per[d])
    return out


def render_session(S: dict) -> list[str]:
    """The session models' table: each model beside its baseline."""
    if "skipped" in S:
        return [f"session models skipped: {S['skipped']}"]
    ok = session_ok(S)
    c, tl, tr, nu = S["continue"], S["tool_latency"], S["turns_remaining"], S["next_use"]
    mark = {True: "beats", False: "does not beat"}
    lines = [f"session models ({S['n_turns']} held-out turns, {S['n_calls']} tool calls)",
             f"  {'model':<28}{'metric':<14}{'lightgbm':>10}{'baseline':>10}  (which baseline)",
             f"  {'tool latency (s)':<28}{'MAE':<14}{tl['model']['mae']:>10.3f}{tl['tool_median']['mae']:>10.3f}"
             f"  tool_median ({mark[ok['tool_latency']]})",
             f"  {'':<28}{'median AE':<14}{tl['model']['median_ae']:>10.3f}{tl['tool_median']['median_ae']:>10.3f}",
             f"  {'continue (P)':<28}{'AUC':<14}{c['model']['auc']:>10.3f}{c['turn_count_prior']['auc']:>10.3f}"
             f"  turn_count_prior ({mark[ok['continue']]})",
             f"  {'':<28}{'log loss':<14}{c['model']['log_loss']:>10.4f}{c['turn_count_prior']['log_loss']:>10.4f}",
             f"  {'turns remaining':<28}{'MAE':<14}{tr['model']['mae']:>10.3f}{tr['turn_count_prior']['mae']:>10.3f}"
             f"  turn_count_prior ({mark[ok['turns_remaining']]})",
             f"  {'time to next use (s)':<28}{'MAE':<14}{nu['model']['mae']:>10.3f}{nu['tool_median']['mae']:>10.3f}"
             f"  tool_median latency alone ({mark[ok['next_use']]})",
             f"  {'':<28}{'median AE':<14}{nu['model']['median_ae']:>10.3f}{nu['tool_median']['median_ae']:>10.3f}"]
    for d, v in c.get("per_domain", {}).items():
        lines.append(f"  continue on {d} (n={v['n']}): AUC {v['model']['auc']:.3f}"
                     f" vs {v['turn_count_prior']['auc']:.3f}"
                     f", log loss {v['model']['log_loss']:.4f} vs {v['turn_count_prior']['log_loss']:.4f}")
    return lines


def render_report(report: dict) -> str:
    """The metrics tables as text."""
    lines = []
    if "split_note" in report:
        lines.append(report["split_note"])
    elif "train_steps" in report:
        lines.append(f"train steps {report['train_steps']}  ->  test steps {report['test_steps']}")
    L = report.get("length")
    if L:
        lines.append("")
        lines.append(f"length (output tokens per turn, {L['n']} held-out requests at admission)")
        lines.append(f"  {'model':<16}{'tau(step,dom)':>14}{'MAE':>10}{'pinball p50':>13}{'pinball p90':>13}")
        rows = [("lightgbm", L)] + list(L.get("baselines", {}).items())
        for name, r in rows:
            lines.append(f"  {name:<16}{r['kendall_tau']:>14.3f}{r['mae']:>10.1f}{r['pinball_p50']:>13.1f}"
                         f"{r['pinball_p90']:>13.1f}")
        taus = "  ".join(f"{d} {t:.3f}" for d, t in L["kendall_tau_per_domain"].items())
        lines.append(f"  lightgbm tau per domain: {taus}")
        if "reference_group_oracle_tau" in L:
            lines.append(f"  hindsight reference (true mean of the other group members): tau "
                         f"{L['reference_group_oracle_tau']:.3f}")
            lines.append("  tau / group oracle: " + "  ".join(f"{k} {v:.2f}" for k, v in tau_ratios(L).items()))
    R = report.get("reuse")
    if R:
        lines.append("")
        lines.append(f"reuse (P(next use within {R['horizon_s']:g} s), {R['n']} held-out prefix snapshots, "
                     f"positive rate {R['positive_rate']:.3f})")
        lines.append(f"  {'model':<16}{'AUC':>8}{'Brier':>9}")
        for name, r in [("lightgbm", R)] + list(R.get("baselines", {}).items()):
            lines.append(f"  {name:<16}{r['auc']:>8.3f}{r['brier']:>9.4f}")
        lines.append("  reliability (lightgbm): " + "  ".join(
            f"{b['bin']}: {b['predicted']:.2f}/{b['observed']:.2f} (n={b['n']})" for b in R["reliability"]))
    S = report.get("session")
    if S:
        lines.append("")
        lines.extend(render_session(S))
    if "timings" in report:
        lines.append("")
        lines.append("timings: " + ", ".join(f"{k} {v:.2f}" for k, v in report["timings"].items()))
    return "\n".join(lines)
