"""kvpilot's learned admission / preemption policy.

**The scorer** (:mod:`policy.learned.scorer`) gives each candidate an admission
and a preemption score from its :data:`policy.learned.features.FEATURES`.

**Acting.** ``mode="serve"``: admission in the runtime option ``admission``'s order: ``"shortest"``
(default) ranks by the length model's predicted remaining output, shortest first, moved by the trained
``admission_residual`` where it has one (weights on standardised features and on the admission head, learned by
simulation: :mod:`training.policy_search`); ``"siblings"`` puts a request whose GRPO group has a request running
first; ``"sessions"`` serves in program order, by the session's first arrival (:mod:`policy.session_order`, as
continuum admits); ``"returning"`` puts the trajectories' returning turns before first
turns and ``"progress"`` ranks by heddle's progress score (:mod:`policy.session_progress`), those three keeping the
queue's order among equals; ``"queue"`` keeps vLLM's own order (``kvpilot train`` chooses the order by
simulation); ``"scorer"`` by the admission score. ``learned-prior``
(:data:`PRIOR`) is the same bundle with no trained network deciding anything. The victim is the one with the highest
preemption score when ``preempt`` is on (``kvpilot
train`` turns it on when the logs hold preemption decisions), else vLLM's tail victim. ``mode="log"``: a
Plackett-Luce sample of the scores at ``temperature`` mixed with a uniform draw at rate ``epsilon``; the
logged ``propensity`` is the exact probability of the logged action (the first admitted request, or the
victim) under that mixture.

**Memory.** With ``offload`` (vLLM's CPU offload tier; ``kvpilot train`` turns it on when the logs were taken
over one) a paused session's context that GPU memory drops comes back over PCIe instead of being recomputed,
and with ``host_eviction`` the tier keeps what the reuse predictor (``reuse_predictor``) says returns soonest
(:meth:`LearnedPolicy.evict_host`, through :mod:`serving_hook.host_tier`; by default each session's state:
its place in the admission order, its tool's pause, :mod:`policy.session_reuse`). GPU eviction stays vLLM's
LRU unless ``gpu_eviction`` orders it by the same predictor, and retention stays vLLM's: with hindsight next
uses they won nothing over LRU where memory binds (docs/results/2026-12-04-memory-binds-admission.md).
Under asynchronous RL (requests that carry weight versions) the oldest GRPO group goes first and the youngest
group's contexts leave first (``group_age``, :mod:`policy.learned.group_age`).

**Precedence.** A preempted request goes back first, as in vLLM's own queue
(``resume_preempted``, on by default: ranked by score, a preempted turn of a
long session could wait behind fresh work until the starvation bound, and its
session ended the RL step minutes late). Then a request that has waited
``max_wait_steps`` engine steps or ``max_wait_s`` seconds since it
(re-)entered the queue goes first, FCFS among the starved, whatever its score.
Such a decision is deterministic (propensity 1).

**Inputs per step.** Candidates' features live in a per-request table
(:class:`policy.learned.table.FeatureTable`) refreshed on change events, so a
step costs a few vectorised numpy calls, not a read of every candidate object.

The exploring behaviour policy that logs for it is :class:`policy.learned.exploring.LoggingPolicy`; its POLICY_DIR
(:meth:`LearnedPolicy.save` / :meth:`LearnedPolicy.load`) is :mod:`policy.learned.bundle`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import numpy as np

from policy.common import admission_limit, furthest_first
from policy.group_width import WIDTH_HOLD_BOUND_S, WidthHolds
from policy.interface import (
    AdmissionDecision,
    CachedPrefix,
    CandidateRequest,
    CandidateView,
    EngineState,
    Event,
    EventKind,
    EvictionDecision,
    PolicyState,
    PreemptionDecision,
)
from policy.learned.bundle import (
    PolicyLoadError,
    read_manifest,
    read_predictor,
    read_reuse,
    read_state,
    read_tier_reuse,
    write_bundle,
)
from policy.learned.features import ENGINE_X, FEATURES, WAIT_X, X
from policy.learned.sampler import Sampler
from policy.learned.scorer import ADMIT, PREEMPT, NumpyScorer
from policy.learned.sorting import oldest_first, queue_keys
from policy.learned.table import engine_raw
from policy.options import check_positive
from policy.predictors import OnlineNextUse
from policy.session_order import SessionArrivals
from policy.session_progress import SessionProgress
from policy.session_reuse import SessionStateNextUse, TrainedNextUse

__all__ = ["RUNTIME_DEFAULTS", "PRIOR", "LearnedPolicy", "create_learned", "create_ablation", "ABLATIONS"]

#: The scorer input's column of the prior's key (log1p of the predicted remaining output).
LOG_REMAINING = X["log_pred_remaining"]
#: Runtime options and their defaults (stored in the manifest's ``config["runtime"]``).
RUNTIME_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "epsilon": 0.1,
    "max_wait_steps": 20_000,
    "max_wait_s": 300.0,
    # A preempted request is admitted before the scored order (vLLM's precedence): a bound on an order that leaves
    # a preempted turn waiting out max_wait_s (docs/results/2026-12-03-learned-heldout-agentic.md).
    "resume_preempted": True,
    # The admission scores of a step are the last step's while no row's wait time or the engine state has moved
    # by more than this share of its standard deviation (LearnedPolicy.scores): most steps admit nobody and
    # change the input by a hair, and the features and the forward pass are most of a decision's time. 0: they
    # are computed in every step.
    "rescore_tol": 0.01,
    # Off by default: vLLM's own victim (the tail of the running list); the learned preemption head's victims
    # recomputed more (docs/results).
    "preempt": False,
    # The CPU offload tier (vLLM's native KV offloading; the simulator builds the engines with it, serving needs
    # ``--kv-offloading-size``): a paused session's context comes back from host memory instead of being
    # recomputed. Off by default, so a bundle serves on an engine without the tier; `kvpilot train` sets it where
    # the logs ran over one (docs/results).
    "offload": False,
    # Over the tier, the host-tier eviction order (Policy.evict_host) comes from a reuse predictor: the owner whose
    # predicted next use is furthest leaves first, and a store further off than all the full tier holds is skipped
    # (Belady on predictions). Ignored without the tier.
    "host_eviction": True,
    # That reuse predictor: "session-state" (policy.session_reuse: each owner's next use from its session's state,
    # a queued turn's place in the admission order over the admission rate, a paused tool's expected return, learned
    # from the engine's own events), "session-trained" (that rule's estimate and the state it reads fed to the
    # bundle's trained tier model, predictors/tier_reuse: `kvpilot train` fits it on replays of the logged workloads
    # and sets this where it wins), "online" (the online LightGBM reuse model; on the tier it never gets a model:
    # the tier's candidates carry no block hashes, so its order is the owners' LRU) or "trained" (the bundle's
    # prefix reuse model, predictors/reuse). Measured in docs/results/.
    "reuse_predictor": "session-state",
    # GPU eviction: off, vLLM's LRU frees cached blocks. On, the cached prefix whose predicted next use (the
    # ``reuse_predictor``) is furthest leaves first; it won nothing over LRU where memory binds
    # (docs/results/2026-12-04-memory-binds-admission.md; the ``learned-gpu-evict`` ablation row measures it).
    # "async": on only where the requests carry weight versions (asynchronous RL), where the youngest group's
    # contexts leave first (``group_age``); vLLM's LRU elsewhere. ``kvpilot train`` sets it from async logs.
    "gpu_eviction": False,
    # Under asynchronous RL (requests that carry ``kvpilot_weight_version``): the oldest GRPO group's requests are
    # admitted first, and the youngest group's cached contexts leave the CPU tier (and, with ``gpu_eviction``, GPU
    # memory) first (policy/learned/group_age.py; docs/results/2026-12-05-async-32b-oldest-group-first.md).
    # Without weight versions nothing changes.
    "group_age": True,
    # The rollout's width (requests with a group and a session, synchronous steps and asynchronous RL alike): a
    # younger group's turn waits in vLLM's queue while the contexts in flight of its group and every older one do not
    # fit in GPU KV plus the CPU tier, the oldest group's never (policy.group_width.WidthHolds, work-conserving). Off
    # unless `kvpilot train` turns it on by simulating the logged workloads (training/policy_search.py): at H200-32B
    # on GPU KV it cuts a synchronous step's recomputation by three quarters, while on vLLM's CPU server the holds
    # cost more engine time than the recomputation they saved (docs/results).
    "width": False,
    # The admission order: "shortest" (the length model's predicted remaining output, shortest first: the
    # exploring policy's "shortest" component, deterministic); "siblings" (a request whose GRPO group has a request
    # running first, the queue's order otherwise: their shared prompt is in KV, so where memory binds more requests
    # run at once); "sessions" (program order: by the session's first arrival, a returning turn keeping its
    # session's place, as continuum admits; policy.session_order); "returning" (a trajectory's returning turn before
    # any first turn, the queue's order otherwise: a short session back from its tool uses its cached context before
    # it is evicted, and a long first turn is not held back behind shorter ones); "progress" (the trajectory
    # furthest along first, heddle's progress score, policy.session_progress, the queue's order among equals);
    # "queue" (vLLM's own order: first come first served, the preempted first; simulated on a preset fitted to vLLM's
    # CPU server, on 64-token agent turns, shortest-first ran 1.6x behind it); or
    # "scorer" (the learned MLP's admission head), which shortest-first beat where memory binds
    # (docs/results/2026-12-04-memory-binds-admission.md). `kvpilot train` chooses among "shortest", "siblings",
    # "returning" and "queue" ("progress" on request) by simulating the logged workloads (training/policy_search.py):
    # shortest-first wins where memory binds, the returning turns first on Search-R1's short search sessions
    # (docs/results/2026-12-07-admission-order-by-simulation.md). In ``log`` mode
    # the admission order is the scorer's Plackett-Luce sample either way (it explores).
    "admission": "shortest",
    # The trained admission residual: weights on the candidates' standardised features (names of FEATURES) and on
    # the scorer's admission head standardised over the queue ("scorer"), added to the prior's key
    # log1p(predicted remaining) negated. Empty: the prior's order (shortest first). `kvpilot train` learns it by
    # simulating the logged workloads under candidate weights (training/policy_search.py).
    "admission_residual": {},
}
#: The options that make a bundle its prior, ``learned-prior``: the same code, predictors and tiers, with no
#: decision taken by a trained network and no lever chosen by simulation (shortest predicted remaining first, vLLM's
#: tail victim, no width).
PRIOR: dict[str, Any] = {"preempt": False, "admission": "shortest", "admission_residual": {}, "width": False,
                         "reuse_predictor": "session-state"}
#: The admission residual's inputs besides FEATURES: the scorer's admission head, standardised over the queue.
SCORER_INPUT = "scorer"
#: ``group_age``: a group's rank in start order weighs this many seconds of predicted next use in the eviction
#: order (a context never used again, ``inf``, still leaves first).
AGE_S = 1e6
#: The admission orders of :data:`RUNTIME_DEFAULTS`'s ``admission``.
ADMISSION_ORDERS = ("scorer", "shortest", "siblings", "sessions", "returning", "progress", "queue")
#: The admission orders that rank by how far each trajectory has come (:mod:`policy.session_progress`).
SESSION_ORDERS = ("returning", "progress")
#: The reuse predictors of :data:`RUNTIME_DEFAULTS`'s ``reuse_predictor``.
REUSE_PREDICTORS = ("session-state", "session-trained", "online", "trained")


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def _engine_x(state: EngineState) -> tuple[float, float, float, float]:
    """The engine-state feature columns (kv_usage, pinned_frac, log_num_running, log_num_waiting), as
    :func:`policy.learned.features.step_features` computes them."""
    kv, pinned, running, waiting = (a if a >= 0.0 else 0.0 for a in engine_raw(state))  # NaN as 0, as fmax does
    return kv, pinned, math.log1p(running), math.log1p(waiting)


class LearnedPolicy(Sampler):
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
        admission: str = RUNTIME_DEFAULTS["admission"],
        reuse_predictor: str = RUNTIME_DEFAULTS["reuse_predictor"],
        seed: Optional[int] = 0,
        preempt: bool = RUNTIME_DEFAULTS["preempt"],
        offload: bool = RUNTIME_DEFAULTS["offload"],
        host_eviction: bool = RUNTIME_DEFAULTS["host_eviction"],
        gpu_eviction: bool | str = RUNTIME_DEFAULTS["gpu_eviction"],
        group_age: bool = RUNTIME_DEFAULTS["group_age"],
        width: bool = RUNTIME_DEFAULTS["width"],
        admission_residual: Optional[Mapping[str, float]] = None,
        manifest: Optional[dict] = None,
        predictors_dir: Optional[Path] = None,
        reuse: Any = None,
    ) -> None:
        if mode not in ("serve", "log"):
            raise ValueError(f"option mode must be 'serve' or 'log', got {mode!r}")
        if not (isinstance(gpu_eviction, bool) or gpu_eviction == "async"):
            raise ValueError(f"option gpu_eviction must be true, false or \"async\", got {gpu_eviction!r}")
        #: the admission residual's (FEATURES columns, weights, scorer head's weight); None: the prior's order
        self._residual = _residual_weights(admission_residual)
        super().__init__(predictor, max_wait_steps, max_wait_s, seed, resume_preempted)
        self.uses_preemption = bool(preempt)  # False: vLLM chooses the victims
        self.uses_offload = bool(offload)
        #: the reuse predictor (predictors/reuse) that orders the CPU tier's evictions and, with ``gpu_eviction``,
        #: the GPU's (one model, as ``oracle-offload`` has); None: vLLM's LRU in both
        host, gpu = _reuse_levers(offload, host_eviction, gpu_eviction)
        self.reuse = reuse if host or gpu else None
        self.uses_host_eviction = self.reuse is not None and host
        self.uses_eviction = self.reuse is not None and gpu
        self._observe_reuse = getattr(self.reuse, "observe", None)
        self.runtime = {"temperature": temperature, "epsilon": epsilon, "max_wait_steps": max_wait_steps,
                        "max_wait_s": max_wait_s, "resume_preempted": bool(resume_preempted),
                        "rescore_tol": rescore_tol, "preempt": bool(preempt), "offload": bool(offload),
                        "host_eviction": bool(host_eviction), "gpu_eviction": gpu_eviction,
                        "group_age": bool(group_age), "width": bool(width), "admission": admission,
                        "reuse_predictor": reuse_predictor,
                        "admission_residual": dict(admission_residual or {})}
        if admission not in ADMISSION_ORDERS:
            raise ValueError(f"option admission must be one of {', '.join(ADMISSION_ORDERS)}, got {admission!r}")
        if self._residual is not None and admission != "shortest":
            raise ValueError("option admission_residual moves the shortest-first order: it needs admission "
                             f"\"shortest\", got {admission!r}")
        if reuse_predictor not in REUSE_PREDICTORS:
            raise ValueError(f"option reuse_predictor must be one of {', '.join(REUSE_PREDICTORS)}, "
                             f"got {reuse_predictor!r}")
        self.admission = admission
        #: the sessions' progress (the key of the SESSION_ORDERS), None in any other order
        self.progress = SessionProgress() if admission in SESSION_ORDERS else None
        self._keys: dict[str, Any] = {}  # request id -> its key in that order (see _cached_keys)
        #: the sessions' first arrivals (the ``sessions`` order's key), None in any other order
        self.sessions = SessionArrivals() if admission == "sessions" else None
        self.gpu_async = gpu_eviction == "async"  # GPU eviction ordered only under asynchronous RL
        self.group_age = bool(group_age)
        #: the async rollout's width (None: off); it holds only where requests carry weight versions
        self.width = WidthHolds() if width else None
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
        self._inv_wait, self._inv_eng = float(inv[WAIT_X]), inv[ENGINE_X].tolist()
        self._memo: Optional[tuple] = None  # the last computed admission scores and what they were computed at
        #: admission decisions that computed their scores, and those that reused the last ones (see scores)
        self.computed = self.reused = 0
        if self.scorer.n_in != len(FEATURES):
            raise ValueError(f"scorer takes {self.scorer.n_in} features, the policy computes {len(FEATURES)}")
        self.manifest = dict(manifest or {})
        self.session_contexts = self.manifest.get("trained_on", {}).get("session_contexts")
        self.predictors_dir = Path(predictors_dir) if predictors_dir is not None else None
        if mode == "log":
            self.name = "learned-log"

    # ------------------------------------------------------------------------- eviction
    def evict(self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int,
              state: EngineState) -> Optional[EvictionDecision]:
        """GPU eviction (``gpu_eviction``): the cached prefix with the furthest predicted next use first (under
        asynchronous RL with ``group_age``, the youngest group's first); ``"async"``: vLLM's LRU where the requests
        carry no weight versions."""
        if self.gpu_async and not self.table.aged:
            return None
        return self._furthest_first(prefixes, state)

    def use_reuse(self, predictor: Any) -> None:
        """Order the tiers by ``predictor`` (``next_use_s``, and ``observe`` for events) in place of the bundle's
        (training records the tier's decisions through one)."""
        self.reuse = predictor
        self._observe_reuse = getattr(predictor, "observe", None)

    def evict_host(self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int,
                   state: EngineState) -> Optional[EvictionDecision]:
        """The CPU tier's owners in the same order (the reuse predictor's Belady; a store whose owner comes first is
        skipped)."""
        return self._furthest_first(prefixes, state)

    def _furthest_first(self, prefixes: Sequence[CachedPrefix], state: EngineState) -> Optional[EvictionDecision]:
        if not prefixes:
            return None
        next_use = self.reuse.next_use_s(prefixes, state.time_s)
        if self.group_age and self.table.aged:  # a younger group's context leaves before an older group's
            rank = self.table.ages.known
            next_use = [t + rank(p.meta) * AGE_S for t, p in zip(next_use, prefixes)]
        return EvictionDecision(order=furthest_first(prefixes, next_use))

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

    def _by_age(self, idx: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Admission keys (higher first) that put the oldest group first (policy.learned.group_age), then ``keys``,
        then the queue's order: each candidate's place in that lexicographic order, negated. A request with no weight
        version (rank 0) counts as the oldest."""
        n = len(keys)
        out = np.empty(n)
        out[oldest_first(self.table.age[idx], keys)] = queue_keys(n)
        return out

    def _probs(self, s: np.ndarray) -> np.ndarray:
        n = len(s)
        return (1.0 - self.epsilon) * _softmax(s / self.temperature) + self.epsilon / n

    def on_event(self, event: Event) -> None:
        super().on_event(event)
        if self.progress is not None:
            self.progress.observe(event)
        if (self.progress is not None or self.sessions is not None) and \
                (event.kind is EventKind.FINISHED or event.kind is EventKind.PREEMPTED):
            self._keys.pop(event.request_id, None)
        if self.width is not None:
            self.width.on_event(event)

    def export_state(self) -> PolicyState:
        """The sampler's state (:meth:`Sampler.export_state`) and the sessions in flight of the width."""
        st = super().export_state()
        st.data["width"] = self.width
        st.data["progress"] = self.progress
        st.data["sessions"] = self.sessions
        return st

    def import_state(self, state: PolicyState) -> None:
        """A predecessor's :meth:`export_state`; its width's sessions where both hold the width."""
        super().import_state(state)
        width = state.data.get("width")
        if self.width is not None and isinstance(width, WidthHolds):
            self.width = width
        progress = state.data.get("progress")
        if self.progress is not None and isinstance(progress, SessionProgress):
            self.progress = progress
        sessions = state.data.get("sessions")
        if self.sessions is not None and isinstance(sessions, SessionArrivals):
            self.sessions = sessions

    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        dec = self._admit(waiting, state)
        width = self.width
        if dec is None or width is None or not width.sessions:
            return dec
        ids = getattr(waiting, "request_ids", None)
        held = width.holds(ids if ids is not None else [c.request_id for c in waiting], state)
        return replace(dec, hold=held, hold_bound_s=WIDTH_HOLD_BOUND_S) if held else dec

    def _admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        """The admission order (see :meth:`admit`, which adds the width's holds)."""
        if not waiting:
            return None
        if self.admission == "shortest" and self.mode == "serve":  # log mode explores around the scorer either way
            if self._residual is not None:
                return AdmissionDecision(order=self._residual_order(waiting, state))
            top = self.table.shortest(waiting, state, admission_limit(state, len(waiting)), self.group_age)
            if top is not None:  # nobody goes first, no group age: the order in one pass
                ids = self.table.request_ids
                return AdmissionDecision(order=[ids[i] for i in top])
            rem, idx = self._remaining(waiting, state)
            keys = self._by_age(idx, -rem) if self.group_age and self.table.aged else \
                queue_keys(len(waiting)) * 1e-9 - rem
            return AdmissionDecision(order=self._order(self.table.first(idx, state), keys, waiting, state))
        if self.admission == "queue" and self.mode == "serve":  # vLLM's own order; the oldest group first in async
            _, idx = self._remaining(waiting, state)  # (the table learns each request's group age)
            if not (self.group_age and self.table.aged):
                return AdmissionDecision()
            keys = self._by_age(idx, np.zeros(len(waiting)))
            return AdmissionDecision(order=self._order(self.table.first(idx, state), keys, waiting, state))
        if self.admission == "siblings" and self.mode == "serve":
            _, idx = self._remaining(waiting, state)  # (rows refreshed light: the sibling column, no features)
            return AdmissionDecision(order=self._aged_order(idx, self.table.sibling[idx].astype(np.float64), waiting,
                                                            state))
        if self.sessions is not None and self.mode == "serve":
            _, idx = self._remaining(waiting, state)
            place = self._cached_keys(waiting, lambda cands: [self.sessions.key(c) for c in cands])
            keys = np.empty(len(waiting))
            # program order's positions get the queue's keys (a stable sort: ties keep the queue's order)
            keys[sorted(range(len(place)), key=place.__getitem__)] = queue_keys(len(waiting))
            return AdmissionDecision(order=self._aged_order(idx, keys, waiting, state))
        if self.progress is not None and self.mode == "serve":  # "progress" or "returning"
            _, idx = self._remaining(waiting, state)
            return AdmissionDecision(order=self._aged_order(idx, self._progress_keys(waiting), waiting, state))
        s, idx = self.scores(waiting, state, ADMIT)
        first = self.table.first(idx, state)
        if self.mode == "serve":
            keys = self._by_age(idx, s) if self.group_age and self.table.aged else s
            return AdmissionDecision(order=self._order(first, keys, waiting, state))
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

    def _progress_keys(self, waiting: Sequence[CandidateRequest]) -> np.ndarray:
        """Each waiting request's key in a SESSION_ORDERS order (higher first): its progress score, or for
        ``returning`` whether it has any (see :meth:`_cached_keys`: its session's earlier turns ended before it
        arrived, so only its own output moves the score, and only a preemption sends a request with output back)."""
        if self.admission == "returning":
            got = self._cached_keys(waiting, lambda cands: [1.0 if k > 0.0 else 0.0
                                                            for k in self.progress.scores(cands)])
        else:
            got = self._cached_keys(waiting, self.progress.scores)
        return np.fromiter(got, dtype=np.float64, count=len(got))

    def _cached_keys(self, waiting: Sequence[CandidateRequest], compute: Callable[[Sequence[CandidateRequest]], list]
                     ) -> list:
        """Each waiting request's key in the ``progress``, ``returning`` or ``sessions`` order, ``compute``d when it
        is first seen waiting and kept until it is preempted or finishes (:meth:`on_event`). So a step reads no
        candidate it has seen (the view builds only the new ones)."""
        cache = self._keys
        ids = waiting.request_ids if isinstance(waiting, CandidateView) else [c.request_id for c in waiting]
        new = [i for i, r in enumerate(ids) if r not in cache]
        if new:
            got = compute(waiting.take(new) if isinstance(waiting, CandidateView) else [waiting[i] for i in new])
            for i, k in zip(new, got):
                cache[ids[i]] = k
        return [cache[r] for r in ids]

    def _residual_order(self, waiting: Sequence[CandidateRequest], state: EngineState) -> list[str]:
        """The prior's order moved by the trained residual: keys ``-log1p(predicted remaining)`` plus the residual's
        weights on the standardised features (and on the scorer's admission head, standardised over the queue);
        the preempted and starved first, the oldest group first under asynchronous RL, as in the prior."""
        x, idx = self.table.features(waiting, state)
        cols, w, w_scorer = self._residual
        keys = -x[:, LOG_REMAINING].astype(np.float64)
        if len(cols):
            z = (x[:, cols] - self.scorer.mean[cols]) * self.scorer.inv_scale[cols]
            keys += z @ w
        if w_scorer:
            s = self.scorer.head(x, ADMIT, kept=True)
            sd = float(s.std())
            if sd > 0.0:
                keys += (w_scorer / sd) * (s - s.mean())
        return self._aged_order(idx, keys, waiting, state)

    def _aged_order(self, idx: np.ndarray, keys: np.ndarray, waiting: Sequence[CandidateRequest],
                    state: EngineState) -> list[str]:
        """Request ids by descending ``keys`` (table rows ``idx``): the preempted and starved first, the oldest group
        first under asynchronous RL."""
        if self.group_age and self.table.aged:
            keys = self._by_age(idx, keys)
        return self._order(self.table.first(idx, state), keys, waiting, state)

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
        config = {**self.manifest.get("config", {})}
        config["runtime"] = {**self.runtime, **config.get("runtime", {})}  # the manifest's, else those in use
        return write_bundle(policy_dir, self.scorer_state, self.predictors_dir, config,
                            self.manifest.get("trained_on", {}))

    @classmethod
    def load(cls, policy_dir: str | Path, *, mode: str = "serve", **options: Any) -> "LearnedPolicy":
        """Load POLICY_DIR; raises :class:`PolicyLoadError` naming the file and what is wrong."""
        d = Path(policy_dir)
        manifest = read_manifest(d)
        state = read_state(d / "policy.pt")
        predictor = read_predictor(d / "predictors")
        runtime = {**RUNTIME_DEFAULTS, **manifest.get("config", {}).get("runtime", {}), **options}
        manifest = {**manifest, "config": {**manifest.get("config", {}), "runtime": runtime}}  # saved as in use
        levers = _reuse_levers(runtime.get("offload"), runtime.get("host_eviction"), runtime.get("gpu_eviction"))
        reuse = _reuse_predictor(runtime.get("reuse_predictor"), d / "predictors") if any(levers) else None
        try:
            return cls(state, predictor, mode=mode, manifest=manifest, predictors_dir=d / "predictors", reuse=reuse,
                       **runtime)
        except (KeyError, ValueError) as e:
            raise PolicyLoadError(f"{d / 'policy.pt'}: {e}") from e


def _residual_weights(residual: Optional[Mapping[str, float]]) -> Optional[tuple[np.ndarray, np.ndarray, float]]:
    """The runtime option ``admission_residual`` checked: (the FEATURES columns it weighs, their weights, the
    scorer head's weight), or None where every weight is 0 (the prior's order)."""
    if residual is None:
        return None
    if not isinstance(residual, Mapping):
        raise ValueError(f"option admission_residual must map feature names to weights, got {residual!r}")
    known = (*FEATURES, SCORER_INPUT)
    cols, weights, w_scorer = [], [], 0.0
    for name, w in residual.items():
        if name not in known:
            raise ValueError(f"option admission_residual: unknown input {name!r}; known: {', '.join(known)}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"option admission_residual: the weight of {name!r} must be a finite number, got {w!r}")
        if name == SCORER_INPUT:
            w_scorer = float(w)
        elif w:
            cols.append(X[name])
            weights.append(float(w))
    if not cols and not w_scorer:
        return None
    return np.array(cols, dtype=np.intp), np.array(weights), w_scorer


def _reuse_levers(offload: Any, host_eviction: Any, gpu_eviction: Any) -> tuple[bool, bool]:
    """Whether the reuse predictor orders the CPU tier (``host_eviction`` over the tier) and the GPU's evictions."""
    return bool(offload and host_eviction), bool(gpu_eviction)


def _reuse_predictor(name: Any, predictors: Path) -> Any:
    """The runtime option ``reuse_predictor``'s predictor (checked by the policy): the bundle's trained reuse model
    (POLICY_DIR/predictors/reuse) for "trained", the session-state rule with the bundle's tier model
    (POLICY_DIR/predictors/tier_reuse) for "session-trained", the online reuse model for "online", else the rule."""
    if name == "trained":
        return read_reuse(predictors)
    if name == "session-trained":
        return TrainedNextUse(read_tier_reuse(predictors))
    return OnlineNextUse() if name == "online" else SessionStateNextUse()


def create_learned(model: Optional[str] = None, mode: str = "serve", **options: Any) -> LearnedPolicy:
    """Registry factory of ``learned``: ``model`` is a POLICY_DIR (required)."""
    if not model:
        raise ValueError("policy 'learned' needs the option model=POLICY_DIR (written by `kvpilot train policy`)")
    return LearnedPolicy.load(model, mode=mode, **options)


#: The learned policy's ablation rows (``kvpilot evaluate``; each takes ``model`` as ``learned`` does), each named
#: for what it runs. The network's ladder: ``learned-prior`` (no trained network: the rules it starts from),
#: ``learned-admission`` (the admission order `train` chose and the network's admission residual; vLLM's victims),
#: ``learned`` (every lever the bundle trained), with ``learned-tier-rule`` between the last two (every trained lever
#: but the tier model: the session-state rule orders the tier). The levers' rows: ``learned-no-tier`` (no CPU tier,
#: LRU on the GPU), ``learned-gpu-evict`` (no tier, GPU eviction by predicted next use), ``learned-tier-lru`` (the
#: tier with vLLM's LRU order there).
ABLATIONS: dict[str, dict[str, Any]] = {
    "learned-prior": PRIOR,
    "learned-admission": {"preempt": False, "reuse_predictor": "session-state"},
    "learned-tier-rule": {"reuse_predictor": "session-state"},
    "learned-no-tier": {"offload": False, "gpu_eviction": False},
    "learned-gpu-evict": {"offload": False, "gpu_eviction": True},
    "learned-tier-lru": {"offload": True, "host_eviction": False},
}


def create_ablation(name: str, model: Optional[str] = None, mode: str = "serve", **options: Any) -> LearnedPolicy:
    """Factory of an :data:`ABLATIONS` entry: the POLICY_DIR ``model`` with that entry's levers."""
    return create_learned(model, mode, **{**options, **ABLATIONS[name]})
