"""kvpilot's scheduler hook: one mixin over vLLM 0.33's ``Scheduler`` and ``AsyncScheduler``.

``KVPilotScheduler`` / ``KVPilotAsyncScheduler`` take exactly vLLM's
constructor arguments, so ``--scheduler-cls serving_hook.KVPilotAsyncScheduler``
builds them. The hook configuration comes from environment variables
(:mod:`serving_hook.config`) and is validated, and the policy built, *before*
vLLM's own constructor runs: a bad configuration fails at start-up.

How each lever reaches vLLM (line numbers: ``vllm/v1/core/sched/scheduler.py``
of vllm 0.33.0):

* **Admission.** vLLM admits inline in ``schedule()`` (L699): only when the
  running loop preempted nobody (L1050), it peeks/pops
  ``self.kv_holding_waiting`` first, then ``self.waiting`` (L1062-L1065), and
  stops at the first request whose ``allocate_slots`` fails (L1435-L1463). Before calling ``super().schedule()`` the
  hook re-orders the ``FCFSRequestQueue`` (a deque) in place to the policy's
  order, and takes the held-back requests out of it; they are put back right
  after the step (``finally``), so they keep the policy's order. Requests in
  ``kv_holding_waiting`` are not candidates (vLLM always drains them first).
  With ``--scheduling-policy priority`` the queue is a heap and this lever is
  left to vLLM (logged once).
* **Preemption.** vLLM picks the victim inline when ``allocate_slots``
  (L914) fails for a running request: ``self.running[-1]`` (L938), then
  ``self.running.pop()`` (L970) and ``_preempt_request`` (L1799). The hook wraps the instance's
  ``kv_cache_manager.allocate_slots``: when it returns ``None`` for a
  RUNNING request (the only case that leads to preemption), the hook first
  releases retention pins (pressure release, then retries), and if that is
  not enough asks the policy for a victim among ``running[i:]`` (``i`` = the
  request being allocated; requests before it are already scheduled this step
  and vLLM's FCFS path cannot undo that) and moves it to the end of
  ``self.running`` so vLLM's own ``pop()`` takes it. Each further preemption
  in the same step asks again. Nothing else in vLLM's loop changes.
* **Retention.** ``_free_blocks`` (L3064; finished requests only, not
  preemption) is overridden to note the request's hashed blocks before vLLM frees them to the
  free-list tail. At the start of the next ``schedule()`` (nothing allocates in
  between), the policy decides: protect (pin with TTL via
  :class:`serving_hook.pins.BlockPoolAdapter`), demote (free-list head)
  or keep. Pins are released on expiry (checked at each ``schedule()``), on
  the policy's order, under pressure (above), when nothing runs and the next
  waiting request does not fit (liveness), and before ``reset_prefix_cache``
  (L3184; ``block_pool.py`` L871 refuses to reset while blocks are held).
* **Eviction.** With ``Policy.uses_eviction``, ``_free_blocks`` also notes each
  finished request's prefix in a :class:`serving_hook.eviction.CachedPrefixIndex`,
  and the pool (class-swapped) calls ``_kvp_before_evict`` from
  ``get_new_blocks`` (``block_pool.py`` L706) when the blocks it is about to
  pop include a cached one. The policy's ``evict()`` then orders the cached
  prefixes whose blocks are free, and the hook moves the listed ones to the
  head of the free list before vLLM pops. At most once per step, budgeted
  and failure-isolated like the other calls; logged as a ``retain`` decision
  with action ``evict``. Design and costs: :mod:`serving_hook.eviction`.

**Zero-cost default.** With a policy that uses no lever (``VllmDefaultPolicy``)
and no telemetry, every override is a single flag test and ``super()`` call;
no wrapper is installed.

**Telemetry timing.** A ``steps`` row is stamped at ``schedule()`` and written at
the step's ``update_from_output()``, so it covers ``[time_s, time_s +
duration_s]`` of its own step (the simulator advances ``kvpilot_clock`` between
the two). A ``requests`` row counts ``computed_tokens``: the request's scheduled
tokens summed over steps, recomputation after preemption included.

**Failure isolation.** Every policy call is timed and wrapped. An exception, or
a call that returns after the step's budget is spent, is discarded: that
decision (and the rest of the step's decisions) fall back to vLLM's behaviour,
the failure kind is logged once (logger ``kvpilot.hook``), counted in
``kvpilot_stats`` and flagged in the step's ``steps`` telemetry row
(``hook_fallback``). Internal errors of the hook itself are handled the same way.

**Registry model.** With policy ``registry``
(:class:`serving_hook.model_source.RegistryPolicy`) the model comes from the
MLflow registry (``KVPILOT_MODEL_URI``): loaded at start-up, polled on a
background thread every ``KVPILOT_MODEL_POLL_S`` seconds, and swapped in at the
start of ``schedule()`` (``_kvp_between_steps``), never inside a step. A step
without any loaded model falls back to vLLM's behaviour (``hook_fallback``,
counted as ``model:none``); ``kvpilot_stats`` has ``model_version`` and
``model_swaps``, and decisions telemetry records the version
(``policy_version`` ``kvpilot/N``).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from vllm.v1.core.kv_cache_utils import get_block_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus as VRS

from policy.interface import (
    FEATURE_NAMES,
    AdmissionDecision,
    CachedPrefix,
    CandidateRequest,
    EngineState,
    Event,
    EventKind,
    OwnerState,
    Policy,
    PreemptionDecision,
    RequestMeta,
    RequestStatus,
    RetentionAction,
    RetentionDecision,
    EvictionDecision,
)
from serving_hook.block_pool import install_eviction_counter
from serving_hook.config import HookConfig, HookConfigError, build_policy, load_config
from serving_hook.events import hash_to_int64, hashes_to_int64, kv_event_hashes, kv_event_rows
from serving_hook.eviction import CachedPrefixIndex, evict_first
from serving_hook.metadata import request_meta
from serving_hook.model_source import RegistryPolicy
from serving_hook.pins import BlockPoolAdapter

logger = logging.getLogger("kvpilot.hook")

_perf = time.perf_counter
_MAX_GROUPS = 1 << 16


class _StepFallback(Exception):
    """Raised inside the hook when a policy call fails or overruns its budget."""


@dataclass(slots=True)
class _ReqInfo:
    """What the hook keeps per live request (metadata cached at add_request)."""

    meta: RequestMeta
    arrival_s: float
    first_scheduled_s: Optional[float] = None
    first_token_s: Optional[float] = None
    running: bool = False  # admitted and not preempted or finished since
    cached_tokens: int = -1
    computed_tokens: int = 0  # scheduled tokens summed over steps (counted with telemetry on)
    cand: Optional[CandidateRequest] = None  # reused across steps, refreshed per call


@dataclass(slots=True)
class _Freed:
    """A finished request's cached blocks, waiting for the retention decision."""

    request_id: str
    meta: RequestMeta
    owner_state: OwnerState
    blocks: list
    hashes: list  # the blocks' BlockHashWithGroupId at free time
    time_s: float
    hashes64: Optional[tuple] = None  # int64 hashes, computed once when first offered to evict()


