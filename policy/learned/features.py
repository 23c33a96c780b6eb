"""The learned policy's input: one feature row per candidate, the same online and offline.

Online (:mod:`policy.learned.policy`) the raw values come from
:class:`policy.interface.CandidateRequest`, the length predictor and the
:class:`policy.interface.EngineState`; offline (:mod:`policy.learning.data`) from a
``decisions`` row's logged :data:`policy.interface.CANDIDATE_FEATURES`, the
length predictor replayed on the ``requests`` table, and the ``steps`` row of
the decision's engine step. Both use the same three parts: :func:`row_features`
(per request), :func:`step_features` (per engine step) and :func:`set_features`
(per candidate set); offline calls them through :func:`model_features`, online
:mod:`policy.learned.table` keeps the per-request part between steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from policy.common import remaining_tokens
from policy.learned.sorting import ascending, queue_keys

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
#: Each feature's column in the scorer's input.
X = {name: i for i, name in enumerate(FEATURES)}


def columns(*names: str) -> slice:
    """The scorer input's columns of the features ``names`` as one slice (a view); they must be adjacent, in order."""
    start = X[names[0]]
    if [X[k] for k in names] != list(range(start, start + len(names))):
        raise ValueError(f"features {names} are not adjacent in FEATURES")
    return slice(start, start + len(names))


#: The engine state's raw values (the same for every candidate of a decision), in :func:`step_features`'s order.
ENGINE_RAW: tuple[str, ...] = ("kv_usage", "pinned_frac", "num_running", "num_waiting")
#: Their feature columns; the first two (the usage fractions) enter as they are, the counts as ``log1p``.
ENGINE_X = columns("kv_usage", "pinned_frac", "log_num_running", "log_num_waiting")
USAGE_X = columns("kv_usage", "pinned_frac")
WAIT_X = X["log_wait_s"]


def remaining(p50: np.ndarray, p90: np.ndarray, generated: np.ndarray, max_tokens: np.ndarray) -> np.ndarray:
    """Predicted output still to come (vectorised :func:`policy.common.remaining_tokens`)."""
    r = np.where(generated < p50, p50 - generated, np.where(generated < p90, p90 - generated,
                                                             np.maximum(p90 - p50, 1.0)))
    cap = np.where(max_tokens > 0, np.maximum(max_tokens - generated, 0.0), np.inf)
    return np.minimum(r, cap)


def _nan0(v: np.ndarray) -> np.ndarray:
    """``np.nan_to_num(v, nan=0.0)`` (not a copy when every value is finite: numpy's own call costs more than
    the check, and this runs per decision)."""
    return v if np.isfinite(v).all() else np.nan_to_num(v, nan=0.0)


def _log(v: np.ndarray) -> np.ndarray:
    return np.log1p(np.maximum(_nan0(v), 0.0))


#: Per-request raw values that enter the scorer as ``log1p(max(nan_to_num(v), 0))``, each as the feature ``log_<name>``.
_LOG_NAMES = ("prompt_tokens", "output_tokens", "computed_tokens", "max_tokens", "group_size", "preemptions")
_LOG_RAW = [R[k] for k in _LOG_NAMES]
_LOG_X = [X[f"log_{k}"] for k in _LOG_NAMES]
_GROUP_RAW = [R["group_finished"], R["group_running"]]
_GROUP_X = [X["group_done_frac"], X["group_running_frac"]]
#: Feature columns that change in every engine step (wait time, engine state, RL step phase): :func:`step_features`.
STEP_X = tuple(X[k] for k in ("log_wait_s", "kv_usage", "pinned_frac", "log_num_running", "log_num_waiting",
                              "step_phase"))
#: Feature columns that depend on the whole decision's candidate set: :func:`set_features`.
SET_X = _REL, _RANK = X["rel_pred_remaining"], X["rank_pred_remaining"]


