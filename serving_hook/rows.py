"""The hook's telemetry rows (``steps``, ``requests``, ``decisions``, ``kv_events``), built from plain values.

**Timing.** A ``steps`` row is stamped at ``schedule()`` (:meth:`Rows.step`) and written at the step's
``update_from_output()`` (:meth:`Rows.end_step`), so it covers ``[time_s, time_s + duration_s]`` of its
own step (the simulator advances ``kvpilot_clock`` between the two). A ``requests`` row counts
``computed_tokens``: the request's scheduled tokens summed over steps, recomputation after preemption
included.

**KV events.** With a writer that keeps ``kv_events`` (or a listener, :meth:`Rows.watch_kv_events`), the
pool emits vLLM's KV events and the KV-cache manager's ``take_events`` is wrapped to write them as rows at
each step's end; they still go to vLLM's own publisher (a null one unless configured).

The writer (:mod:`serving_hook.telemetry`) is a bounded queue: ``put`` never blocks the engine.
"""

from __future__ import annotations

import functools
import json
from collections import deque
from collections.abc import Callable
from typing import Any, Optional

from policy.interface import FEATURE_NAMES, CachedPrefix, CandidateRequest, Policy
from serving_hook.config import HookConfig, HookConfigError
from serving_hook.events import hashes_to_int64, kv_event_hashes, kv_event_rows
from serving_hook.guard import Guard
from serving_hook.translate import EngineView, ReqInfo


def open_writer(cfg: HookConfig) -> Any:
    """The telemetry writer for ``cfg.telemetry_dir`` (None without one); a failure is a configuration error."""
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


