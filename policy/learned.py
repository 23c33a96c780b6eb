"""kvpilot's learned admission / preemption policy, and the exploring behaviour policy that logs for it.

**The scorer.** A small MLP (:func:`build_scorer`, torch) maps each candidate's
:data:`policy.learned_features.FEATURES` (its own features, the LightGBM length
model's p50 / p90 and the predicted remaining output, and an engine-state
summary: KV usage, pinned blocks, running / waiting counts, the RL step's
phase) to two scores: one for admission (higher = admitted first) and one for
preemption (higher = the victim). All candidates of a decision go through one
forward pass; inside the scheduler the forward pass runs in numpy from the
torch weights (:class:`NumpyScorer`, the same numbers: a test checks), since
torch's per-call overhead is larger than the MLP itself.

**Acting.** ``mode="serve"``: greedy (admission order by score, the victim with
the highest preemption score). ``mode="log"``: a Plackett-Luce sample at
``temperature`` mixed with a uniform draw at rate ``epsilon``; the logged
``propensity`` is the exact probability of the logged action (the first
admitted request, or the victim) under that mixture. Retention and eviction
are left to vLLM (the learned policy does not use those levers), over vLLM's
CPU offload tier when ``offload`` is set (a runtime option, off by default;
the exploring policy takes the same option, to log in the same regime): a
paused session's context that LRU drops from GPU memory comes back over PCIe
instead of being recomputed. So is
preemption by default (``preempt=False``, a runtime option in ``policy.json``):
the learned preemption head chose victims whose recompute cost about twice that
of vLLM's tail victim, so vLLM's own choice is kept; ``preempt=True`` uses the
head.

**Precedence.** A preempted request goes back first, as in vLLM's own queue
(``resume_preempted``, on by default: ranked by score, a preempted turn of a
long session could wait behind fresh work until the starvation bound, and its
session ended the RL step minutes late). Then a request that has waited
``max_wait_steps`` engine steps or ``max_wait_s`` seconds since it
(re-)entered the queue goes first, FCFS among the starved, whatever its score.
Such a decision is deterministic (propensity 1).

**Inputs per step.** Candidates' features live in a per-request table
(:class:`policy.learned_table.FeatureTable`) refreshed on change events, so a
step costs a few vectorised numpy calls, not a read of every candidate object.

**Behaviour policy** (:class:`LoggingPolicy`, registered as ``logging``): per
decision, one component of a mixture is drawn (vLLM's FCFS order / tail
victim, shortest and longest predicted remaining output first, uniform); the
logged propensity is the mixture's marginal probability of the logged action,
summed over every component that would have taken it.

**POLICY_DIR** (:meth:`LearnedPolicy.save` / :meth:`LearnedPolicy.load`):
``policy.json`` (manifest), ``policy.pt`` (the scorer's state_dict) and
``predictors/`` (a ``kvpilot train predictors`` model directory).
"""

from __future__ import annotations

import json
import math
import random
import shutil
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

from policy.common import LengthCache, admission_limit, check_positive, furthest_first
from policy.interface import (
    AdmissionDecision,
    CachedPrefix,
    CandidateRequest,
    EngineState,
    EvictionDecision,
    Event,
    EventKind,
    Policy,
    PolicyState,
    PreemptionDecision,
    StateMismatch,
)
from policy.learned_features import FEATURES, RAW, STEP_X
from policy.learned_table import _X_ENG, _X_WAIT, FeatureTable, engine_raw

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "PolicyLoadError",
    "build_scorer",
    "NumpyScorer",
    "StepPhase",
    "LearnedPolicy",
    "LoggingPolicy",
    "candidate_raw",
    "create_learned",
    "ABLATIONS",
]

FORMAT = "kvpilot-policy"
FORMAT_VERSION = 1
#: Score heads of the scorer.
ADMIT, PREEMPT = 0, 1
#: Runtime options and their defaults (stored in the manifest's ``config["runtime"]``).
RUNTIME_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "epsilon": 0.1,
    "max_wait_steps": 20_000,
    "max_wait_s": 300.0,
    # A preempted request is admitted before the scored order (vLLM's precedence). Measured on a held-out agentic
    # step at KV 0.1 (docs/results/2026-12-03-learned-heldout-agentic.md): a policy whose order left a
    # preempted turn waiting out max_wait_s ran 956 s without the rule, 819 s with it; one whose order did not,
    # 795 s without and 816 s with. A bound on a failure mode, at a small cost where there is none.
    "resume_preempted": True,
    # The admission scores of a step are the last step's while no row's wait time or the engine state has moved
    # by more than this share of its standard deviation (LearnedPolicy.scores): most steps admit nobody and
    # change the input by a hair, and the features and the forward pass are most of a decision's time. 0: they
    # are computed in every step.
    "rescore_tol": 0.01,
    # Off by default: vLLM's own victim (the tail of the running list) is used. The learned preemption head
    # picked costly victims: measured, its victims' recompute was about 2x that of vLLM's tail victim (issue #7).
    "preempt": False,
    # The CPU offload tier (vLLM's native KV offloading; the simulator builds the engines with it, serving needs
    # ``--kv-offloading-size``): a paused session's context comes back from host memory instead of being
    # recomputed. On the agentic preset at KV 0.2 the tier alone takes vLLM from 4.31x to 1.64x the bound. Off by
    # default: with it, the admission order learned by LPT imitation lost to one learned from shuffled outcomes
    # (tests/test_offline.py's loop), and hindsight LPT itself starved near-finished sessions, whose contexts
    # then left both tiers (agentic preset, KV 0.2: 915 s per step against vllm-offload's 710 s).
    "offload": False,
    # Over the tier, the host-tier eviction order (Policy.evict_host) comes from the reuse predictor bundled in
    # predictors/reuse: the owner whose predicted next use is furthest leaves first, and a store further off than
    # all the full tier holds is skipped (Belady on predictions). Ignored without the tier or the reuse model.
    "host_eviction": True,
}


