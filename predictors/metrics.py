"""Quality metrics of the predictors: pinball loss, MAE, Kendall tau within cells, AUC, Brier, reliability."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy.stats import kendalltau
from sklearn.metrics import roc_auc_score


def pinball(y: np.ndarray, q: np.ndarray, alpha: float) -> float:
    """Mean pinball (quantile) loss of predictions ``q`` of the ``alpha`` quantile of ``y``."""
    d = np.asarray(y, float) - np.asarray(q, float)
    return float(np.mean(np.maximum(alpha * d, (alpha - 1) * d)))


def mae(y: np.ndarray, p: np.ndarray) -> float:
    return float(np.mean(np.abs(np.asarray(y, float) - np.asarray(p, float))))


def kendall_within(y: np.ndarray, p: np.ndarray, cells: pd.DataFrame, min_n: int = 3) -> dict:
    """Kendall tau-b of ``p`` against ``y`` inside each cell (e.g. step x domain).

    ``kendall_tau`` is the mean over cells weighted by their pair counts (what an
    ordering inside a cell gets right); a cell whose predictions are all tied
    scores 0. ``per_cell`` lists each cell's tau and size.
    """
    frame = cells.copy().reset_index(drop=True)
    frame["_y"], frame["_p"] = np.asarray(y, float), np.asarray(p, float)
    keys = list(cells.columns)
    total_w, total = 0.0, 0.0
    per = []
    for key, g in frame.groupby(keys, sort=True):
        n = len(g)
        if n < min_n:
            continue
        if g["_p"].nunique() < 2 or g["_y"].nunique() < 2:
            tau = 0.0
        else:
            tau = float(kendalltau(g["_p"], g["_y"]).statistic)
            tau = 0.0 if math.isnan(tau) else tau
        w = n * (n - 1) / 2
        total += w * tau
        total_w += w
        per.append({"cell": [str(k) for k in (key if isinstance(key, tuple) else (key,))], "n": n, "tau": tau})
    return {"kendall_tau": total / total_w if total_w else float("nan"), "per_cell": per}


def brier(y: np.ndarray, p: np.ndarray) -> float:
    return float(np.mean((np.asarray(p, float) - np.asarray(y, float)) ** 2))


def auc(y: np.ndarray, p: np.ndarray) -> float:
    y = np.asarray(y)
    if len(np.unique(y)) < 2:
        return float("nan")
    return float(roc_auc_score(y, p))


def reliability(y: np.ndarray, p: np.ndarray, bins: int = 10) -> list[dict]:
    """Reliability table: per probability bin, rows, mean predicted and observed frequency."""
    y, p = np.asarray(y, float), np.asarray(p, float)
    edges = np.linspace(0, 1, bins + 1)
    idx = np.clip(np.digitize(p, edges[1:-1]), 0, bins - 1)
    out = []
    for b in range(bins):
        m = idx == b
        if m.any():
            out.append({"bin": f"{edges[b]:.1f}-{edges[b + 1]:.1f}", "n": int(m.sum()),
                        "predicted": float(p[m].mean()), "observed": float(y[m].mean())})
    return out


def length_report(y_tokens: np.ndarray, p50: np.ndarray, p90: np.ndarray, cells: pd.DataFrame) -> dict:
    """MAE (p50 vs truth, tokens), pinball p50 / p90 (tokens) and Kendall tau within cells."""
    kt = kendall_within(y_tokens, p50, cells)
    return {
        "n": len(y_tokens),
        "mae": mae(y_tokens, p50),
        "pinball_p50": pinball(y_tokens, p50, 0.5),
        "pinball_p90": pinball(y_tokens, p90, 0.9),
        "kendall_tau": kt["kendall_tau"],
        "kendall_tau_per_domain": _per_domain(kt["per_cell"]),
    }


def _per_domain(per_cell: list[dict]) -> dict:
    acc: dict[str, list[float]] = {}
    for c in per_cell:
        d = c["cell"][-1]
        w = c["n"] * (c["n"] - 1) / 2
        a = acc.setdefault(d, [0.0, 0.0])
        a[0] += w * c["tau"]
        a[1] += w
    return {d: (a[0] / a[1] if a[1] else float("nan")) for d, a in sorted(acc.items())}


def reuse_report(y: np.ndarray, p: np.ndarray) -> dict:
    return {"n": len(y), "positive_rate": float(np.mean(y)) if len(y) else float("nan"),
            "auc": auc(y, p), "brier": brier(y, p), "reliability": reliability(y, p)}