class Rows:
    """One scheduler's telemetry: the rows it writes, and the KV-event forwarding."""

    def __init__(self, sched: EngineView, guard: Guard, policy: Policy, writer: Any, replica: int) -> None:
        self.sched = sched
        self.guard = guard
        self.policy = policy
        self.writer = writer  # None: no telemetry (the scheduler's ``kvpilot_telemetry``)
        self.replica = replica
        self.preemptions = 0  # this step's
        self.listener: Optional[Callable[[str, list], None]] = None  # see kvpilot_set_kv_event_listener
        #: The writer keeps kv_events (decided once, with the writer the hook was built with).
        self.log_kv_events = writer is not None and "kv_events" in getattr(writer, "tables", ("kv_events",))
        self._pending: deque = deque()  # steps rows waiting for their step's end (update_from_output)
        self._stamped: Optional[dict] = None  # this schedule()'s row, until the hook's time is known
        self._decision_id = 0
        self._orig_take_events: Optional[Callable] = None

    # ---------------------------------------------------------------- steps
    @functools.cached_property
    def engine(self) -> dict[str, int]:
        """The engine's fixed facts, on every ``steps`` row: what ``kvpilot calibrate`` writes into a preset.

        Read at the first step (the simulator sets the decode stride after construction); vLLM counts its
        null block in ``num_gpu_blocks``.
        """
        s = self.sched
        return {
            "num_gpu_blocks": s.kv_cache_manager.block_pool.num_gpu_blocks,
            "block_size": s.block_size,
            "max_num_seqs": s.max_num_running_reqs,
            "max_num_batched_tokens": s.max_num_scheduled_tokens // s.kvpilot_decode_stride,
        }

    def step(
        self,
        now: float,
        num_scheduled_tokens: dict,
        total_tokens: int,
        admitted: list,
        queries: int,
        hits: int,
        running: int,
        waiting: int,
        free_blocks: int,
        pinned_blocks: int,
        kv_usage: float,
        evictions: int,
        held: int = 0,
        offload_loaded_blocks: int = 0,
        offload_stored_blocks: int = 0,
        offload_block_bytes: int = 0,
        model_failures: Optional[int] = None,
    ) -> None:
        """Stamp this step's ``steps`` row; written at the step's end (:meth:`end_step`), when its duration is known.

        A scheduled chunk of up to ``kvpilot_decode_stride`` tokens of a request not admitted this step
        counts as decode tokens. The context columns are the step-cost model's attention terms
        (:mod:`simulator.cost_model`): causal query-key pairs of the prefill chunks, and the KV tokens the
        decode tokens read.
        """
        decode = prefill_pairs = decode_context = 0
        admitted_set = set(admitted)
        sched = self.sched
        stride = sched.kvpilot_decode_stride
        requests = sched.requests
        for rid, n in num_scheduled_tokens.items():
            # vLLM has already advanced num_computed_tokens by this step's n: c tokens were known before it
            c = requests[rid].num_computed_tokens - n
            pairs = n * c + n * (n + 1) // 2
            if n <= stride and rid not in admitted_set:
                decode += n
                decode_context += pairs
            else:
                prefill_pairs += pairs
        self._stamped = row = {
            "engine_step": self.guard.step_no,
            "replica": self.replica,
            "time_s": now,
            "duration_s": 0.0,
            "running": running,
            "waiting": waiting,
            "free_blocks": free_blocks,
            "pinned_blocks": pinned_blocks,
            "kv_usage": min(1.0, max(0.0, kv_usage)),
            "prefill_tokens": total_tokens - decode,
            "decode_tokens": decode,
            "prefill_context_tokens": prefill_pairs,
            "decode_context_tokens": decode_context,
            "prefix_queries": queries,
            "prefix_hits": hits,
            "preemptions": self.preemptions,
            "evictions": evictions,
            "held": held,
            "offload_loaded_blocks": offload_loaded_blocks,
            "offload_stored_blocks": offload_stored_blocks,
            "offload_loaded_bytes": offload_loaded_blocks * offload_block_bytes,
            "offload_stored_bytes": offload_stored_blocks * offload_block_bytes,
            "hook_fallback": self.guard.fallback,
            "dropped_rows": self.writer.dropped,
            "model_failures": model_failures,
            **self.engine,
        }
        self._pending.append(row)

    def hook_time(self, seconds: float) -> None:
        """The hook's own time in the ``schedule()`` whose row :meth:`step` just stamped (none: nothing)."""
        if self._stamped is not None:
            self._stamped["hook_s"] = seconds
            self._stamped = None

    def end_step(self) -> None:
        """Write the oldest pending ``steps`` row: it covers ``[schedule() time, now]``, its step's own duration."""
        w = self.writer
        if w is not None and self._pending:
            row = self._pending.popleft()
            row["duration_s"] = max(0.0, self.sched.kvpilot_clock() - row["time_s"])
            w.put("steps", row)

    # ------------------------------------------------------------- requests
    def request(
        self,
        request_id: str,
        info: ReqInfo,
        finish_reason: str,
        prompt_tokens: int,
        output_tokens: int,
        max_tokens: int,
        preemptions: int,
        block_hashes: list,
    ) -> None:
        """Write the ``requests`` row of a request that vLLM freed now (``block_hashes``: its prompt's full blocks).

        Only with a writer."""
        w = self.writer
        now = self.sched.kvpilot_clock()
        first_token = info.first_token_s
        if first_token is None and output_tokens > 0:
            first_token = now  # its first token was also its last (freed before the prefill check)
        meta = info.meta
        w.put(
            "requests",
            {
                "request_id": request_id,
                "session_id": meta.session_id,
                "group_id": meta.group_id,
                "prompt_id": meta.prompt_id,
                "step": meta.step,
                "turn": meta.turn,
                "domain": meta.domain,
                "paradigm": meta.paradigm,
                "replica": self.replica,
                "arrival_s": info.arrival_s,
                "first_scheduled_s": info.first_scheduled_s,
                "first_token_s": first_token,
                "finish_s": max(now, info.arrival_s),
                "prompt_tokens": prompt_tokens,
                "cached_tokens": max(0, min(info.cached_tokens, prompt_tokens)),
                "output_tokens": output_tokens,
                "computed_tokens": info.computed_tokens,
                "max_tokens": max_tokens if meta.max_tokens is None else meta.max_tokens,
                "finish_reason": finish_reason,
                "preemptions": preemptions,
                "held_s": info.held_s + (now - info.held_at if info.held_at is not None else 0.0),
                # the prompt's full blocks (as in the workload table); output blocks are in kv_events
                "block_hashes": hashes_to_int64(block_hashes),
            },
        )

    # ------------------------------------------------------------ decisions
    @property
    def log_decisions(self) -> bool:
        """Whether decisions are logged (with every candidate's features): the writer keeps that table."""
        w = self.writer
        return w is not None and "decisions" in w.tables

    def request_decision(
        self,
        kind: str,
        now: float,
        cands: list[CandidateRequest],
        predictions: Optional[dict],
        chosen: int,
        propensity: float,
        action: Optional[str] = None,
    ) -> None:
        """Write a ``decisions`` row over candidate requests (admit / preempt), with their features.

        ``predictions``: the decision's, per request id (None: none); ``chosen``: the index in ``cands``.
        """
        preds = predictions or {}
        ids = [c.request_id for c in cands]
        feats = [c.features(preds.get(c.request_id)) for c in cands]
        self._decision(kind, now, ids, feats, chosen, propensity, action, None)

    def prefix_decision(
        self,
        now: float,
        prefixes: list[CachedPrefix],
        predictions: Optional[dict],
        chosen: int,
        propensity: float,
        action: str,
        ttl_s: Optional[float] = None,
    ) -> None:
        """Write a ``retain`` row over cached prefixes (a retention action, or ``evict``), with their features."""
        preds = predictions or {}
        ids = [cp.prefix_id for cp in prefixes]
        feats = [cp.features(now, preds.get(cp.prefix_id)) for cp in prefixes]
        self._decision("retain", now, ids, feats, chosen, propensity, action, ttl_s)

    def _decision(
        self,
        kind: str,
        now: float,
        candidate_ids: list,
        features: list,
        chosen: int,
        propensity: float,
        action: Optional[str],
        ttl_s: Optional[float],
    ) -> None:
        """Write one ``decisions`` row (a propensity outside (0, 1] counts as 1)."""
        w = self.writer
        if w is None:
            return
        self._decision_id += 1
        p = float(propensity)
        if not (0.0 < p <= 1.0):
            p = 1.0
        w.put(
            "decisions",
            {
                "decision_id": self._decision_id,
                "time_s": now,
                "replica": self.replica,
                "engine_step": self.guard.step_no,
                "kind": kind,
                "candidate_ids": candidate_ids,
                "features": features,
                "chosen": chosen,
                "action": action,
                "ttl_s": ttl_s,
                "propensity": p,
                "policy": self.policy.name,
                "policy_version": str(self.policy.version),
            },
        )

    # ------------------------------------------------------------ kv events
    def watch_kv_events(self) -> None:
        """Make the pool emit vLLM's KV events and take them at each step's end (idempotent).

        They still go to vLLM's own publisher (a null one unless configured)."""
        if self._orig_take_events is None:
            kvm = self.sched.kv_cache_manager
            kvm.block_pool.enable_kv_cache_events = True
            self._orig_take_events = kvm.take_events
            kvm.take_events = self._take_events

    def _take_events(self) -> list:
        events = self._orig_take_events()
        w = self.writer if self.log_kv_events else None
        listener = self.listener
        if events and (w is not None or listener is not None):
            try:
                if w is None:  # the listener only: kinds and hashes, no rows
                    for kind, hashes in kv_event_hashes(events):
                        listener(kind, hashes)
                    return events
                for row in kv_event_rows(
                    events, time_s=self.sched.kvpilot_clock(), replica=self.replica, engine_step=self.guard.step_no
                ):
                    w.put("kv_events", row)
                    if listener is not None:
                        listener(row["event"], row["block_hashes"])
            except Exception as e:
                self.guard.internal_error("kv_events", e)
        return events
