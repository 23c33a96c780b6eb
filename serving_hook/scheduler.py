"""kvpilot's scheduler hook: one mixin over vLLM 0.33's ``Scheduler`` and ``AsyncScheduler``.

``KVPilotScheduler`` / ``KVPilotAsyncScheduler`` take exactly vLLM's
constructor arguments, so ``--scheduler-cls serving_hook.KVPilotAsyncScheduler``
builds them. The hook configuration comes from environment variables
(:mod:`serving_hook.config`) and is validated, and the policy built, *before*
vLLM's own constructor runs: a bad configuration fails at start-up.

The mixin holds only vLLM's overrides and kvpilot's public extras; it builds
the parts and wires them to the points where vLLM decides. As in vLLM's own v1
core, policy and mechanism are apart, with plain records between them:

* :mod:`serving_hook.guard`: the step's time budget, fallback to vLLM's
  behaviour, failure counting and log-once (:class:`~serving_hook.guard.HookStats`);
* :mod:`serving_hook.translate`: vLLM's requests as the plain records a policy
  sees (candidates, engine state, events), and the per-request, group and
  session bookkeeping;
* :mod:`serving_hook.rows`: the telemetry rows and the KV-event forwarding;
* one module per lever, each a :class:`serving_hook.lever.Lever` built here
  only when the policy uses it; each module describes how its lever reaches
  vLLM (with vLLM's line numbers): :mod:`serving_hook.admission`,
  :mod:`serving_hook.preemption`, :mod:`serving_hook.retention` (with the pins
  of :mod:`serving_hook.pins`) and :mod:`serving_hook.eviction`; :mod:`serving_hook.offload` is the
  CPU offload tier (vLLM's native KV offloading) as policies and telemetry see it;
* :mod:`serving_hook.block_pool`: the pool mechanism (class swap, eviction
  counter and hook, prefix tree).

**Zero-cost default.** With a policy that uses no lever (``VllmDefaultPolicy``)
and no telemetry, every override is a single flag test and ``super()`` call;
no wrapper is installed.

**Failure isolation.** Every policy call is timed and wrapped
(:mod:`serving_hook.guard`). An exception, or a call that returns after the
step's budget is spent, is discarded: that decision (and the rest of the
step's decisions) fall back to vLLM's behaviour, the failure kind is logged
once (logger ``kvpilot.hook``), counted in ``kvpilot_stats`` and flagged in the
step's ``steps`` telemetry row (``hook_fallback``). Internal errors of the hook
itself are handled the same way.

**Registry model.** With policy ``registry``
(:class:`serving_hook.model_source.RegistryPolicy`) the model comes from the
MLflow registry (``KVPILOT_MODEL_URI``): loaded at start-up, polled on a
background thread every ``KVPILOT_MODEL_POLL_S`` seconds, and swapped in at the
start of ``schedule()`` (``_kvp_between_steps``), never inside a step. A step
without any loaded model falls back to vLLM's behaviour (``hook_fallback``,
counted as ``model:none``); ``kvpilot_stats`` has ``model_version``,
``model_swaps`` and ``model_failures`` (loads and polls that failed; also in ``steps`` telemetry, as each step
started), and decisions telemetry records the version
(``policy_version`` ``kvpilot/N``). At a swap the old model's per-session state (RL step phase, starvation
clocks, feature rows, paused sessions) goes to the new one (``model_source.carry_state``; counted in
``state_carried`` / ``state_dropped``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Optional

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus as VRS

from policy.interface import Policy
from serving_hook.admission import AdmissionLever
from serving_hook.block_pool import install_eviction_counter
from serving_hook.config import HookConfig, build_policy, load_config
from serving_hook.eviction import EvictionLever
from serving_hook.guard import Guard, HookStats
from serving_hook.host_tier import HostTierLever, bind
from serving_hook.idle import engine_input_queue, wait_for_input
from serving_hook.model_source import RegistryPolicy, carry_state
from serving_hook.offload import OffloadTier, tier_of
from serving_hook.preemption import PreemptionLever
from serving_hook.retention import RetentionLever
from serving_hook.rows import Rows, open_writer
from serving_hook.translate import Translator

logger = logging.getLogger("kvpilot.hook")

_perf = time.perf_counter


def _budget(policy: Policy, cfg: HookConfig) -> float:
    """The policy's time per step: its own ``decision_budget_s``, else the configuration's."""
    budget = policy.decision_budget_s
    return float(budget) if budget else cfg.decision_budget_s


class KVPilotMixin:
    """The hook. Mix in before vLLM's ``Scheduler`` / ``AsyncScheduler``."""

    # Class-level defaults: every override passes through until _kvp_setup ran.
    _kvp_passthrough = True
    _kvp_rows: Optional[Rows] = None
    _kvp_retention: Optional[RetentionLever] = None
    _kvp_tier: Optional[OffloadTier] = None
    _kvp_host: Optional[HostTierLever] = None
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
        writer = shared if shared is not None else open_writer(cfg)
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
        self.kvpilot_stats = HookStats()
        #: Clock for TTLs, wait times and telemetry (seconds). vLLM stamps
        #: ``Request.arrival_time`` with ``time.time()``; the simulator replaces it.
        self.kvpilot_clock: Callable[[], float] = time.time
        #: Most tokens a running request decodes in one step; the simulator's decode
        #: stride sets it (telemetry counts a chunk of up to this many as decode tokens).
        self.kvpilot_decode_stride = 1
        guard = self._kvp_guard = Guard(policy, self.kvpilot_stats, _budget(policy, cfg))
        rows = self._kvp_rows = Rows(self, guard, policy, writer, cfg.replica)
        fcfs = isinstance(self.waiting, FCFSRequestQueue)
        admission = policy.uses_admission and fcfs
        preemption = policy.uses_preemption and fcfs
        caching = self.cache_config.enable_prefix_caching
        retention = policy.uses_retention and caching
        eviction = policy.uses_eviction and caching
        if (policy.uses_admission or policy.uses_preemption) and not fcfs:
            logger.warning(
                "kvpilot: policy %s wants admission/preemption, but vLLM runs --scheduling-policy %s; "
                "those levers are left to vLLM",
                policy.name,
                self.scheduler_config.policy,
            )
        if (policy.uses_retention or policy.uses_eviction) and not caching:
            logger.warning("kvpilot: prefix caching is off; the retention and eviction levers are disabled")
        tier = self._kvp_tier = tier_of(self, cfg.kv_block_bytes, cfg.host_link_gbps)
        if policy.uses_offload and tier is None:
            logger.warning("kvpilot: policy %s expects a CPU offload tier, but vLLM runs without native KV "
                           "offloading (--kv-offloading-size); its OFFLOAD answers act as KEEP", policy.name)
        host = policy.uses_host_eviction and tier is not None
        active = admission or preemption or retention or eviction or host or policy.uses_events
        #: Everything off: every override just calls vLLM.
        self._kvp_passthrough = not active and writer is None
        if isinstance(policy, RegistryPolicy):
            # The registry's model: swapped in between steps (_kvp_between_steps), polled off this thread.
            self._kvp_registry = policy
            self.kvpilot_stats.model_version = policy.model_version
            self.kvpilot_stats.model_failures = policy.source.stats.failed  # (a failed start-up load, before any step)
            policy.source.start(cfg.model_poll_s)
        if self._kvp_passthrough:
            return
        pool = self.kv_cache_manager.block_pool
        install_eviction_counter(pool)
        self._kvp_pool = pool
        tr = self._kvp_translate = Translator(self, guard, policy.uses_events, tier)
        parts = (self, policy, guard, tr, rows)
        # The levers the policy uses (None: left to vLLM); each module says how it reaches vLLM.
        self._kvp_admission = AdmissionLever(*parts, cfg.max_hold_s) if admission else None
        #: The engine process's input queue, which an idle held engine waits on (None: in-process engine).
        self._kvp_inputs = engine_input_queue() if admission else None
        self._kvp_preemption = PreemptionLever(*parts) if preemption else None
        max_pinned = int(cfg.max_pinned_fraction * tr.num_blocks)
        self._kvp_retention = RetentionLever(*parts, max_pinned) if retention else None
        self._kvp_eviction = EvictionLever(*parts) if eviction else None
        self._kvp_host = bind(self, *parts) if host else None
        if host and self._kvp_host is None:
            logger.warning("kvpilot: policy %s orders the CPU tier's evictions, but vLLM's tier runs another cache "
                           "policy (set the connector's eviction_policy / cache_policy_module_path: "
                           "serving_hook.host_tier); its LRU is kept", policy.name)
        if preemption or retention:
            self._kvp_orig_allocate = self.kv_cache_manager.allocate_slots
            self.kv_cache_manager.allocate_slots = self._kvp_allocate_slots
        pool.kvpilot_tree = eviction or retention  # exclusive tails: the levers that move blocks
        if rows.log_kv_events:
            rows.watch_kv_events()

    # ======================================================== vLLM overrides
    def add_request(self, request: Any) -> None:
        super().add_request(request)
        if self._kvp_passthrough:
            return
        t0 = _perf()
        try:
            sid = self._kvp_translate.add(request)
            if sid is not None and self._kvp_retention is not None:
                self._kvp_retention.session_resumed(sid)
        except Exception as e:  # never into vLLM
            self._kvp_guard.internal_error("add_request", e)
        self.kvpilot_stats.side_time_s += _perf() - t0

    def schedule(self, *args: Any, **kwargs: Any):
        if self._kvp_passthrough:
            return super().schedule(*args, **kwargs)
        t0 = _perf()
        guard = self._kvp_guard
        guard.begin_step()
        self._kvp_rows.preemptions = 0
        if self._kvp_registry is not None:
            self._kvp_between_steps()
        ev0 = self._kvp_pool.kvpilot_evictions
        if self._kvp_eviction is not None:
            self._kvp_eviction.rearm()
        now = self.kvpilot_clock()
        self._kvp_translate.step_started(now)
        admission = self._kvp_admission
        held: list = []
        desired: Optional[list] = None
        try:
            if self._kvp_retention is not None:
                self._kvp_retention.before_step(now)
            if admission is not None:
                held, desired = admission.admit(now)
        except Exception as e:
            guard.internal_error("pre-schedule", e)
        t1 = _perf()
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            t2 = _perf()
            guard.decided = True
            if held:
                admission.restore(held, desired)
        idle = quiet = False  # idle: every waiting request held and nothing ran; quiet: and nothing new to log
        waited = 0.0
        try:
            if admission is not None:
                # every queued request held (one vLLM skipped, e.g. while its KV loads, is vLLM's to wait for)
                idle = (bool(held) and not out.total_num_scheduled_tokens and not self.running
                        and len(held) == len(self.waiting) + len(self.kv_holding_waiting))
                quiet = idle and not admission.logged and admission.quiet_ids is not None
                if idle:
                    waited = self._kvp_idle_wait(held, now)
                else:
                    admission.busy()
            self._kvp_after_schedule(out, now, ev0, len(held), log_step=not quiet)
        except Exception as e:
            guard.internal_error("post-schedule", e)
        st = self.kvpilot_stats
        st.idle_held_steps += idle
        # The hook's own time: its work before and after vLLM's schedule(),
        # plus its work inside it (the allocate_slots wrapper: pins, victims).
        hook_s = (t1 - t0) + (_perf() - t2 - waited) + guard.inner_s
        guard.inner_s = 0.0
        st.last_hook_time_s = hook_s
        st.hook_time_s += hook_s
        self._kvp_rows.hook_time(hook_s)
        st.steps += 1
        if guard.fallback:
            st.fallback_steps += 1
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):
        if self._kvp_passthrough:
            return super().update_from_output(scheduler_output, model_runner_output)
        tr = self._kvp_translate
        rows = self._kvp_rows
        t0 = _perf()
        if rows.writer is not None:
            try:
                tr.count_computed(scheduler_output.num_scheduled_tokens)
            except Exception as e:
                self._kvp_guard.internal_error("update_from_output", e)
        t1 = _perf()
        outs = super().update_from_output(scheduler_output, model_runner_output)
        t2 = _perf()
        rows.end_step()
        if rows.writer is not None and not self.get_num_unfinished_requests():
            rows.writer.flush()  # idle: nothing of this engine waits in memory for a kill (telemetry module)
        try:
            if tr.prefilling:
                tr.first_tokens()
        except Exception as e:
            self._kvp_guard.internal_error("update_from_output", e)
        self.kvpilot_stats.side_time_s += (t1 - t0) + (_perf() - t2)
        return outs

    def _preempt_request(self, request: Any, timestamp: float, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, timestamp, *args, **kwargs)
        if self._kvp_passthrough:
            return
        t0 = _perf()
        self._kvp_rows.preemptions += 1
        st = self.kvpilot_stats
        st.preemptions += 1
        try:
            self._kvp_translate.preempted(request)
        except Exception as e:
            self._kvp_guard.internal_error("preempt", e)
        st.side_time_s += _perf() - t0

    def _free_blocks(self, request: Any) -> None:
        if self._kvp_passthrough or (self._kvp_retention is None and self._kvp_eviction is None):
            return super()._free_blocks(request)
        t0 = _perf()
        try:
            groups = self.kv_cache_manager.coordinator.get_blocks(request.request_id)
            blocks = [b for g in groups for b in g if not b.is_null and b.block_hash is not None]
            hashes = [b.block_hash for b in blocks]
        except Exception as e:
            self._kvp_guard.internal_error("free_blocks", e)
            blocks = []
            hashes = []
        t1 = _perf()
        super()._free_blocks(request)
        t2 = _perf()
        st = self.kvpilot_stats
        if not blocks:
            st.side_time_s += (t1 - t0)
            return
        try:
            freed = self._kvp_translate.freed(request, blocks, hashes)
            if self._kvp_retention is not None:
                self._kvp_retention.note_freed(freed)
            if self._kvp_eviction is not None:
                self._kvp_eviction.note_freed(freed)
        except Exception as e:
            self._kvp_guard.internal_error("free_blocks", e)
        st.side_time_s += (t1 - t0) + (_perf() - t2)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any):
        result = super()._free_request(request, *args, **kwargs)
        if self._kvp_passthrough:
            return result
        t0 = _perf()
        try:
            done = self._kvp_translate.finished(request)
            if done is not None and self._kvp_rows.writer is not None:
                n = request.num_prompt_tokens
                self._kvp_rows.request(
                    request.request_id,
                    *done,
                    prompt_tokens=n,
                    output_tokens=request.num_output_tokens,
                    max_tokens=request.max_tokens,
                    preemptions=request.num_preemptions,
                    block_hashes=request.block_hashes[: n // self.hash_block_size],
                )
        except Exception as e:
            self._kvp_guard.internal_error("finish", e)
        self.kvpilot_stats.side_time_s += _perf() - t0
        return result

    def reset_prefix_cache(self, *args: Any, **kwargs: Any):
        if self._kvp_passthrough:
            return super().reset_prefix_cache(*args, **kwargs)
        retention = self._kvp_retention
        # vLLM refuses to reset while any block is held (block_pool.reset_prefix_cache): the pins go only where
        # that leaves the reset to succeed (running requests preempted, or pins the only holders); where a request
        # still holds blocks, vLLM refuses anyway and the pinned sessions keep their prefixes.
        force = bool(args[0]) if args else bool(kwargs.get("reset_running_requests", False))
        if retention is not None and (force or self._kvp_only_pins_hold_blocks()):
            retention.release_all()
        if self._kvp_host is not None:
            self._kvp_host.forget_step()
        ok = super().reset_prefix_cache(*args, **kwargs)
        if ok and self._kvp_eviction is not None:
            self._kvp_eviction.index.clear()
        return ok

    def _kvp_only_pins_hold_blocks(self) -> bool:
        pool = self.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - pool.get_num_free_blocks() - 1 == self.kvpilot_pinned_blocks  # (1: null)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.kvpilot_close()

    # ============================================ vLLM's allocation, wrapped
    def _kvp_allocate_slots(self, request: Any, *args: Any, **kwargs: Any):
        """``kv_cache_manager.allocate_slots``, wrapped: when it fails, release pins, then choose the victim.

        See :mod:`serving_hook.preemption` (and :mod:`serving_hook.retention` for the pins). Only the hook's own
        work is guarded: an error raised by vLLM's allocation, the first or a retry after a pin's release, is
        vLLM's and reaches its caller as it would without the hook.
        """
        blocks = self._kvp_orig_allocate(request, *args, **kwargs)
        if blocks is not None:
            return blocks
        t0 = _perf()
        ret = self._kvp_retention
        running = request.status == VRS.RUNNING
        # running: vLLM preempts next, so release pins first (pressure); waiting while nothing runs (liveness):
        # the next waiting request does not fit
        if ret is not None and (running or not self.running):
            while blocks is None and self._kvp_release_pin(ret):
                blocks = self._kvp_orig_allocate(request, *args, **kwargs)
        if (running and blocks is None and self._kvp_preemption is not None
                and not (self.connector is not None and self.connector.has_pending_block_frees())):
            try:
                self._kvp_preemption.choose_victim(request)
            except Exception as e:
                self._kvp_guard.internal_error("allocate", e)
        self._kvp_guard.inner_s += _perf() - t0
        return blocks

    def _kvp_release_pin(self, ret: Any) -> bool:
        """Release one pinned block (the retention lever); False when none is left or the lever failed."""
        try:
            return bool(ret.release_one())
        except Exception as e:
            self._kvp_guard.internal_error("allocate", e)
            return False

    # ====================================================== step bookkeeping
    def _kvp_idle_wait(self, held: list, now: float) -> float:
        """Every waiting request held, nothing ran: wait for a new input or the first hold's release instead of
        spinning through empty steps (:mod:`serving_hook.idle`). Only on a real-time engine (the simulator's
        clock jumps to its next event). Returns the seconds waited."""
        release = self._kvp_admission.idle_release_s(held, now)
        if release <= 0 or self.kvpilot_clock is not time.time:
            return 0.0
        t0 = _perf()
        if self._kvp_inputs is not None:
            wait_for_input(self._kvp_inputs, release)
        else:
            time.sleep(min(release, self._kvp_admission.fallback_s()))
        waited = _perf() - t0
        self.kvpilot_stats.idle_wait_s += waited
        return waited

    def _kvp_after_schedule(self, out: Any, now: float, ev0: int, held: int, log_step: bool = True) -> None:
        """After vLLM's ``schedule()``: note whom it admitted, count pin hits, stamp the ``steps`` row
        (``log_step`` off: a repeated idle held step, not logged)."""
        ret = self._kvp_retention
        heads: Optional[list] = [] if ret is not None and ret.pin_info else None
        admitted, queries, hits = self._kvp_translate.scheduled(out, now, heads)
        if heads:
            ret.note_hits(heads, now)
        rows = self._kvp_rows
        if rows.writer is None or not log_step:
            return
        pool = self._kvp_pool
        tier = self._kvp_tier
        loaded, stored = OffloadTier.step_blocks(out) if tier is not None else (0, 0)
        rows.step(
            now,
            out.num_scheduled_tokens,
            out.total_num_scheduled_tokens,
            admitted,
            queries,
            hits,
            running=len(self.running),
            waiting=len(self.waiting) + len(self.kv_holding_waiting),
            free_blocks=pool.get_num_free_blocks(),
            pinned_blocks=self.kvpilot_pinned_blocks,
            kv_usage=pool.get_usage(),
            evictions=pool.kvpilot_evictions - ev0,
            held=held,
            offload_loaded_blocks=loaded,
            offload_stored_blocks=stored,
            offload_block_bytes=tier.block_bytes if tier is not None else 0,
            model_failures=self.kvpilot_stats.model_failures if self._kvp_registry is not None else None,
        )

    def _kvp_between_steps(self) -> None:
        """Policy ``registry``: swap in a newly loaded version, or fall back for this step without a model.

        Runs first thing in ``schedule()``, so a step's decisions all come from one version.
        """
        reg = self._kvp_registry
        st = self.kvpilot_stats
        guard = self._kvp_guard
        try:
            old = reg.current
            if reg.swap_pending():
                st.model_swaps += 1
                guard.new_policy()
                carried = carry_state(old, reg.current)  # the sessions' phase, clocks, rows: see Policy.export_state
                if carried is not None:
                    st.state_carried += carried
                    st.state_dropped += not carried
                guard.budget_s = guard.budget_left = _budget(self.kvpilot_policy, self.kvpilot_cfg)
                if self._kvp_eviction is not None:
                    self._kvp_eviction.set_cap(self.kvpilot_policy.max_eviction_candidates)
        except Exception as e:
            guard.internal_error("model-swap", e)
        st.model_version = reg.model_version
        st.model_failures = reg.source.stats.failed
        if not reg.has_model:
            guard.skip("model:none")  # no policy call this step: vLLM's own behaviour

    # ========================================================= public extras
    @property
    def kvpilot_telemetry(self) -> Any:
        """The telemetry writer (None: no telemetry)."""
        rows = self._kvp_rows
        return rows.writer if rows is not None else None

    @kvpilot_telemetry.setter
    def kvpilot_telemetry(self, writer: Any) -> None:
        self._kvp_rows.writer = writer

    def kvpilot_set_kv_event_listener(self, listener: Optional[Callable[[str, list], None]]) -> None:
        """Call ``listener(kind, block_hashes)`` for each of this engine's KV events (``stored`` / ``removed`` /
        ``cleared``, hashes as signed int64) at each step's end; the simulator feeds its KV-aware router with
        it, as llm-d reads vLLM's event stream. Needs the hook's non-passthrough mode."""
        self._kvp_rows.listener = listener
        if listener is not None and not self._kvp_passthrough:
            self._kvp_rows.watch_kv_events()

    def kvpilot_close(self) -> None:
        """Flush and stop the telemetry writer (idempotent); a shared writer is only detached.

        Then stops the registry policy's poll thread: a poll inside a slow registry call may hold that for
        seconds, which must not come out of the engine's shutdown grace before the telemetry is flushed.
        """
        w = self.kvpilot_telemetry
        if w is not None:
            self.kvpilot_telemetry = None
            if w is not self.kvpilot_shared_writer:
                w.close()
        if self._kvp_registry is not None:
            self._kvp_registry.source.stop()

    @property
    def kvpilot_pinned_blocks(self) -> int:
        """Distinct blocks held by the retention lever's pins."""
        ret = self._kvp_retention
        return ret.pins.num_pinned_blocks if ret is not None else 0


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