class PolicyLoadError(ValueError):
    """A POLICY_DIR that cannot be used: missing or corrupt file, or a schema / version mismatch."""


# ---------------------------------------------------------------------------------------------- scorer


def _torch():
    import torch

    return torch


def build_scorer(n_in: int = len(FEATURES), hidden: Sequence[int] = (32, 32)):
    """A fresh scorer module (torch is imported only here and in training)."""
    torch = _torch()
    nn = torch.nn

    class Scorer(nn.Module):
        """Standardise, then an MLP with ReLU: (n, n_in) -> (n, 2) scores [admit, preempt]."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", torch.zeros(n_in))
            self.register_buffer("scale", torch.ones(n_in))
            layers: list = []
            d = n_in
            for h in hidden:
                layers += [nn.Linear(d, h), nn.ReLU()]
                d = h
            layers.append(nn.Linear(d, 2))
            self.net = nn.Sequential(*layers)

        def forward(self, x):
            return self.net((x - self.mean) / self.scale)

    return Scorer()


#: Rows per matrix product in :class:`NumpyScorer`: above about this size OpenBLAS starts its threads for these
#: small products, which on a busy machine cost ~100x more (measured: 1.5 ms CPU for 512x32 @ 32x32, 15 us at 256).
BLOCK = 256


class NumpyScorer:
    """The scorer's forward pass in numpy, from its state_dict (serving: no torch call per step)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        def arr(v: Any) -> np.ndarray:
            return np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v, dtype=np.float32)

        self.mean = arr(state["mean"])
        self.inv_scale = 1.0 / arr(state["scale"])
        idx = sorted({int(k.split(".")[1]) for k in state if k.startswith("net.") and k.endswith(".weight")})
        self.layers = [(arr(state[f"net.{i}.weight"]).T.copy(), arr(state[f"net.{i}.bias"])) for i in idx]
        if not self.layers or self.layers[0][0].shape[0] != self.mean.shape[0]:
            raise ValueError("scorer state_dict: layer shapes do not match the feature count")
        if self.layers[-1][0].shape[1] != 2:
            raise ValueError("scorer state_dict: the last layer must have 2 outputs (admit, preempt)")
        # :meth:`head`'s split of the first layer: the STEP_X columns' part (standardisation folded into the
        # weights; the other columns' rows 0, so that one product over the whole input gives it), and the others'
        n = self.n_in
        step = np.array([i for i in STEP_X if i < n], dtype=np.intp)
        const = np.setdiff1d(np.arange(n), step)
        w1, b1 = self.layers[0]
        self._step_w = np.zeros_like(w1)
        self._step_w[step] = w1[step] * self.inv_scale[step, None]
        self._step_b = b1 - (self.mean[step] * self.inv_scale[step]) @ w1[step]
        self._const = const
        self._const_mean, self._const_inv, self._const_w = self.mean[const], self.inv_scale[const], w1[const].copy()
        self._last_heads = [(w[:, h].copy(), b[h:h + 1].copy()) for w, b in self.layers[-1:] for h in range(2)]
        # ReLU's 0 as a row (measured: numpy's maximum against a row is ~1.5x faster than against a scalar)
        self._zeros = [np.zeros(w.shape[1], dtype=np.float32) for w, _ in self.layers]
        self._kept: Optional[tuple[np.ndarray, np.ndarray]] = None  # (input array, its first layer's fixed part)

    @property
    def n_in(self) -> int:
        return int(self.mean.shape[0])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if len(x) <= BLOCK:
            return self._forward(x)
        return np.concatenate([self._forward(x[i:i + BLOCK]) for i in range(0, len(x), BLOCK)])

    def head(self, x: np.ndarray, head: int, kept: bool = False) -> np.ndarray:
        """``self(x)[:, head]`` as float64 (equal within float32 rounding), computing only that head.

        ``kept``: ``x`` may be the array of the last ``kept`` call with only its :data:`STEP_X` columns changed
        since (the feature table's assembled input): then the first layer's part from the other columns,
        ``((x - mean) * inv_scale) @ W1 + b1`` over them, is kept between calls, per array object, and a call
        computes only the step columns' part and the layers after the first (9 numpy calls in all: inside the
        scheduler each costs microseconds, as vLLM's ``schedule()`` leaves numpy's code and data out of the
        CPU caches).
        """
        if len(self.layers) < 2:
            return self(x)[:, head].astype(np.float64)
        x = np.asarray(x, dtype=np.float32)
        k = self._kept
        if kept and k is not None and k[0] is x:
            fixed = k[1]
        else:
            c = x[:, self._const]
            c -= self._const_mean
            c *= self._const_inv
            fixed = _matmul(c, self._const_w)
            fixed += self._step_b
            if kept:
                self._kept = (x, fixed)
        zeros = self._zeros
        h = _matmul(x, self._step_w)
        h += fixed
        np.maximum(h, zeros[0], out=h)
        for i in range(1, len(self.layers) - 1):
            w, b = self.layers[i]
            h = _matmul(h, w)
            h += b
            np.maximum(h, zeros[i], out=h)
        w, b = self._last_heads[head]
        out = _matmul(h, w)
        out += b
        return out.astype(np.float64)

    def _forward(self, x: np.ndarray) -> np.ndarray:
        h = x - self.mean
        h *= self.inv_scale
        last = len(self.layers) - 1
        for i, (w, b) in enumerate(self.layers):
            h = h @ w
            h += b
            if i < last:
                np.maximum(h, 0.0, out=h)
        return h


