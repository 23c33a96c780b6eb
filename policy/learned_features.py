"""The learned policy's input: one feature row per candidate, the same online and offline.

Online (:mod:`policy.learned`) the raw values come from
:class:`policy.interface.CandidateRequest`, the length predictor and the
:class:`policy.interface.EngineState`; offline (:mod:`policy.offline`) from a
``decisions`` row's logged :data:`policy.interface.CANDIDATE_FEATURES`, the
length predictor replayed on the ``requests`` table, and the ``steps`` row of
the decision's engine step. Both fill a :data:`RAW` matrix and call
:func:`model_features`, so the scorer never sees two definitions.
"""

from __future__ import annotations

import numpy as np

#: Raw per-candidate values (NaN where unknown), in order.
RAW: tuple[str, ...] = (
    "prompt_tokens", "computed_tokens", "output_tokens", "max_tokens", "turn", "group_size", "group_finished",
    "group_running", "wait_s", "preemptions", "is_running", "pred_p50", "pred_p90",
    # engine state (the same for every candidate of a decision)
    "kv_usage", "pinned_frac", "num_running", "num_waiting", "step_phase",
)
R = {name: i for i, name in enumerate(RAW)}

#: The scorer's input features, in order (the POLICY_DIR manifest's ``feature_schema``).
FEATURES: tuple[str, ...] = (
    "log_prompt_tokens", "log_output_tokens", "log_computed_tokens", "log_max_tokens", "turn", "log_group_size",
    "group_done_frac", "group_running_frac", "log_wait_s", "log_preemptions", "is_running",
    "log_pred_p50", "log_pred_p90", "log_pred_remaining", "log_pred_final_context", "rel_pred_remaining",
    "rank_pred_remaining", "kv_usage", "pinned_frac", "log_num_running", "log_num_waiting", "step_phase",
)


def remaining(p50: np.ndarray, p90: np.ndarray, generated: np.ndarray, max_tokens: np.ndarray) -> np.ndarray:
    """Predicted output still to come (vectorised :func:`policy.baselines._common.remaining_tokens`)."""
    r = np.where(generated < p50, p50 - generated, np.where(generated < p90, p90 - generated,
                                                             np.maximum(p90 - p50, 1.0)))
    cap = np.where(max_tokens > 0, np.maximum(max_tokens - generated, 0.0), np.inf)
    return np.minimum(r, cap)


def model_features(raw: np.ndarray) -> np.ndarray:
    """(n, len(FEATURES)) float32 scorer input of one decision's candidates from their (n, len(RAW)) raw values."""
    raw = np.asarray(raw, dtype=np.float64)
    n = raw.shape[0]
    x = np.empty((n, len(FEATURES)), dtype=np.float64)
    c = lambda k: raw[:, R[k]]  # noqa: E731
    l1p = lambda v: np.log1p(np.maximum(np.nan_to_num(v, nan=0.0), 0.0))  # noqa: E731
    out = c("output_tokens")
    mx = np.nan_to_num(c("max_tokens"), nan=0.0)
    p50 = c("pred_p50")
    p90 = c("pred_p90")
    # an unknown prediction: the request's remaining budget (as the baselines do)
    p50 = np.where(np.isfinite(p50), p50, np.where(mx > 0, mx, 1024.0))
    p90 = np.maximum(np.where(np.isfinite(p90), p90, p50), p50)
    rem = remaining(p50, p90, out, mx)
    rem = np.where(np.isfinite(rem), rem, p90)
    gs = c("group_size")
    gsz = np.where(np.isfinite(gs) & (gs > 0), gs, np.nan)
    x[:, 0] = l1p(c("prompt_tokens"))
    x[:, 1] = l1p(out)
    x[:, 2] = l1p(c("computed_tokens"))
    x[:, 3] = l1p(mx)
    x[:, 4] = np.minimum(np.nan_to_num(c("turn"), nan=0.0), 16.0)
    x[:, 5] = l1p(gs)
    x[:, 6] = np.nan_to_num(c("group_finished") / gsz, nan=0.0)
    x[:, 7] = np.nan_to_num(c("group_running") / gsz, nan=0.0)
    x[:, 8] = l1p(c("wait_s"))
    x[:, 9] = l1p(c("preemptions"))
    x[:, 10] = np.nan_to_num(c("is_running"), nan=0.0)
    x[:, 11] = np.log1p(p50)
    x[:, 12] = np.log1p(p90)
    lr = np.log1p(rem)
    x[:, 13] = lr
    x[:, 14] = l1p(c("prompt_tokens") + out + rem)
    x[:, 15] = lr - (lr.max() if n else 0.0)
    x[:, 16] = (np.argsort(np.argsort(lr, kind="stable"), kind="stable") / max(n - 1, 1)) if n else lr
    x[:, 17] = np.nan_to_num(c("kv_usage"), nan=0.0)
    x[:, 18] = np.nan_to_num(c("pinned_frac"), nan=0.0)
    x[:, 19] = l1p(c("num_running"))
    x[:, 20] = l1p(c("num_waiting"))
    x[:, 21] = np.nan_to_num(c("step_phase"), nan=0.0)
    return x.astype(np.float32)