@dataclass(slots=True)
class _PinInfo:
    meta: RequestMeta
    owner_state: OwnerState
    hashes: list
    last_used_s: float
    hits: int = 0
    hashes64: Optional[tuple] = None  # int64 hashes, computed once (retain() lists every pin each time)


def _hashes64(held: _Freed | _PinInfo) -> tuple:
    """``held``'s block hashes as int64 (the interface's convention), converted once and kept."""
    h64 = held.hashes64
    if h64 is None:
        h64 = held.hashes64 = tuple(hash_to_int64(_bh(h)) for h in held.hashes)
    return h64


@dataclass
class HookStats:
    """Counters the hook keeps for tests, benchmarks and telemetry."""

    steps: int = 0
    fallback_steps: int = 0
    fallbacks: dict = field(default_factory=dict)  # "method:kind" -> count
    policy_calls: int = 0
    preemptions: int = 0
    policy_victims: int = 0  # preemptions whose victim the policy moved
    admission_reorders: int = 0
    held: int = 0
    protected: int = 0
    demoted_blocks: int = 0
    eviction_calls: int = 0  # evict() asked (at most once per step, only when LRU would evict)
    eviction_orders: int = 0  # evict() answers that moved blocks
    evict_first_blocks: int = 0  # blocks moved to the head of the free list by evict()
    prefix_queries: int = 0
    prefix_hits: int = 0
    hook_time_s: float = 0.0  # the hook's own time (telemetry-enabled or policy mode)
    last_hook_time_s: float = 0.0
    model_version: Optional[str] = None  # policy ``registry``: the registry version served (None: none yet)
    model_swaps: int = 0  # policy ``registry``: versions swapped in after start-up