def _matmul(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``a @ w`` in blocks of :data:`BLOCK` rows (see there)."""
    if len(a) <= BLOCK:
        return a @ w
    return np.concatenate([a[i:i + BLOCK] @ w for i in range(0, len(a), BLOCK)])


# ---------------------------------------------------------------------------------------- inputs


class StepPhase:
    """How much of each RL step is done: finished / arrived requests of that step (from events)."""

    def __init__(self) -> None:
        self.arrived: dict[Optional[int], int] = defaultdict(int)
        self.finished: dict[Optional[int], int] = defaultdict(int)

    def observe(self, event: Event) -> None:
        if event.kind is EventKind.ARRIVED:
            self.arrived[event.meta.step] += 1
        elif event.kind is EventKind.FINISHED:
            self.finished[event.meta.step] += 1

    def phase(self, step: Optional[int]) -> float:
        a = self.arrived.get(step, 0)
        return min(1.0, self.finished.get(step, 0) / a) if a else 0.0


#: Columns of :data:`RAW` in :func:`candidate_raw`'s per-candidate rows, and its engine-state columns.
_ROW_COLS = [i for i, k in enumerate(RAW) if k not in ("kv_usage", "pinned_frac", "num_running", "num_waiting")]
_STATE_COLS = [RAW.index(k) for k in ("kv_usage", "pinned_frac", "num_running", "num_waiting")]


def candidate_raw(
    cands: Sequence[CandidateRequest], preds: Sequence[tuple[float, float]], state: EngineState, phase: StepPhase
) -> np.ndarray:
    """The (n, len(RAW)) raw matrix of one decision's candidates (see :mod:`policy.learned_features`)."""
    nan = math.nan
    tot = max(state.num_total_blocks, 1)
    phases: dict[Optional[int], float] = {}
    for c in cands:
        if c.meta.step not in phases:
            phases[c.meta.step] = phase.phase(c.meta.step)
    rows = [
        (
            c.num_prompt_tokens, c.num_computed_tokens, c.num_output_tokens, c.max_tokens,
            c.meta.turn if c.meta.turn is not None else nan,
            c.meta.group_size if c.meta.group_size is not None else nan,
            c.group_finished, c.group_running, c.wait_s, c.num_preemptions,
            1.0 if c.status.value == "running" else 0.0, p[0], p[1], phases[c.meta.step],
        )
        for c, p in zip(cands, preds)
    ]
    out = np.empty((len(rows), len(RAW)), dtype=np.float64)
    if rows:  # the engine-state columns are the same for every candidate: filled per column
        out[:, _ROW_COLS] = np.array(rows, dtype=np.float64)
        out[:, _STATE_COLS] = (state.kv_usage, state.num_pinned_blocks / tot, float(state.num_running),
                               float(state.num_waiting))
    return out


def _predict(lengths: Optional[LengthCache], cands: Sequence[CandidateRequest]) -> list[tuple[float, float]]:
    """(p50, p90) per candidate (cached per request until a sibling finishes)."""
    if lengths is None:
        return [(math.nan, math.nan)] * len(cands)
    return lengths.lookup(cands)


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


# ---------------------------------------------------------------------------------------- policies


#: :meth:`_Sampler.export_state`'s kind and layout version (LearnedPolicy and LoggingPolicy read each other's).
STATE_KIND, STATE_VERSION = "kvpilot.learned", 1


def _engine_x(state: EngineState) -> tuple[float, float, float, float]:
    """The engine-state feature columns (kv_usage, pinned_frac, log_num_running, log_num_waiting), as
    :func:`policy.learned_features.step_features` computes them."""
    kv, pinned, running, waiting = (a if a >= 0.0 else 0.0 for a in engine_raw(state))  # NaN as 0, as fmax does
    return kv, pinned, math.log1p(running), math.log1p(waiting)


class _Sampler(Policy):
    """What both exploring policies share: the rng, precedence (preempted, starved), predictions, step phase."""

    uses_admission = True
    uses_preemption = True
    uses_events = True
    lazy_candidates = True  # the feature table reads candidates only for new or changed rows

    def __init__(self, predictor: Any, max_wait_steps: Optional[float], max_wait_s: Optional[float],
                 seed: Optional[int], resume_preempted: bool) -> None:
        self.predictor = predictor
        self.lengths = LengthCache(predictor) if predictor is not None else None
        self.phase = StepPhase()
        self.table = FeatureTable(self._raw, self.phase.phase,
                                  check_positive("max_wait_steps", max_wait_steps, allow_none=True),
                                  check_positive("max_wait_s", max_wait_s, allow_none=True),
                                  resume_preempted=bool(resume_preempted))
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self._observe = getattr(predictor, "observe", None)
        self._last_order: Optional[tuple[np.ndarray, int, list[str]]] = None  # (keys, limit, order): see _order

    def _raw(self, cands: Sequence[CandidateRequest], state: EngineState) -> np.ndarray:
        return candidate_raw(cands, _predict(self.lengths, cands), state, self.phase)

    def _predicted(self, cands: Sequence[CandidateRequest], idx: np.ndarray) -> Optional[dict[str, dict]]:
        """The candidates' length predictions (table rows ``idx``), for the decision to return and the hook to log."""
        if self.lengths is None:
            return None
        return {c.request_id: {"len_p50": p[0], "len_p90": p[1]} for c, p in zip(cands, self.table.predictions(idx))}

    #: the reuse predictor's ``observe`` (the learned policy over the tier), else None
    _observe_reuse: Any = None

    def on_event(self, event: Event) -> None:
        self.phase.observe(event)
        self.table.observe(event)
        if self._observe is not None:
            self._observe(event)
        if self._observe_reuse is not None:
            self._observe_reuse(event)
        if event.kind is EventKind.FINISHED and self.lengths is not None:
            self.lengths.forget(event.request_id)

    def export_state(self) -> PolicyState:
        """The RL steps' phase, the feature table's rows and clocks, and the predictor's observed state (hot swap)."""
        pred = getattr(self.predictor, "export_state", None)
        return PolicyState(STATE_KIND, STATE_VERSION, {
            "phase": (self.phase.arrived, self.phase.finished), "table": self.table.export_state(),
            "predictor": pred() if pred is not None else None})

    def import_state(self, state: PolicyState) -> None:
        """A predecessor's :meth:`export_state`; the predictor's part only where this predictor reads it."""
        from policy.learned_table import TableState

        data = self.state_data(state, STATE_KIND, STATE_VERSION)
        if not isinstance(data, dict) or not isinstance(data.get("table"), TableState):
            raise StateMismatch(f"a {STATE_KIND!r} state without its feature table")
        take = getattr(self.predictor, "import_state", None)
        if take is not None and data.get("predictor") is not None:
            try:
                take(data["predictor"])
            except ValueError as e:
                raise StateMismatch(f"the length predictor's state: {e}") from None
        self.table.import_state(data["table"])
        self.phase.arrived, self.phase.finished = data["phase"]

    def _order(self, first: list[int], keys: np.ndarray, waiting: Sequence[CandidateRequest],
               state: EngineState) -> list[str]:
        """Request ids: ``first`` (preempted, starved), then the rest by descending ``keys``, up to vLLM's admission
        limit.

        ``waiting`` must be the candidates of the table's last :meth:`FeatureTable.features` call (their ids are
        kept there as an array). The same ``keys`` array as the last call's (scores the scorer reused), with no
        ``first`` and the same limit, gives the last call's order again (a copy)."""
        k = admission_limit(state, len(waiting))
        last = self._last_order
        if not first and last is not None and last[0] is keys and last[1] == k:
            return list(last[2])
        if first:
            keys = keys.copy()
            keys[first] = -np.inf
        take = max(0, min(k, len(waiting)) - len(first))
        if take >= len(keys):
            top = np.argsort(-keys, kind="stable")
        else:
            part = np.argpartition(-keys, take)[:take] if take else np.empty(0, dtype=int)
            top = part[np.argsort(-keys[part], kind="stable")]
        top = top[:take]
        ids = self.table.request_ids
        if not first:
            order = ids[top].tolist()
            self._last_order = (keys, k, order)
            return list(order)
        return ids[first].tolist() + ids[top[~np.isin(top, first)]].tolist()


class LearnedPolicy(_Sampler):
    """Ranks waiting requests and chooses preemption victims with the learned scorer (see the module docstring)."""

    name = "learned"
    version = "1"

    def __init__(
        self,
        scorer_state: Mapping[str, Any],
        predictor: Any = None,
        *,
        mode: str = "serve",
        temperature: float = RUNTIME_DEFAULTS["temperature"],
        epsilon: float = RUNTIME_DEFAULTS["epsilon"],
        max_wait_steps: Optional[float] = RUNTIME_DEFAULTS["max_wait_steps"],
        max_wait_s: Optional[float] = RUNTIME_DEFAULTS["max_wait_s"],
        resume_preempted: bool = RUNTIME_DEFAULTS["resume_preempted"],
        rescore_tol: float = RUNTIME_DEFAULTS["rescore_tol"],
        seed: Optional[int] = 0,
        preempt: bool = RUNTIME_DEFAULTS["preempt"],
        offload: bool = RUNTIME_DEFAULTS["offload"],
        host_eviction: bool = RUNTIME_DEFAULTS["host_eviction"],
        manifest: Optional[dict] = None,
        predictors_dir: Optional[Path] = None,
        reuse: Any = None,
    ) -> None:
        if mode not in ("serve", "log"):
            raise ValueError(f"option mode must be 'serve' or 'log', got {mode!r}")
        super().__init__(predictor, max_wait_steps, max_wait_s, seed, resume_preempted)
        self.uses_preemption = bool(preempt)  # False: vLLM chooses the victims
        self.uses_offload = bool(offload)
        #: the reuse predictor (predictors/reuse) that orders the CPU tier's evictions (None: vLLM's LRU there)
        self.reuse = reuse if offload and host_eviction else None
        self.uses_host_eviction = self.reuse is not None
        self._observe_reuse = getattr(self.reuse, "observe", None)
        self.runtime = {"temperature": temperature, "epsilon": epsilon, "max_wait_steps": max_wait_steps,
                        "max_wait_s": max_wait_s, "resume_preempted": bool(resume_preempted),
                        "rescore_tol": rescore_tol, "preempt": bool(preempt), "offload": bool(offload),
                        "host_eviction": bool(host_eviction)}
        self.mode = mode
        self.temperature = check_positive("temperature", temperature)
        self.epsilon = float(epsilon)
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"option epsilon must be in [0, 1], got {epsilon!r}")
        self.scorer_state = {k: v for k, v in scorer_state.items()}
        self.scorer = NumpyScorer(self.scorer_state)
        if not rescore_tol >= 0.0:
            raise ValueError(f"option rescore_tol must be >= 0, got {rescore_tol!r}")
        self.rescore_tol = float(rescore_tol)
        inv = self.scorer.inv_scale.astype(np.float64)
        self._inv_wait, self._inv_eng = float(inv[_X_WAIT]), inv[_X_ENG:_X_ENG + 4].tolist()
        self._memo: Optional[tuple] = None  # the last computed admission scores and what they were computed at
        #: admission decisions that computed their scores, and those that reused the last ones (see scores)
        self.computed = self.reused = 0
        if self.scorer.n_in != len(FEATURES):
            raise ValueError(f"scorer takes {self.scorer.n_in} features, the policy computes {len(FEATURES)}")
        self.manifest = dict(manifest or {})
        self.predictors_dir = Path(predictors_dir) if predictors_dir is not None else None
        if mode == "log":
            self.name = "learned-log"

    # ------------------------------------------------------------------------- host tier
    def evict_host(self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int,
                   state: EngineState) -> Optional[EvictionDecision]:
        """The CPU tier's owners, furthest predicted next use first (the reuse predictor's Belady; a store whose
        owner comes first is skipped)."""
        if not prefixes:
            return None
        return EvictionDecision(order=furthest_first(prefixes, self.reuse.next_use_s(prefixes, state.time_s)))

    # --------------------------------------------------------------------------- scoring
    def scores(self, cands: Sequence[CandidateRequest], state: EngineState, head: int,
               refresh: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The ``head`` score (ADMIT or PREEMPT) of each candidate (one forward pass for all), and their table rows.

        Admission scores are the last ones (the same array, no feature computed) while the candidates' rows stand
        (:meth:`FeatureTable.unchanged`), the RL steps' phases are the same, and no step column has moved by
        more than ``rescore_tol`` of its standard deviation (the scorer's ``scale``) since they were computed:
        every waiting row's wait grows by the same time, so the youngest row's moves most, and the engine
        columns are shared by every row: a few scalars say it. In a step that admits nobody that is all that
        moves, by a hair, and the features and the forward pass are most of a decision's time.
        """
        admit = head == ADMIT and self.rescore_tol > 0.0
        if admit and not refresh:
            m = self._memo
            if m is not None and self.table.unchanged(cands) and self._close(m, state):
                self.reused += 1
                return m[0], m[1]
        x, idx = self.table.features(cands, state, refresh)
        # the table's input array changes only in its step columns while it is the same object
        s = self.scorer.head(x, head, kept=True)
        if admit:
            self.computed += 1
            self._memo = (s, idx, state.time_s, self.table.youngest, _engine_x(state), self._phases())
        return s, idx

    def _phases(self) -> list[float]:
        return [self.phase.phase(s) for s in self.table.steps]

    def _close(self, memo: tuple, state: EngineState) -> bool:
        """No step column has moved by more than ``rescore_tol`` standard deviations since ``memo``'s scores."""
        _, _, t0, youngest, eng0, phases0 = memo
        tol = self.rescore_tol
        w0 = t0 - youngest  # the youngest waiting row's wait then (-inf: no waiting row)
        if w0 > -math.inf:
            w1 = w0 + (state.time_s - t0)
            moved = math.log1p(w1 if w1 > 0.0 else 0.0) - math.log1p(w0 if w0 > 0.0 else 0.0)
            if abs(moved) * self._inv_wait > tol:
                return False
        for a, b, inv in zip(_engine_x(state), eng0, self._inv_eng):
            if abs(a - b) * inv > tol:
                return False
        return self._phases() == phases0

    def _logged(self, cands: Sequence[CandidateRequest], idx: np.ndarray) -> Optional[dict[str, dict]]:
        """Predictions to return with a decision: in ``log`` mode only (serving logs no features)."""
        return self._predicted(cands, idx) if self.mode == "log" else None

    def _probs(self, s: np.ndarray) -> np.ndarray:
        n = len(s)
        return (1.0 - self.epsilon) * _softmax(s / self.temperature) + self.epsilon / n

    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        if not waiting:
            return None
        s, idx = self.scores(waiting, state, ADMIT)
        first = self.table.first(idx, state)
        if self.mode == "serve":
            return AdmissionDecision(order=self._order(first, s, waiting, state))
        predictions = self._logged(waiting, idx)
        if first:
            return AdmissionDecision(order=self._order(first, s, waiting, state), propensity=1.0,
                                     predictions=predictions)
        n = len(waiting)
        if self.rng.random() < self.epsilon:
            keys = self.np_rng.random(n)  # a uniform random order
        else:  # a Plackett-Luce sample: Gumbel-perturbed scores
            keys = s / self.temperature + self.np_rng.gumbel(size=n)
        order = self._order([], keys, waiting, state)
        head = next(i for i, c in enumerate(waiting) if c.request_id == order[0])
        return AdmissionDecision(order=order, propensity=float(self._probs(s)[head]), predictions=predictions)

    def preempt(self, running: Sequence[CandidateRequest], state: EngineState) -> Optional[PreemptionDecision]:
        if not running:
            return None
        s, idx = self.scores(running, state, PREEMPT, refresh=True)
        if self.mode == "serve":
            return PreemptionDecision(victim=running[int(np.argmax(s))].request_id)
        p = self._probs(s)
        i = int(self.np_rng.choice(len(running), p=p / p.sum()))
        return PreemptionDecision(victim=running[i].request_id, propensity=float(p[i]),
                                  predictions=self._predicted(running, idx))

    # --------------------------------------------------------------------------- persistence
    def save(self, policy_dir: str | Path) -> Path:
        """Write POLICY_DIR: ``policy.json``, ``policy.pt`` and ``predictors/`` (copied from where it was loaded)."""
        torch = _torch()
        out = Path(policy_dir)
        out.mkdir(parents=True, exist_ok=True)
        torch.save({k: torch.as_tensor(np.asarray(v)) if not hasattr(v, "detach") else v
                    for k, v in self.scorer_state.items()}, out / "policy.pt")
        pred_out = out / "predictors"
        if self.predictors_dir is not None and self.predictors_dir.resolve() != pred_out.resolve():
            if pred_out.exists():
                shutil.rmtree(pred_out)
            shutil.copytree(self.predictors_dir, pred_out)
        config = {**self.manifest.get("config", {})}
        config["runtime"] = {**self.runtime, **config.get("runtime", {})}  # the manifest's, else those in use
        m = manifest_for(config, self.manifest.get("trained_on", {}))
        (out / "policy.json").write_text(json.dumps(m, indent=2, default=float))
        return out

    @classmethod
    def load(cls, policy_dir: str | Path, *, mode: str = "serve", **options: Any) -> "LearnedPolicy":
        """Load POLICY_DIR; raises :class:`PolicyLoadError` naming the file and what is wrong."""
        d = Path(policy_dir)
        manifest = read_manifest(d)
        state = _read_state(d / "policy.pt")
        predictor = _read_predictor(d / "predictors")
        runtime = {**RUNTIME_DEFAULTS, **manifest.get("config", {}).get("runtime", {}), **options}
        manifest = {**manifest, "config": {**manifest.get("config", {}), "runtime": runtime}}  # saved as in use
        reuse = _read_reuse(d / "predictors") if runtime.get("offload") and runtime.get("host_eviction") else None
        try:
            return cls(state, predictor, mode=mode, manifest=manifest, predictors_dir=d / "predictors", reuse=reuse,
                       **runtime)
        except (KeyError, ValueError) as e:
            raise PolicyLoadError(f"{d / 'policy.pt'}: {e}") from e


def manifest_for(config: Mapping[str, Any], trained_on: Mapping[str, Any]) -> dict[str, Any]:
    """The ``policy.json`` manifest (the contract's keys)."""
    from data.schemas import SCHEMA_VERSION

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "policy": "learned",
        "telemetry_schema_version": SCHEMA_VERSION,
        "feature_schema": {"features": list(FEATURES), "raw": list(RAW), "heads": ["admit", "preempt"]},
        "config": dict(config),
        "trained_on": dict(trained_on),
    }


def read_manifest(policy_dir: Path, *, check_schema: bool = True) -> dict[str, Any]:
    """POLICY_DIR's ``policy.json``: the one reader of policy manifests (training, the registry, the hook).

    :class:`PolicyLoadError` naming the file when it is missing, not JSON or not a kvpilot policy manifest;
    with ``check_schema`` also when its format or telemetry schema version or its features are not this
    build's (without: a bundle another build wrote can still be registered and described).
    """
    from data.schemas import SCHEMA_VERSION

    f = Path(policy_dir) / "policy.json"
    if not f.is_file():
        raise PolicyLoadError(f"{f}: missing (not a POLICY_DIR written by `kvpilot train policy`)")
    try:
        m = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise PolicyLoadError(f"{f}: corrupt manifest: {e}") from e
    if not isinstance(m, dict):
        raise PolicyLoadError(f"{f}: corrupt manifest: not a JSON object")
    expect = {"format": FORMAT, "format_version": FORMAT_VERSION, "policy": "learned",
              "telemetry_schema_version": SCHEMA_VERSION} if check_schema else {"format": FORMAT}
    for key, want in expect.items():
        if m.get(key) != want:
            raise PolicyLoadError(f"{f}: {key} is {m.get(key)!r}, this kvpilot reads {want!r}")
    feats = (m.get("feature_schema") or {}).get("features")
    if check_schema and feats != list(FEATURES):
        raise PolicyLoadError(f"{f}: feature_schema.features {feats!r} differ from this kvpilot's {list(FEATURES)!r}")
    return m


def _read_state(f: Path) -> dict[str, Any]:
    if not f.is_file():
        raise PolicyLoadError(f"{f}: missing")
    torch = _torch()
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is a corrupt file
        raise PolicyLoadError(f"{f}: corrupt scorer state_dict: {e}") from e
    if not isinstance(state, dict):
        raise PolicyLoadError(f"{f}: corrupt scorer state_dict: not a dict")
    try:
        scorer = build_scorer(len(FEATURES), _hidden_of(state))
        scorer.load_state_dict(state)
    except Exception as e:  # noqa: BLE001
        raise PolicyLoadError(f"{f}: scorer state_dict does not match the scorer: {e}") from e
    return {k: v.detach().cpu().numpy() for k, v in scorer.state_dict().items()}


def _hidden_of(state: Mapping[str, Any]) -> list[int]:
    idx = sorted({int(k.split(".")[1]) for k in state if k.startswith("net.") and k.endswith(".weight")})
    return [int(state[f"net.{i}.weight"].shape[0]) for i in idx[:-1]]


def _read_predictor(d: Path) -> Any:
    from predictors.length import LengthModel

    f = d / "length"
    if not f.is_dir():
        raise PolicyLoadError(f"{f}: missing (POLICY_DIR/predictors must hold a `kvpilot train predictors` model)")
    try:
        return LengthModel.load(f)
    except Exception as e:  # noqa: BLE001 - ModelSchemaError, corrupt model files
        raise PolicyLoadError(f"{f}: cannot load the length predictor: {e}") from e


def _read_reuse(d: Path) -> Any:
    """The reuse predictor of a POLICY_DIR's predictors (None when it was trained without one)."""
    from predictors.reuse import ReuseModel

    f = d / "reuse"
    if not f.is_dir():
        return None
    try:
        return ReuseModel.load(f, num_threads=1)
    except Exception as e:  # noqa: BLE001 - ModelSchemaError, corrupt model files
        raise PolicyLoadError(f"{f}: cannot load the reuse predictor: {e}") from e


def create_learned(model: Optional[str] = None, mode: str = "serve", **options: Any) -> LearnedPolicy:
    """Registry factory of ``learned``: ``model`` is a POLICY_DIR (required)."""
    if not model:
        raise ValueError("policy 'learned' needs the option model=POLICY_DIR (written by `kvpilot train policy`)")
    return LearnedPolicy.load(model, mode=mode, **options)


#: The learned policy with levers turned off (``kvpilot evaluate``'s ablation rows; each takes ``model`` as
#: ``learned`` does): admission only (vLLM's victims, no tier); + the preemption head; + the CPU tier with vLLM's
#: LRU there. ``learned`` itself adds the host-tier eviction order. GPU eviction stays vLLM's LRU in all of them.
ABLATIONS: dict[str, dict[str, bool]] = {
    "learned-admission": {"preempt": False, "offload": False},
    "learned-preempt": {"preempt": True, "offload": False},
    "learned-tier-lru": {"preempt": True, "offload": True, "host_eviction": False},
}


def create_ablation(name: str, model: Optional[str] = None, mode: str = "serve", **options: Any) -> LearnedPolicy:
    """Factory of an :data:`ABLATIONS` entry: the POLICY_DIR ``model`` with that entry's levers."""
    return create_learned(model, mode, **{**options, **ABLATIONS[name]})


# ------------------------------------------------------------------------------- behaviour policy


#: Admission components of the behaviour mixture and their default weights.
LOGGING_ADMIT = {"fcfs": 0.4, "shortest": 0.2, "longest": 0.2, "uniform": 0.2}
#: Preemption components (``vllm``: the tail of the running list, vLLM's own victim).
LOGGING_PREEMPT = {"vllm": 0.4, "shortest": 0.2, "longest": 0.2, "uniform": 0.2}


class LoggingPolicy(_Sampler):
    """The exploring behaviour policy: a per-decision mixture of vLLM's rule, the predicted-length rules and uniform.

    ``admit_weights`` / ``preempt_weights`` (JSON objects over the component
    names of :data:`LOGGING_ADMIT` / :data:`LOGGING_PREEMPT`; normalised)
    weigh the components. ``shortest`` / ``longest`` rank by predicted
    remaining output (SJF after vLLM-LTR, and LPT, the makespan rule);
    predictions come from ``predictors`` (a MODEL_DIR, or a length predictor
    object) or, without one, the per-domain running mean. The propensity of the logged action (the first
    admitted request, or the victim) is ``sum_k w_k P_k(action)``.
    """

    name = "logging"
    version = "1"

    def __init__(
        self,
        predictors: Any = None,
        admit_weights: Optional[Mapping[str, float]] = None,
        preempt_weights: Optional[Mapping[str, float]] = None,
        max_wait_steps: Optional[float] = RUNTIME_DEFAULTS["max_wait_steps"],
        max_wait_s: Optional[float] = RUNTIME_DEFAULTS["max_wait_s"],
        resume_preempted: bool = RUNTIME_DEFAULTS["resume_preempted"],
        seed: Optional[int] = 0,
        offload: bool = True,
    ) -> None:
        if isinstance(predictors, (str, Path)):
            predictor = _read_predictor(Path(predictors))
        elif predictors is not None:  # a LengthPredictor object
            predictor = predictors
        else:
            from policy.predictors import DomainMeanLengthPredictor

            predictor = DomainMeanLengthPredictor()
        super().__init__(predictor, max_wait_steps, max_wait_s, seed, resume_preempted)
        self.admit_w = _weights("admit_weights", admit_weights, LOGGING_ADMIT)
        self.preempt_w = _weights("preempt_weights", preempt_weights, LOGGING_PREEMPT)
        # Log in the regime the learned policy serves in. On by default: where the workload runs over a CPU tier
        # (the simulator's --offload-gib, serving's --kv-offloading-size), the logs carry it and `kvpilot train`
        # trains a policy over it (policy.offline.OfflineConfig.offload); off: no tier.
        self.uses_offload = bool(offload)

    def _remaining(self, cands: Sequence[CandidateRequest], state: EngineState,
                   refresh: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Predicted remaining output of each candidate, and their table rows."""
        x, idx = self.table.features(cands, state, refresh)
        return np.expm1(x[:, FEATURES.index("log_pred_remaining")].astype(np.float64)), idx

    def _pick(self, weights: dict[str, float]) -> str:
        u = self.rng.random()
        acc = 0.0
        for k, w in weights.items():
            acc += w
            if u < acc:
                return k
        return next(reversed(weights))

    @staticmethod
    def _choice(kind: str, rem: np.ndarray, default: int) -> Optional[int]:
        """The action of a deterministic component (None for uniform)."""
        if kind in ("fcfs", "vllm"):
            return default
        if kind == "shortest":
            return int(np.argmin(rem))  # ties: the earliest in vLLM's order
        if kind == "longest":
            return int(np.argmax(rem))
        return None

    def _propensity(self, weights: dict[str, float], rem: np.ndarray, default: int, action: int) -> float:
        n = len(rem)
        return float(sum(w / n if k == "uniform" else (w if self._choice(k, rem, default) == action else 0.0)
                         for k, w in weights.items()))

    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        if not waiting:
            return None
        rem, idx = self._remaining(waiting, state)
        first = self.table.first(idx, state)
        n = len(waiting)
        kind = self._pick(self.admit_w)
        if kind == "fcfs":
            keys = -np.arange(n, dtype=np.float64)
        elif kind == "shortest":
            keys = -rem - np.arange(n) * 1e-9
        elif kind == "longest":
            keys = rem - np.arange(n) * 1e-9
        else:
            keys = self.np_rng.random(n)
        order = self._order(first, keys, waiting, state)
        predictions = self._predicted(waiting, idx)
        if first:
            return AdmissionDecision(order=order, propensity=1.0, predictions=predictions)
        head = next(i for i, c in enumerate(waiting) if c.request_id == order[0])
        return AdmissionDecision(order=order, propensity=self._propensity(self.admit_w, rem, 0, head),
                                 predictions=predictions)

    def preempt(self, running: Sequence[CandidateRequest], state: EngineState) -> Optional[PreemptionDecision]:
        if not running:
            return None
        rem, idx = self._remaining(running, state, refresh=True)
        n = len(running)
        kind = self._pick(self.preempt_w)
        i = self._choice(kind, rem, n - 1)
        if i is None:
            i = self.rng.randrange(n)
        return PreemptionDecision(victim=running[i].request_id,
                                  propensity=self._propensity(self.preempt_w, rem, n - 1, i),
                                  predictions=self._predicted(running, idx))


def _weights(name: str, given: Optional[Mapping[str, float]], default: Mapping[str, float]) -> dict[str, float]:
    w = dict(default if given is None else given)
    unknown = set(w) - set(default)
    if unknown:
        raise ValueError(f"option {name}: unknown component(s) {sorted(unknown)}; known: {sorted(default)}")
    for k, v in w.items():
        check_positive(f"{name}.{k}", v, allow_zero=True)
    tot = sum(w.values())
    if not tot > 0:
        raise ValueError(f"option {name}: the weights must not all be 0")
    return {k: float(v) / tot for k, v in w.items() if v > 0}