def _predicted(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(p50, p90, output so far, predicted remaining output) of each raw row, unknown predictions filled in."""
    out = raw[:, R["output_tokens"]]
    mx = _nan0(raw[:, R["max_tokens"]])
    p50 = raw[:, R["pred_p50"]]
    p90 = raw[:, R["pred_p90"]]
    # an unknown prediction: the request's remaining budget (as the baselines do)
    p50 = np.where(np.isfinite(p50), p50, np.where(mx > 0, mx, 1024.0))
    p90 = np.maximum(np.where(np.isfinite(p90), p90, p50), p50)
    rem = remaining(p50, p90, out, mx)
    return p50, p90, out, np.where(np.isfinite(rem), rem, p90)


def log_remaining(raw: np.ndarray) -> np.ndarray:
    """``log1p(predicted remaining output)`` of each raw row: :func:`row_features`' ``log_pred_remaining`` alone."""
    return np.log1p(_predicted(np.asarray(raw, dtype=np.float64))[3])


def light_values(cands: Sequence[Any], preds: Sequence[tuple[float, float]]) -> tuple[np.ndarray, list, list]:
    """:func:`log_remaining` of a few candidates straight from them and their (p50, p90), and whether each is
    running and was preempted (waiting with a preemption): the same values as through :func:`candidate_raw
    <policy.learned.sampler.candidate_raw>`'s matrix, with one numpy call, not one per column (a decision
    refreshes a handful of rows, cold in the CPU caches)."""
    rems, running, preempted = [], [], []
    inf = math.inf
    for c, (a, b) in zip(cands, preds):
        mx = c.max_tokens
        mx = float(mx) if mx is not None and mx == mx else 0.0
        out = float(c.num_output_tokens)
        p50 = a if -inf < a < inf else (mx if mx > 0 else 1024.0)
        p90 = b if -inf < b < inf else p50
        if p90 < p50:
            p90 = p50
        rems.append(remaining_tokens(p50, p90, out, mx))
        run = c.status.value == "running"
        running.append(run)
        preempted.append(c.num_preemptions > 0 and not run)
    return np.log1p(np.array(rems, dtype=np.float64)), running, preempted


def row_features(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The per-request feature columns (float64; :data:`STEP_X` and :data:`SET_X` left 0), and ``log1p(remaining)``.

    A row depends only on its own request, so the online policy computes it when the request changes, not per step.
    """
    raw = np.asarray(raw, dtype=np.float64)
    n = raw.shape[0]
    x = np.zeros((n, len(FEATURES)), dtype=np.float64)
    c = lambda k: raw[:, R[k]]  # noqa: E731
    p50, p90, out, rem = _predicted(raw)
    gs = c("group_size")
    gsz = np.where(np.isfinite(gs) & (gs > 0), gs, np.nan)
    x[:, _LOG_X] = _log(raw[:, _LOG_RAW])
    x[:, X["turn"]] = np.minimum(_nan0(c("turn")), 16.0)
    x[:, _GROUP_X] = _nan0(raw[:, _GROUP_RAW] / gsz[:, None])
    x[:, X["is_running"]] = _nan0(c("is_running"))
    x[:, X["log_pred_p50"]] = np.log1p(p50)
    x[:, X["log_pred_p90"]] = np.log1p(p90)
    lr = np.log1p(rem)
    x[:, X["log_pred_remaining"]] = lr
    x[:, X["log_pred_final_context"]] = np.log1p(np.maximum(_nan0(c("prompt_tokens") + out + rem),
                                                            0.0))
    return x, lr


def step_features(x: np.ndarray, wait_s: Any, state: Any, step_phase: Any) -> None:
    """Fill the :data:`STEP_X` columns of ``x`` in place (an argument given as None leaves its columns as they are).

    ``state``: (kv_usage, pinned_frac, num_running, num_waiting), per row ((n, 4)) or shared by every row ((4,)).
    NaN counts as 0 and values are clipped at 0 (``fmax``: one numpy call per column block; this runs in every
    engine step).
    """
    if state is not None:
        s = np.fmax(np.asarray(state, dtype=np.float64), 0.0)
        s[..., 2:] = np.log1p(s[..., 2:])
        x[:, ENGINE_X] = s
    if wait_s is not None:
        x[:, WAIT_X] = np.log1p(np.fmax(wait_s, 0.0))
    if step_phase is not None:
        x[:, X["step_phase"]] = np.fmax(step_phase, 0.0)


def set_features(x: np.ndarray, lr: np.ndarray, offsets: Optional[np.ndarray] = None) -> None:
    """Fill the :data:`SET_X` columns of ``x`` in place: ``log1p(remaining)`` against the set's maximum, and its rank.

    ``offsets``: rows ``offsets[d]:offsets[d + 1]`` form decision ``d`` (non-empty); None: one decision.
    """
    n = len(lr)
    if not n:
        return
    if offsets is None:
        x[:, _REL] = lr - lr.max()
        rank = np.empty(n)
        rank[ascending(lr)] = queue_keys(n) / -max(n - 1, 1)  # (the GIL kept: policy.learned.sorting)
        x[:, _RANK] = rank
        return
    sizes = np.diff(offsets)
    seg = np.repeat(np.arange(len(sizes)), sizes)
    x[:, _REL] = lr - np.maximum.reduceat(lr, offsets[:-1])[seg]
    order = np.lexsort((lr, seg))  # by decision, then lr; ties in row order (as a stable argsort)
    rank = np.empty(n)
    rank[order] = (np.arange(n) - offsets[:-1][seg]) / np.maximum(sizes - 1, 1)[seg]
    x[:, _RANK] = rank


def model_features(raw: np.ndarray, offsets: Optional[np.ndarray] = None) -> np.ndarray:
    """(n, len(FEATURES)) float32 scorer input of one decision's candidates from their (n, len(RAW)) raw values
    (of several decisions' at once with ``offsets``, see :func:`set_features`)."""
    raw = np.asarray(raw, dtype=np.float64)
    x, lr = row_features(raw)
    c = lambda k: raw[:, R[k]]  # noqa: E731
    step_features(x, c("wait_s"), raw[:, [R[k] for k in ENGINE_RAW]], c("step_phase"))
    set_features(x, lr, offsets)
    return x.astype(np.float32)