class KVPilotMixin:
    """The hook. Mix in before vLLM's ``Scheduler`` / ``AsyncScheduler``."""

    # Class-level defaults: every override passes through until _kvp_setup ran.
    _kvp_passthrough = True
    _kvp_pins: Optional[BlockPoolAdapter] = None
    _kvp_index: Optional[CachedPrefixIndex] = None
    _kvp_inner_s = 0.0
    _kvp_registry: Optional[RegistryPolicy] = None

    #: Overrides for the simulator and tests (``with_policy`` sets them on a
    #: subclass): a zero-argument policy factory and a ready ``HookConfig``.
    kvpilot_policy_factory: Optional[Callable[[], Policy]] = None
    kvpilot_config: Optional[HookConfig] = None
    #: A telemetry writer owned by the caller and shared by several schedulers (the
    #: simulator's replicas); used instead of ``telemetry_dir`` and never closed here.
    kvpilot_shared_writer: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cfg = self.kvpilot_config if self.kvpilot_config is not None else load_config()
        policy = build_policy(cfg, self.kvpilot_policy_factory)
        shared = self.kvpilot_shared_writer
        writer = shared if shared is not None else _build_writer(cfg)
        try:
            super().__init__(*args, **kwargs)
            self._kvp_setup(cfg, policy, writer)
        except BaseException:
            if writer is not None and shared is None:
                writer.close()
            raise

    # ================================================================ set-up
    def _kvp_setup(self, cfg: HookConfig, policy: Policy, writer: Any) -> None:
        self.kvpilot_cfg = cfg
        self.kvpilot_policy = policy
        self.kvpilot_telemetry = writer
        self.kvpilot_stats = HookStats()
        #: Clock for TTLs, wait times and telemetry (seconds). vLLM stamps
        #: ``Request.arrival_time`` with ``time.time()``; the simulator replaces it.
        self.kvpilot_clock: Callable[[], float] = time.time
        #: Most tokens a running request decodes in one step; the simulator's decode
        #: stride sets it (telemetry counts a chunk of up to this many as decode tokens).
        self.kvpilot_decode_stride = 1
        self.kvpilot_kv_event_listener: Optional[Callable[[str, list], None]] = None  # see kvpilot_set_kv_event_listener
        self._kvp_orig_take_events: Optional[Callable] = None
        self._kvp_policy_limits()
        self._kvp_replica = cfg.replica
        self._kvp_logged: set[str] = set()
        fcfs = isinstance(self.waiting, FCFSRequestQueue)
        self._kvp_admission = policy.uses_admission and fcfs
        self._kvp_preemption = policy.uses_preemption and fcfs
        self._kvp_retention = policy.uses_retention and self.cache_config.enable_prefix_caching
        self._kvp_eviction = policy.uses_eviction and self.cache_config.enable_prefix_caching
        self._kvp_events = policy.uses_events
        if (policy.uses_admission or policy.uses_preemption) and not fcfs:
            logger.warning(
                "kvpilot: policy %s wants admission/preemption, but vLLM runs --scheduling-policy %s; "
                "those levers are left to vLLM",
                policy.name,
                self.scheduler_config.policy,
            )
        if (policy.uses_retention or policy.uses_eviction) and not self.cache_config.enable_prefix_caching:
            logger.warning("kvpilot: prefix caching is off; the retention and eviction levers are disabled")
        self._kvp_active = bool(
            self._kvp_admission or self._kvp_preemption or self._kvp_retention or self._kvp_eviction or self._kvp_events
        )
        #: Everything off: every override just calls vLLM.
        self._kvp_passthrough = not self._kvp_active and writer is None
        self._kvp_reqs: dict[str, _ReqInfo] = {}
        self._kvp_groups: dict[str, list] = {}  # group_id -> [finished, running, (output lens,)]
        self._kvp_sessions: dict[str, int] = {}  # session_id -> last turn seen finishing with a tool
        self._kvp_freed: list[_Freed] = []
        self._kvp_pin_info: dict[str, _PinInfo] = {}
        self._kvp_prefilling: set[str] = set()
        self._kvp_step_no = 0
        self._kvp_step_fallback = False
        self._kvp_budget_left = self._kvp_budget
        self._kvp_step_preemptions = 0
        self._kvp_last_step_time: Optional[float] = None
        self._kvp_last_duration = 0.0
        self._kvp_step_rows: deque = deque()  # steps rows waiting for their step's end (update_from_output)
        self._kvp_decision_id = 0
        self._kvp_pool = None
        self._kvp_pins: Optional[BlockPoolAdapter] = None
        self._kvp_index: Optional[CachedPrefixIndex] = None
        self._kvp_offered: dict[str, tuple] = {}  # evict()'s last candidates: prefix id -> (_Freed, CachedPrefix)
        if isinstance(policy, RegistryPolicy):
            # The registry's model: swapped in between steps (_kvp_between_steps), polled off this thread.
            self._kvp_registry = policy
            self.kvpilot_stats.model_version = policy.model_version
            policy.source.start(cfg.model_poll_s)
        if self._kvp_passthrough:
            return
        pool = self.kv_cache_manager.block_pool
        install_eviction_counter(pool)
        self._kvp_pool = pool
        self._kvp_num_blocks = pool.num_gpu_blocks - 1  # minus vLLM's null block
        if self._kvp_retention:
            cap = int(cfg.max_pinned_fraction * self._kvp_num_blocks)
            self._kvp_pins = BlockPoolAdapter(pool, cap)
        if self._kvp_eviction:
            # Eviction lever (see serving_hook.eviction): candidates are the freed
            # prefixes still cached; the pool calls back before an evicting allocation.
            self._kvp_index = CachedPrefixIndex(max(4 * self._kvp_num_blocks, 1024), pool)
            self._kvp_evict_hook = self._kvp_before_evict
            pool.kvpilot_eviction_hook = self._kvp_evict_hook
        if self._kvp_preemption or self._kvp_retention:
            self._kvp_orig_allocate = self.kv_cache_manager.allocate_slots
            self.kv_cache_manager.allocate_slots = self._kvp_allocate_slots
        pool.kvpilot_tree = self._kvp_eviction or self._kvp_retention  # exclusive tails: the levers that move blocks
        self._kvp_log_kv_events = writer is not None and "kv_events" in getattr(writer, "tables", ("kv_events",))
        if self._kvp_log_kv_events:
            self._kvp_watch_kv_events()

    def _kvp_watch_kv_events(self) -> None:
        """Make the pool emit vLLM's KV events and take them at each step's end (idempotent).

        They still go to vLLM's own publisher (a null one unless configured)."""
        if self._kvp_orig_take_events is None:
            self._kvp_pool.enable_kv_cache_events = True
            self._kvp_orig_take_events = self.kv_cache_manager.take_events
            self.kv_cache_manager.take_events = self._kvp_take_events

    def kvpilot_set_kv_event_listener(self, listener: Optional[Callable[[str, list], None]]) -> None:
        """Call ``listener(kind, block_hashes)`` for each of this engine's KV events (``stored`` / ``removed`` /
        ``cleared``, hashes as signed int64) at each step's end; the simulator feeds its KV-aware router with
        it, as llm-d reads vLLM's event stream. Needs the hook's non-passthrough mode."""
        self.kvpilot_kv_event_listener = listener
        if listener is not None and not self._kvp_passthrough:
            self._kvp_watch_kv_events()

    # ======================================================== vLLM overrides
    def add_request(self, request: Any) -> None:
        super().add_request(request)
        if self._kvp_passthrough:
            return
        try:
            rid = request.request_id
            if rid in self._kvp_reqs:  # streaming update of an existing request
                return
            meta = request_meta(request)
            self._kvp_reqs[rid] = _ReqInfo(meta, request.arrival_time)
            sid = meta.session_id
            # The next turn of a session whose last turn ended in a tool call: the tool returned.
            resumed = sid is not None and self._kvp_sessions.pop(sid, None) is not None
            if resumed:
                self._kvp_session_resumed(sid)
            if self._kvp_events:
                if resumed:
                    self._kvp_emit(EventKind.TOOL_CALL_ENDED, request, meta, budgeted=False)
                self._kvp_emit(EventKind.ARRIVED, request, meta, budgeted=False)
        except Exception as e:  # never into vLLM
            self._kvp_internal_error("add_request", e)

    def schedule(self, *args: Any, **kwargs: Any):
        if self._kvp_passthrough:
            return super().schedule(*args, **kwargs)
        t0 = _perf()
        self._kvp_step_no += 1
        self._kvp_step_fallback = False
        self._kvp_budget_left = self._kvp_budget
        self._kvp_step_preemptions = 0
        if self._kvp_registry is not None:
            self._kvp_between_steps()
        ev0 = self._kvp_pool.kvpilot_evictions
        if self._kvp_eviction:
            pool = self._kvp_pool
            pool.kvpilot_eviction_hook = self._kvp_evict_hook  # re-armed: one ask per step
            pool.kvpilot_plan = None  # the last step's order is spent
        now = self.kvpilot_clock()
        if self._kvp_last_step_time is not None:
            self._kvp_last_duration = max(0.0, now - self._kvp_last_step_time)
        self._kvp_last_step_time = now
        held: list = []
        desired: Optional[list] = None
        try:
            if self._kvp_pins is not None:
                for pid in self._kvp_pins.release_expired(now):
                    self._kvp_pin_info.pop(pid, None)
                if self._kvp_freed:
                    self._kvp_retain(now)
            elif self._kvp_freed:
                self._kvp_freed.clear()
            if (
                self._kvp_admission
                and self.waiting
                # vLLM admits nobody while the running set is full (L1072-L1074): skip the policy.
                and len(self.running) + self.num_waiting_for_streaming_input < self.max_num_active_reqs
            ):
                held, desired = self._kvp_admit(now)
        except Exception as e:
            self._kvp_internal_error("pre-schedule", e)
        t1 = _perf()
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            t2 = _perf()
            if held:
                self._kvp_restore_held(held, desired)
        try:
            self._kvp_after_schedule(out, now, ev0)
        except Exception as e:
            self._kvp_internal_error("post-schedule", e)
        st = self.kvpilot_stats
        # The hook's own time: its work before and after vLLM's schedule(),
        # plus its work inside it (the allocate_slots wrapper: pins, victims).
        hook_s = (t1 - t0) + (_perf() - t2) + self._kvp_inner_s
        self._kvp_inner_s = 0.0
        st.last_hook_time_s = hook_s
        st.hook_time_s += hook_s
        st.steps += 1
        if self._kvp_step_fallback:
            st.fallback_steps += 1
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):
        if self._kvp_passthrough:
            return super().update_from_output(scheduler_output, model_runner_output)
        w = self.kvpilot_telemetry
        if w is not None:
            try:
                infos = self._kvp_reqs
                for rid, n in scheduler_output.num_scheduled_tokens.items():
                    info = infos.get(rid)
                    if info is not None:
                        info.computed_tokens += n
            except Exception as e:
                self._kvp_internal_error("update_from_output", e)
        outs = super().update_from_output(scheduler_output, model_runner_output)
        if w is not None and self._kvp_step_rows:
            # The step's row covers [schedule() time, now]: the step's own duration.
            row = self._kvp_step_rows.popleft()
            row["duration_s"] = max(0.0, self.kvpilot_clock() - row["time_s"])
            w.put("steps", row)
        try:
            if self._kvp_prefilling:
                now = None
                done = []
                reqs = self.requests
                for rid in self._kvp_prefilling:
                    r = reqs.get(rid)
                    info = self._kvp_reqs.get(rid)
                    if r is None or info is None:
                        done.append(rid)
                        continue
                    if r.num_output_tokens > 0:
                        if now is None:
                            now = self.kvpilot_clock()
                        info.first_token_s = now
                        done.append(rid)
                for rid in done:
                    self._kvp_prefilling.discard(rid)
        except Exception as e:
            self._kvp_internal_error("update_from_output", e)
        return outs

    def _preempt_request(self, request: Any, timestamp: float, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, timestamp, *args, **kwargs)
        if self._kvp_passthrough:
            return
        self._kvp_step_preemptions += 1
        self.kvpilot_stats.preemptions += 1
        try:
            info = self._kvp_reqs.get(request.request_id)
            if info is not None:
                if info.running:
                    info.running = False
                    g = self._kvp_group(info.meta)
                    if g is not None:
                        g[1] -= 1
                if self._kvp_events:
                    self._kvp_emit(EventKind.PREEMPTED, request, info.meta)
        except Exception as e:
            self._kvp_internal_error("preempt", e)

    def _free_blocks(self, request: Any) -> None:
        if self._kvp_passthrough or (self._kvp_pins is None and self._kvp_index is None):
            return super()._free_blocks(request)
        try:
            groups = self.kv_cache_manager.coordinator.get_blocks(request.request_id)
            blocks = [b for g in groups for b in g if not b.is_null and b.block_hash is not None]
            hashes = [b.block_hash for b in blocks]
        except Exception as e:
            self._kvp_internal_error("free_blocks", e)
            blocks = []
            hashes = []
        super()._free_blocks(request)
        if not blocks:
            return
        try:
            info = self._kvp_reqs.get(request.request_id)
            meta = info.meta if info is not None else request_meta(request)
            aborted = request.status == VRS.FINISHED_ABORTED
            state = OwnerState.PAUSED_TOOL if (meta.tool and not aborted) else OwnerState.FINISHED
            freed = _Freed(request.request_id, meta, state, blocks, hashes, self.kvpilot_clock())
            if self._kvp_pins is not None:
                self._kvp_freed.append(freed)
            if self._kvp_index is not None:
                self._kvp_index.add(request.request_id, freed)
        except Exception as e:
            self._kvp_internal_error("free_blocks", e)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any):
        result = super()._free_request(request, *args, **kwargs)
        if self._kvp_passthrough:
            return result
        try:
            self._kvp_finished(request)
        except Exception as e:
            self._kvp_internal_error("finish", e)
        return result

    def reset_prefix_cache(self, *args: Any, **kwargs: Any):
        if self._kvp_pins is not None:
            # vLLM refuses to reset while any block is held (block_pool.reset_prefix_cache).
            self._kvp_pins.release_all()
            self._kvp_pin_info.clear()
            self._kvp_freed.clear()
        if self._kvp_index is not None:
            self._kvp_index.clear()
        return super().reset_prefix_cache(*args, **kwargs)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.kvpilot_close()

    # ========================================================= public extras
    def kvpilot_close(self) -> None:
        """Flush and stop the telemetry writer (idempotent); a shared writer is only detached.

        Also stops the registry policy's poll thread.
        """
        if self._kvp_registry is not None:
            self._kvp_registry.source.stop()
        w = getattr(self, "kvpilot_telemetry", None)
        if w is not None:
            self.kvpilot_telemetry = None
            if w is not self.kvpilot_shared_writer:
                w.close()

    @property
    def kvpilot_pinned_blocks(self) -> int:
        return self._kvp_pins.num_pinned_blocks if self._kvp_pins is not None else 0

    # ===================================================== policy plumbing
    def _kvp_policy_limits(self) -> None:
        """The step budget and eviction candidate cap of the current policy (again after a model swap)."""
        policy = self.kvpilot_policy
        budget = policy.decision_budget_s
        self._kvp_budget = float(budget) if budget else self.kvpilot_cfg.decision_budget_s
        cap = policy.max_eviction_candidates
        self._kvp_evict_cap = int(cap) if cap is not None and int(cap) > 0 else None

    def _kvp_between_steps(self) -> None:
        """Policy ``registry``: swap in a newly loaded version, or fall back for this step without a model.

        Runs first thing in ``schedule()``, so a step's decisions all come from one version.
        """
        reg = self._kvp_registry
        st = self.kvpilot_stats
        try:
            if reg.swap_pending():
                st.model_swaps += 1
                self._kvp_policy_limits()
                self._kvp_budget_left = self._kvp_budget
        except Exception as e:
            self._kvp_internal_error("model-swap", e)
        st.model_version = reg.model_version
        if not reg.has_model:
            self._kvp_step_fallback = True  # no policy call this step: vLLM's own behaviour
            st.fallbacks["model:none"] = st.fallbacks.get("model:none", 0) + 1

    def _kvp_call(self, what: str, fn: Callable, *args: Any):
        """Call the policy under the step budget; raise _StepFallback on failure."""
        if self._kvp_step_fallback:
            raise _StepFallback(what)
        st = self.kvpilot_stats
        st.policy_calls += 1
        t = _perf()
        try:
            result = fn(*args)
        except Exception as e:
            self._kvp_fail(what, "exception", e)
            raise _StepFallback(what) from None
        finally:
            dt = _perf() - t
            self._kvp_budget_left -= dt
        if self._kvp_budget_left < 0:
            self._kvp_fail(what, "overrun", f"{dt * 1e3:.2f} ms; step budget {self._kvp_budget * 1e3:.2f} ms")
            raise _StepFallback(what)
        return result

    def _kvp_fail(self, what: str, kind: str, detail: Any) -> None:
        key = f"{what}:{kind}"
        st = self.kvpilot_stats
        st.fallbacks[key] = st.fallbacks.get(key, 0) + 1
        self._kvp_step_fallback = True
        if key not in self._kvp_logged:
            self._kvp_logged.add(key)
            logger.warning(
                "kvpilot: policy %s %s in %s (%s); this step falls back to vLLM's behaviour. "
                "Logged once; further failures are only counted.",
                self.kvpilot_policy.name,
                "raised" if kind == "exception" else "overran its time budget",
                what,
                detail if kind != "exception" else repr(detail),
            )

    def _kvp_internal_error(self, where: str, e: BaseException) -> None:
        key = f"hook:{where}"
        st = self.kvpilot_stats
        st.fallbacks[key] = st.fallbacks.get(key, 0) + 1
        self._kvp_step_fallback = True
        if key not in self._kvp_logged:
            self._kvp_logged.add(key)
            logger.exception("kvpilot: internal error in %s; falling back to vLLM's behaviour (logged once)", where)

    def _kvp_state(self, now: float) -> EngineState:
        pool = self._kvp_pool
        free = pool.get_num_free_blocks()
        return EngineState(
            time_s=now,
            engine_step=self._kvp_step_no,
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.kv_holding_waiting),
            num_free_blocks=free,
            num_total_blocks=self._kvp_num_blocks,
            num_pinned_blocks=self.kvpilot_pinned_blocks,
            kv_usage=pool.get_usage(),
            block_size=self.block_size,
            max_num_running=self.max_num_running_reqs,
            max_num_batched_tokens=self.max_num_scheduled_tokens,
            last_step_duration_s=self._kvp_last_duration,
        )

    def _kvp_group(self, meta: RequestMeta) -> Optional[list]:
        gid = meta.group_id
        if gid is None:
            return None
        g = self._kvp_groups.get(gid)
        if g is None:
            if len(self._kvp_groups) >= _MAX_GROUPS:  # groups without a size never complete
                del self._kvp_groups[next(iter(self._kvp_groups))]
            g = self._kvp_groups[gid] = [0, 0, ()]
        return g

    def _kvp_candidates(self, reqs: list, now: float) -> list[CandidateRequest]:
        """The candidates for ``reqs``: one object per request, built once and refreshed in place.

        One inlined loop (no call per request): this runs over every waiting
        request in each step in which vLLM could admit.
        """
        infos = self._kvp_reqs
        groups = self._kvp_groups
        v_running, v_preempted = VRS.RUNNING, VRS.PREEMPTED
        running, preempted, waiting = RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.WAITING
        out: list[CandidateRequest] = []
        append = out.append
        for r in reqs:
            info = infos.get(r.request_id)
            if info is None:
                info = infos[r.request_id] = _ReqInfo(request_meta(r), r.arrival_time)
            c = info.cand
            if c is None:
                append(self._kvp_new_candidate(r, info, now))
                continue
            s = r.status
            if s is v_running:
                c.status = running
                c.wait_s = 0.0
            else:
                c.status = preempted if s is v_preempted else waiting
                w = now - r.arrival_time
                c.wait_s = w if w > 0.0 else 0.0
            c.num_cached_tokens = info.cached_tokens
            c.num_computed_tokens = r.num_computed_tokens
            c.num_output_tokens = r.num_output_tokens
            c.num_preemptions = r.num_preemptions
            gid = info.meta.group_id
            if gid is not None:
                g = groups.get(gid)
                if g:
                    c.group_finished, c.group_running, c.sibling_output_tokens = g
            append(c)
        return out

    def _kvp_new_candidate(self, r: Any, info: _ReqInfo, now: float) -> CandidateRequest:
        meta = info.meta
        s = r.status
        if s == VRS.RUNNING:
            status = RequestStatus.RUNNING
            wait = 0.0
        else:
            status = RequestStatus.PREEMPTED if s == VRS.PREEMPTED else RequestStatus.WAITING
            wait = max(0.0, now - r.arrival_time)
        g = self._kvp_groups.get(meta.group_id) if meta.group_id is not None else None
        c = info.cand = CandidateRequest(
            request_id=r.request_id,
            meta=meta,
            status=status,
            prompt_token_ids=r.prompt_token_ids if r.prompt_token_ids is not None else (),
            num_prompt_tokens=r.num_prompt_tokens,
            num_cached_tokens=info.cached_tokens,
            num_computed_tokens=r.num_computed_tokens,
            num_output_tokens=r.num_output_tokens,
            max_tokens=r.max_tokens,
            arrival_s=r.arrival_time,
            wait_s=wait,
            num_preemptions=r.num_preemptions,
            priority=r.priority,
            group_finished=g[0] if g else 0,
            group_running=g[1] if g else 0,
            sibling_output_tokens=g[2] if g else (),
        )
        return c

    def _kvp_emit(
        self, kind: EventKind, r: Any, meta: RequestMeta, finish_reason: Optional[str] = None, budgeted: bool = True
    ) -> None:
        ev = Event(
            kind=kind,
            time_s=self.kvpilot_clock(),
            request_id=r.request_id,
            meta=meta,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens,
            num_cached_tokens=max(0, self._kvp_reqs[r.request_id].cached_tokens)
            if r.request_id in self._kvp_reqs
            else 0,
            finish_reason=finish_reason,
        )
        t = _perf()
        try:
            self.kvpilot_policy.on_event(ev)
        except Exception as e:
            self._kvp_fail("on_event", "exception", e)
        if not budgeted:  # arrivals come between engine steps
            return
        # Events cannot be discarded, but their time counts against the step's budget.
        self._kvp_budget_left -= _perf() - t
        if self._kvp_budget_left < 0 and not self._kvp_step_fallback:
            self._kvp_fail("on_event", "overrun", f"step budget {self._kvp_budget * 1e3:.2f} ms")

    @property
    def _kvp_log_decisions(self) -> bool:
        """Whether decisions are logged (with every candidate's features): the writer keeps that table."""
        w = self.kvpilot_telemetry
        return w is not None and "decisions" in w.tables

    def _kvp_log_decision(
        self,
        kind: str,
        now: float,
        candidate_ids: list,
        features: list,
        chosen: int,
        propensity: float,
        action: Optional[str] = None,
        ttl_s: Optional[float] = None,
    ) -> None:
        w = self.kvpilot_telemetry
        if w is None:
            return
        self._kvp_decision_id += 1
        p = float(propensity)
        if not (0.0 < p <= 1.0):
            p = 1.0
        w.put(
            "decisions",
            {
                "decision_id": self._kvp_decision_id,
                "time_s": now,
                "replica": self._kvp_replica,
                "engine_step": self._kvp_step_no,
                "kind": kind,
                "candidate_ids": candidate_ids,
                "features": features,
                "chosen": chosen,
                "action": action,
                "ttl_s": ttl_s,
                "propensity": p,
                "policy": self.kvpilot_policy.name,
                "policy_version": str(self.kvpilot_policy.version),
            },
        )

    # ============================================================ admission
    def _kvp_admit(self, now: float):
        waiting = self.waiting
        reqs = list(waiting)
        cands = self._kvp_candidates(reqs, now)
        try:
            dec = self._kvp_call("admit", self.kvpilot_policy.admit, cands, self._kvp_state(now))
        except _StepFallback:
            return [], None
        if dec is None:
            return [], None
        if not isinstance(dec, AdmissionDecision):
            self._kvp_fail("admit", "exception", TypeError(f"admit() returned {type(dec).__name__}"))
            return [], None
        order = dec.order
        if order is None or _keeps_order(order, cands):
            ordered = reqs
        else:
            by_id = {r.request_id: r for r in reqs}
            ordered = []
            seen: set = set()
            for rid in order:
                r = by_id.get(rid)
                if r is not None and rid not in seen:
                    seen.add(rid)
                    ordered.append(r)
            if len(ordered) < len(reqs):
                ordered.extend(r for r in reqs if r.request_id not in seen)
        hold = dec.hold
        held = [r for r in ordered if r.request_id in hold] if hold else []
        if self._kvp_log_decisions:
            first = ordered[0].request_id if ordered else None
            idx = next((i for i, c in enumerate(cands) if c.request_id == first), -1)
            preds = dec.predictions or {}
            self._kvp_log_decision(
                "admit",
                now,
                [c.request_id for c in cands],
                [c.features(preds.get(c.request_id)) for c in cands],
                idx,
                dec.propensity,
                action=f"hold:{len(held)}" if held else None,
            )
        changed = ordered is not reqs and any(a is not b for a, b in zip(ordered, reqs))
        if not changed and not held:
            return [], None
        heldset = {id(r) for r in held}
        waiting.clear()
        waiting.extend(r for r in ordered if id(r) not in heldset)
        st = self.kvpilot_stats
        if changed:
            st.admission_reorders += 1
        st.held += len(held)
        return held, ordered

    def _kvp_restore_held(self, held: list, desired: Optional[list]) -> None:
        """Put held-back requests back into ``waiting`` in the policy's order.

        Requests vLLM put in front during the step (preempted ones) stay in front.
        """
        waiting = self.waiting
        pos = {id(r): i for i, r in enumerate(desired or held)}
        rest = list(waiting)
        front = [r for r in rest if id(r) not in pos]
        tail = [r for r in rest if id(r) in pos] + [r for r in held if not r.is_finished()]
        tail.sort(key=lambda r: pos[id(r)])
        waiting.clear()
        waiting.extend(front)
        waiting.extend(tail)

    # =========================================================== preemption
    def _kvp_allocate_slots(self, request: Any, *args: Any, **kwargs: Any):
        blocks = self._kvp_orig_allocate(request, *args, **kwargs)
        if blocks is not None:
            return blocks
        t0 = _perf()
        try:
            pins = self._kvp_pins
            if request.status == VRS.RUNNING:
                # vLLM preempts next: release pins first (pressure), then ask the policy.
                while blocks is None and pins is not None and len(pins):
                    self._kvp_release_pressure()
                    blocks = self._kvp_orig_allocate(request, *args, **kwargs)
                if (
                    blocks is None
                    and self._kvp_preemption
                    and not (self.connector is not None and self.connector.has_pending_block_frees())
                ):
                    self._kvp_choose_victim(request)
            elif pins is not None and len(pins) and not self.running:
                # Liveness: nothing runs and the next waiting request does not fit.
                while blocks is None and len(pins):
                    self._kvp_release_pressure()
                    blocks = self._kvp_orig_allocate(request, *args, **kwargs)
        except Exception as e:
            self._kvp_internal_error("allocate", e)
        self._kvp_inner_s += _perf() - t0
        return blocks

    def _kvp_release_pressure(self) -> None:
        pid = self._kvp_pins.release_one_for_pressure()
        self._kvp_pin_info.pop(pid, None)

    def _kvp_choose_victim(self, request: Any) -> None:
        running = self.running
        try:
            i = running.index(request)
        except ValueError:
            return
        pool = running[i:]
        if len(pool) <= 1:
            return  # vLLM preempts the request itself: there is no other choice
        now = self.kvpilot_clock()
        cands = self._kvp_candidates(pool, now)
        try:
            dec = self._kvp_call("preempt", self.kvpilot_policy.preempt, cands, self._kvp_state(now))
        except _StepFallback:
            return
        if dec is None:
            return
        if not isinstance(dec, PreemptionDecision):
            self._kvp_fail("preempt", "exception", TypeError(f"preempt() returned {type(dec).__name__}"))
            return
        victim = None
        idx = -1
        if dec.victim is not None:
            for j, r in enumerate(pool):
                if r.request_id == dec.victim:
                    victim, idx = r, j
                    break
        if self._kvp_log_decisions:
            preds = dec.predictions or {}
            self._kvp_log_decision(
                "preempt",
                now,
                [c.request_id for c in cands],
                [c.features(preds.get(c.request_id)) for c in cands],
                idx if victim is not None else len(pool) - 1,
                dec.propensity,
            )
        if victim is None or victim is running[-1]:
            return
        running.remove(victim)
        running.append(victim)
        self.kvpilot_stats.policy_victims += 1

    # ============================================================ retention
    def _kvp_retain(self, now: float) -> None:
        freed = self._kvp_freed
        self._kvp_freed = []
        pins = self._kvp_pins
        pin_info = self._kvp_pin_info
        prefixes: list[CachedPrefix] = []
        by_id: dict[str, tuple] = {}
        for f in freed:
            g = self._kvp_groups.get(f.meta.group_id) if f.meta.group_id is not None else None
            pending = max(0, (f.meta.group_size or 0) - g[0]) if g is not None and f.meta.group_size else 0
            cp = CachedPrefix(
                prefix_id=f.request_id,
                owner_request_id=f.request_id,
                owner_state=f.owner_state,
                meta=f.meta,
                block_ids=tuple(b.block_id for b in f.blocks),
                block_hashes=_hashes64(f),
                last_used_s=f.time_s,
                group_pending=pending,
            )
            prefixes.append(cp)
            by_id[f.request_id] = ("freed", f)
        for pid, pin in pins.pins.items():
            if pid in by_id:
                continue
            pi = pin_info.get(pid)
            if pi is None:
                continue
            prefixes.append(
                CachedPrefix(
                    prefix_id=pid,
                    owner_request_id=pid,
                    owner_state=pi.owner_state,
                    meta=pi.meta,
                    block_ids=tuple(b.block_id for b in pin.blocks),
                    block_hashes=_hashes64(pi)[: len(pin.blocks)],
                    last_used_s=pi.last_used_s,
                    hits=pi.hits,
                    protected_until_s=pin.expires_at,
                )
            )
            by_id[pid] = ("pinned", pin)
        try:
            dec = self._kvp_call("retain", self.kvpilot_policy.retain, prefixes, self._kvp_state(now))
        except _StepFallback:
            return
        if dec is None:
            return
        if not isinstance(dec, RetentionDecision):
            self._kvp_fail("retain", "exception", TypeError(f"retain() returned {type(dec).__name__}"))
            return
        if dec.release:
            for pid in pins.release_policy(dec.release):
                pin_info.pop(pid, None)
        st = self.kvpilot_stats
        log = self._kvp_log_decisions
        feats = {cp.prefix_id: cp for cp in prefixes} if log else None
        preds = dec.predictions or {}
        for pid, ret in (dec.actions or {}).items():
            entry = by_id.get(pid)
            if entry is None:
                continue
            action = ret.action
            if action is RetentionAction.PROTECT:
                if entry[0] == "freed":
                    f = entry[1]
                    n = pins.protect(pid, f.blocks, f.hashes, ret.ttl_s, now)
                    if n:
                        pin_info[pid] = _PinInfo(f.meta, f.owner_state, f.hashes, f.time_s, hashes64=f.hashes64)
                        st.protected += 1
                else:
                    pins.protect(pid, (), (), ret.ttl_s, now)  # renew
            elif action is RetentionAction.DEMOTE:
                if entry[0] == "pinned":
                    pin = entry[1]
                    blocks = list(pin.blocks)
                    hashes = [b.block_hash for b in blocks]
                    pins.release_policy((pid,))
                    pin_info.pop(pid, None)
                else:
                    blocks, hashes = entry[1].blocks, entry[1].hashes
                st.demoted_blocks += pins.demote(blocks, hashes)
            if log:
                cp = feats[pid]
                self._kvp_log_decision(
                    "retain",
                    now,
                    [pid],
                    [cp.features(now, preds.get(pid))],
                    0,
                    ret.propensity,
                    action=action.value,
                    ttl_s=ret.ttl_s if action is RetentionAction.PROTECT else None,
                )

    def _kvp_session_resumed(self, session_id: str) -> None:
        for pi in self._kvp_pin_info.values():
            if pi.meta.session_id == session_id and pi.owner_state is OwnerState.PAUSED_TOOL:
                pi.owner_state = OwnerState.RUNNING

    # ============================================================= eviction
    def _kvp_before_evict(self, num_blocks: int) -> None:
        """Called by the pool right before an allocation that evicts cached blocks.

        Disarms itself: the policy is asked at most once per engine step
        (``schedule()`` re-arms it); the order it gives stays in the free list
        for the rest of the step.
        """
        self._kvp_pool.kvpilot_eviction_hook = None
        t0 = _perf()
        try:
            self._kvp_evict(num_blocks)
        except Exception as e:
            self._kvp_internal_error("evict", e)
        self._kvp_inner_s += _perf() - t0

    def _kvp_count_moved(self, n: int) -> None:
        self.kvpilot_stats.evict_first_blocks += n

    def _kvp_plan_failed(self, e: BaseException) -> None:
        self._kvp_internal_error("evict", e)

    def _kvp_evict(self, num_blocks: int) -> None:
        if self._kvp_step_fallback:
            return  # this step already fell back to vLLM's behaviour (LRU)
        found = self._kvp_index.candidates(self._kvp_evict_cap)
        if not found:
            return
        now = self.kvpilot_clock()
        sessions = self._kvp_sessions
        groups = self._kvp_groups
        ids_of = self._kvp_index.block_ids
        last = self._kvp_offered  # the previous step's CachedPrefix objects, reused while unchanged
        offered: dict[str, tuple[_Freed, CachedPrefix]] = {}
        prefixes: list[CachedPrefix] = []
        for pid, f, n in found:
            meta = f.meta
            state = f.owner_state
            if state is OwnerState.PAUSED_TOOL and sessions.get(meta.session_id) != (meta.turn or 0):
                state = OwnerState.RUNNING  # the session's next turn has arrived
            g = groups.get(meta.group_id) if meta.group_id is not None else None
            pending = max(0, (meta.group_size or 0) - g[0]) if g is not None and meta.group_size else 0
            prev = last.get(pid)
            cp = prev[1] if prev is not None and prev[0] is f else None
            if cp is None or len(cp.block_ids) != n or cp.owner_state is not state or cp.group_pending != pending:
                h64 = _hashes64(f)
                cp = CachedPrefix(
                    prefix_id=pid,
                    owner_request_id=f.request_id,
                    owner_state=state,
                    meta=meta,
                    block_ids=ids_of(pid)[:n],
                    block_hashes=h64[:n],
                    last_used_s=f.time_s,
                    group_pending=pending,
                )
            offered[pid] = (f, cp)
            prefixes.append(cp)
        self._kvp_offered = offered
        st = self.kvpilot_stats
        st.eviction_calls += 1
        try:
            dec = self._kvp_call("evict", self.kvpilot_policy.evict, prefixes, num_blocks, self._kvp_state(now))
        except _StepFallback:
            return
        if dec is None:
            return
        if not isinstance(dec, EvictionDecision):
            self._kvp_fail("evict", "exception", TypeError(f"evict() returned {type(dec).__name__}"))
            return
        by_id = {pid: (f, n) for pid, f, n in found}  # n: cached length, unchanged since candidates()
        chains = []
        seen: set = set()
        first = None
        for pid in dec.order or ():
            fn = by_id.get(pid)
            if fn is None or pid in seen:
                continue
            seen.add(pid)
            chains.append((fn[0].blocks, fn[0].hashes, fn[1]))
            if first is None:
                first = pid
        if chains and evict_first(self._kvp_pool, chains, num_blocks, self._kvp_count_moved, self._kvp_plan_failed):
            st.eviction_orders += 1
        if self._kvp_log_decisions:
            idx = next((i for i, cp in enumerate(prefixes) if cp.prefix_id == first), -1)
            preds = dec.predictions or {}
            self._kvp_log_decision(
                "retain",
                now,
                [cp.prefix_id for cp in prefixes],
                [cp.features(now, preds.get(cp.prefix_id)) for cp in prefixes],
                idx,
                dec.propensity,
                action="evict",
            )

    # ====================================================== step bookkeeping
    def _kvp_after_schedule(self, out: Any, now: float, ev0: int) -> None:
        st = self.kvpilot_stats
        new_ids = [d.req_id for d in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        nst = out.num_scheduled_tokens
        reqs = self.requests
        infos = self._kvp_reqs
        queries = hits = 0
        admitted = new_ids + [rid for rid in resumed if rid not in new_ids] if resumed else new_ids
        events = self._kvp_events
        pin_info = self._kvp_pin_info
        for rid in admitted:
            r = reqs.get(rid)
            if r is None:
                continue
            hit = r.num_computed_tokens - nst.get(rid, 0)
            queries += r.num_tokens
            hits += hit
            info = infos.get(rid)
            if info is None:
                continue
            if info.first_scheduled_s is None:
                info.first_scheduled_s = now
                info.cached_tokens = hit
                self._kvp_prefilling.add(rid)
            if not info.running:
                info.running = True
                g = self._kvp_group(info.meta)
                if g is not None:
                    g[1] += 1
            if hit > 0 and pin_info and r.block_hashes:
                h0 = r.block_hashes[0]
                for pi in pin_info.values():
                    if pi.hashes and _bh(pi.hashes[0]) == h0:
                        pi.hits += 1
                        pi.last_used_s = now
            if events:
                self._kvp_emit(EventKind.SCHEDULED, r, info.meta)
        st.prefix_queries += queries
        st.prefix_hits += hits
        w = self.kvpilot_telemetry
        if w is None:
            return
        total = out.total_num_scheduled_tokens
        decode = 0
        admitted_set = set(admitted)
        stride = self.kvpilot_decode_stride
        for rid, n in nst.items():
            if n <= stride and rid not in admitted_set:
                decode += n
        pool = self._kvp_pool
        # Written at the step's end (update_from_output), when its duration is known.
        self._kvp_step_rows.append(
            {
                "engine_step": self._kvp_step_no,
                "replica": self._kvp_replica,
                "time_s": now,
                "duration_s": 0.0,
                "running": len(self.running),
                "waiting": len(self.waiting) + len(self.kv_holding_waiting),
                "free_blocks": pool.get_num_free_blocks(),
                "pinned_blocks": self.kvpilot_pinned_blocks,
                "kv_usage": min(1.0, max(0.0, pool.get_usage())),
                "prefill_tokens": total - decode,
                "decode_tokens": decode,
                "prefix_queries": queries,
                "prefix_hits": hits,
                "preemptions": self._kvp_step_preemptions,
                "evictions": pool.kvpilot_evictions - ev0,
                "hook_fallback": self._kvp_step_fallback,
                "dropped_rows": w.dropped,
            }
        )

    def _kvp_finished(self, request: Any) -> None:
        rid = request.request_id
        info = self._kvp_reqs.pop(rid, None)
        self._kvp_prefilling.discard(rid)
        if info is None:
            return
        meta = info.meta
        reason = request.get_finished_reason()
        rs = str(reason) if reason is not None else "abort"
        if rs not in ("stop", "length", "abort"):
            rs = "abort"  # vLLM's "error"
        if meta.tool and rs != "abort":
            rs = "tool_call"
            if meta.session_id is not None:
                self._kvp_sessions[meta.session_id] = meta.turn or 0
        g = self._kvp_group(meta)
        if g is not None:
            g[0] += 1
            if info.running:
                g[1] -= 1
            g[2] = g[2] + (request.num_output_tokens,)
            if meta.group_size and g[0] >= meta.group_size and g[1] == 0:
                self._kvp_groups.pop(meta.group_id, None)
        if self._kvp_events:
            self._kvp_emit(EventKind.FINISHED, request, meta, finish_reason=rs)
            if rs == "tool_call":
                self._kvp_emit(EventKind.TOOL_CALL_STARTED, request, meta, finish_reason=rs)
        w = self.kvpilot_telemetry
        if w is None:
            return
        now = self.kvpilot_clock()
        if info.first_token_s is None and request.num_output_tokens > 0:
            info.first_token_s = now  # its first token was also its last (freed before the prefill check)
        w.put(
            "requests",
            {
                "request_id": rid,
                "session_id": meta.session_id,
                "group_id": meta.group_id,
                "prompt_id": meta.prompt_id,
                "step": meta.step,
                "turn": meta.turn,
                "domain": meta.domain,
                "paradigm": meta.paradigm,
                "replica": self._kvp_replica,
                "arrival_s": info.arrival_s,
                "first_scheduled_s": info.first_scheduled_s,
                "first_token_s": info.first_token_s,
                "finish_s": max(now, info.arrival_s),
                "prompt_tokens": request.num_prompt_tokens,
                "cached_tokens": max(0, min(info.cached_tokens, request.num_prompt_tokens)),
                "output_tokens": request.num_output_tokens,
                "computed_tokens": info.computed_tokens,
                "max_tokens": request.max_tokens,
                "finish_reason": rs,
                "preemptions": request.num_preemptions,
                # the prompt's full blocks (as in the workload table); output blocks are in kv_events
                "block_hashes": hashes_to_int64(
                    request.block_hashes[: request.num_prompt_tokens // self.hash_block_size]
                ),
            },
        )

    def _kvp_take_events(self):
        events = self._kvp_orig_take_events()
        w = self.kvpilot_telemetry if self._kvp_log_kv_events else None
        listener = self.kvpilot_kv_event_listener
        if events and (w is not None or listener is not None):
            try:
                if w is None:  # the listener only: kinds and hashes, no rows
                    for kind, hashes in kv_event_hashes(events):
                        listener(kind, hashes)
                    return events
                for row in kv_event_rows(
                    events, time_s=self.kvpilot_clock(), replica=self._kvp_replica, engine_step=self._kvp_step_no
                ):
                    w.put("kv_events", row)
                    if listener is not None:
                        listener(row["event"], row["block_hashes"])
            except Exception as e:
                self._kvp_internal_error("kv_events", e)
        return events


def _keeps_order(order: Any, cands: list) -> bool:
    """True when ``order`` lists the first ``len(order)`` candidates in their own order (nothing moves)."""
    return len(order) <= len(cands) and all(rid == c.request_id for rid, c in zip(order, cands))


def _bh(h: Any) -> Any:
    """The plain block hash of a ``BlockHashWithGroupId`` (vLLM packs the group id in)."""
    return get_block_hash(h)


def _build_writer(cfg: HookConfig):
    if not cfg.telemetry_dir:
        return None
    try:
        from serving_hook.telemetry import TelemetryWriter

        meta = {"decisions": {"kvpilot.feature_names": json.dumps({k: list(v) for k, v in FEATURE_NAMES.items()})}}
        return TelemetryWriter(cfg.telemetry_dir, metadata=meta)
    except Exception as e:
        raise HookConfigError(
            f"kvpilot: cannot write telemetry to KVPILOT_TELEMETRY_DIR={cfg.telemetry_dir!r}: {e}"
        ) from e


class KVPilotScheduler(KVPilotMixin, Scheduler):
    """vLLM's ``Scheduler`` with the kvpilot hook."""


class KVPilotAsyncScheduler(KVPilotMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with the kvpilot hook (vLLM's default on GPUs)."""


def with_policy(
    base: type = KVPilotScheduler,
    policy: Optional[Callable[[], Policy] | Policy] = None,
    config: Optional[HookConfig] = None,
    name: Optional[str] = None,
    shared_writer: Any = None,
) -> type:
    """A subclass of ``base`` that uses ``policy`` (an instance or a factory) and ``config``.

    ``shared_writer``: a telemetry writer the caller owns (and closes), used instead of
    ``config.telemetry_dir``. For the simulator and tests; serving uses environment variables.
    """
    attrs: dict[str, Any] = {}
    if shared_writer is not None:
        attrs["kvpilot_shared_writer"] = shared_writer
    if policy is not None:
        if isinstance(policy, Policy):
            inst = policy
            attrs["kvpilot_policy_factory"] = staticmethod(lambda: inst)
        else:
            attrs["kvpilot_policy_factory"] = staticmethod(policy)
    if config is not None:
        attrs["kvpilot_config"] = config
    return type(name or f"{base.__name__}With", (base,), attrs)
