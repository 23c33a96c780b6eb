"""A simulation's run summary as one typed record (:class:`RunSummary`), its JSON form and its plain-text report.

Every field's name is its key in ``summary.json`` and in an evaluation's rows; :meth:`RunSummary.to_dict` lays the
sub-records' fields out flat, in field order. Times are in simulated seconds unless a field says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal


def _flat(record: Any) -> dict[str, Any]:
    """A record's fields by name, in order (values as they are, not copied)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


@dataclass(frozen=True)
class RunMetrics:
    """What the run did, from its telemetry and driver records (:func:`simulator.metrics.summarize`)."""

    requests: int
    turns: int  # rollout requests (scoring requests excluded)
    trajectories: int
    #: Last RL step end - first RL step start.
    simulated_s: float
    #: The mean of ``makespan_per_step_s``.
    makespan_s: float
    #: Per RL step (in step order), its end - start.
    makespan_per_step_s: list[float]
    output_tokens: int
    #: ``output_tokens`` / ``simulated_s``.
    tokens_per_s: float
    #: Sum ``cached_tokens`` / sum ``prompt_tokens`` (vLLM's hit at first scheduling).
    prefix_hit_rate: float
    preemptions: int
    #: ``recomputed_tokens_preemption`` + ``recomputed_tokens_eviction``.
    recomputed_tokens: int
    #: Per request ``computed_tokens - (prompt - cached) - max(output - 1, 0)``, clipped at 0 (a request without
    #: preemption computes its uncached prompt and all but its last output token).
    recomputed_tokens_preemption: int
    #: Per request, the prompt tokens an unlimited prefix cache on the same replica (and, when the run resets the
    #: caches at weight sync, in the same RL step) would have hit (:func:`simulator.tokens.unlimited_cached_tokens`,
    #: vLLM's convention: output blocks are cached too; requests replayed in causal order) minus ``cached_tokens``,
    #: clipped at 0.
    recomputed_tokens_eviction: int
    #: Percentiles of trajectory end - start (verification included).
    trajectory_p50_s: float
    trajectory_p99_s: float
    #: Per GRPO group, its last trajectory's end - its RL step's start (when training on the group could start).
    group_completion_s: dict[str, float]
    group_completion_p50_s: float
    group_completion_p99_s: float
    group_completion_mean_s: float
    #: Batch capacity left idle once the queue has drained, in seconds of a full batch: the mean over RL steps of
    #: ``tail_bubble_per_step_s``.
    tail_bubble_s: float
    #: For RL step s on replica r, with window W = [start, end] and capacity C (``batch_capacity``, else the peak
    #: ``running`` of r's engine steps in W): ``|W| - sum_k overlap_k * u_k`` over r's engine steps k (each spans
    #: [time_s, time_s + duration_s]), where ``u_k = 1`` while requests wait (the batch is KV- or budget-bound, not
    #: starved) and ``min(running_k / C, 1)`` when nothing waits; time without any engine step is fully idle. Per
    #: step, the mean over replicas.
    tail_bubble_per_step_s: list[float]
    #: The time of each RL step's critical trajectory (the one that ends last, so the step's makespan), split into
    #: its requests' queueing (sum of ``first_scheduled - arrival``), their service (sum of ``finish -
    #: first_scheduled``: prefill and decode at the batch's pace, with any preemption and recompute) and the rest of
    #: its duration (tool calls, the verifier and its scoring requests); means over steps. Admission and retention
    #: act on its queueing and on what its service recomputes; its tool calls and its decode at a full batch's
    #: iteration time they cannot shorten.
    critical_queue_s: float
    critical_service_s: float
    critical_other_s: float
    #: Engine steps (all replicas) whose ``steps`` row has ``hook_fallback``: a policy call failed or overran, or the
    #: ``registry`` policy had no model, and the step ran vLLM's own behaviour.
    hook_fallbacks: int


@dataclass(frozen=True)
class MakespanBoundSummary:
    """The run's physics lower bound (:func:`simulator.bound.makespan_bound`) and where the run stands against it."""

    bound_s: float  # per RL step, the mean
    bound_total_s: float
    bound_per_step_s: list[float]
    makespan_over_bound: float | None  # simulated_s / bound_total_s


@dataclass(frozen=True)
class OffloadSummary:
    """The CPU offload tier's size and transfers, all replicas (zeros without a tier)."""

    offload_gib: float
    offload_blocks: int  # per replica
    offload_share_of_need: float | None  # offload_blocks over the largest step's KV need
    offload_loads: int
    offload_stores: int
    offload_loaded_blocks: int
    offload_stored_blocks: int
    offload_load_bytes: int
    offload_store_bytes: int
    offload_wait_s: float  # the blocking transfers' waits
    offload_host_evict_calls: int  # calls to a kvpilot policy's tier eviction
    offload_host_bypassed: int


@dataclass(frozen=True)
class GpuSeconds:
    """GPU seconds by cause, all replicas (:meth:`simulator.runner.ScriptedRunner.breakdown`)."""

    gpu_decode_s: float
    gpu_prefill_new_s: float
    gpu_recompute_preemption_s: float
    gpu_recompute_eviction_s: float
    gpu_offload_wait_s: float
    gpu_idle_s: float  # replicas x simulated_s, less the rest

    @property
    def busy_s(self) -> float:
        """Every cause but idle."""
        return (self.gpu_decode_s + self.gpu_prefill_new_s + self.gpu_recompute_preemption_s
                + self.gpu_recompute_eviction_s + self.gpu_offload_wait_s)


@dataclass(frozen=True)
class TrainedThroughput:
    """Trained throughput and where time went, for every run (:func:`simulator.metrics.rl_summary`)."""

    #: From 0 to the later of the last trajectory's end and the last weight update's end (``simulated_s`` for a
    #: synchronous run without a trainer).
    run_s: float
    trajectories_per_s: float  # trajectories over run_s
    #: Of ``replicas x run_s``, the GPU time no engine step ran (engine steps priced by :class:`GpuSeconds`).
    rollout_idle_share: float | None
    #: Per GRPO group, its last trajectory's end minus its first one's start.
    group_latency_p50_s: float
    group_latency_p90_s: float
    versions_spanned_mean: float  # per trajectory, the weight versions it spanned
    #: The share of ``run_s`` the trainer neither trains nor updates weights (None without a trainer).
    trainer_idle_share: float | None
    trained_tokens: int
    #: From the end of the first weight update to the last: the later training steps' tokens and trajectories over
    #: that time (None with fewer than two).
    trained_tokens_per_s_after_warmup: float | None
    trajectories_per_s_after_warmup: float | None
    #: Per trained trajectory, the version it was trained at minus the version it started at: how many had each.
    staleness_counts: dict[int, int]
    max_staleness: int
    mean_staleness: float


@dataclass(frozen=True)
class SyncDriverStats:
    """The synchronous driver's weight updates (one per RL step with a trainer)."""

    driver: Literal["sync"] = field(default="sync", init=False)
    weight_updates: int = 0
    train_batch_groups: None = None  # a training step takes its RL step's groups


@dataclass(frozen=True)
class AsyncDriverStats:
    """The asynchronous driver's settings and weight updates (:mod:`simulator.async_rl`)."""

    driver: Literal["async"] = field(default="async", init=False)
    staleness_eta: int
    weight_sync: str  # keep, abort or recompute
    async_admission: str
    train_batch_groups: int
    weight_updates: int
    cache_reset_retries: int
    reprefill_tokens: int  # prompt and output tokens prefilled again after a weight update
    reprefill_tokens_per_update: float
    #: working-set: rollout turns held while their own and older groups' sessions did not fit, and the seconds
    #: they waited.
    held_turns: int
    held_turn_s: float
    #: Per version age at a weight update: the KV tokens held, a mean over updates.
    kv_tokens_by_version_age: dict[int, float]


@dataclass(frozen=True)
class ThroughputBoundSummary:
    """Trained trajectories per second beside their upper bound (:func:`simulator.bound.throughput_bound`)."""

    throughput_bound_trajectories_per_s: float
    throughput_bound_s: float
    throughput_bound_binding: str  # the resource that binds
    throughput_over_bound: float | None


@dataclass(frozen=True)
class RunSummary:
    """A simulation's run summary: its metrics, its setting and counters, bounds, CPU tier, GPU time and training."""

    metrics: RunMetrics
    policy: str
    router: str | None  # None at one replica
    replicas: int
    kv_blocks: int  # per replica, vLLM's null block included
    kv_fraction: float | None
    preset: str
    decode_stride: int
    engine_steps: int
    aborted_trajectories: int
    session_moves: int
    session_move_tokens: int
    telemetry_dropped_rows: int
    wall_s: float  # wall-clock seconds of the simulation loop
    scheduler_s: float  # wall-clock seconds inside the scheduler
    hook_s: float  # wall-clock seconds inside the hook
    router_s: float  # wall-clock seconds routing
    simulator_overhead: float  # simulator time outside the scheduler over the time inside it
    #: Policy ``registry``: the registry version served at the end (replica 0), swaps after start-up, and the model
    #: loads that failed (every replica's).
    model_version: str | None
    model_swaps: int
    model_failures: int
    prefix_cache_resets: int
    keep_cache_across_steps: bool
    session_ids: bool  # requests carried their session identity
    #: The KV per replica as a fraction of the largest step's need (= kv_fraction when that was given).
    kv_share_of_need: float | None
    bound: MakespanBoundSummary
    offload: OffloadSummary
    gpu: GpuSeconds
    trained: TrainedThroughput
    driver: SyncDriverStats | AsyncDriverStats
    throughput_bound: ThroughputBoundSummary
    #: Wall-clock seconds of the run's set-up, set by :func:`simulator.simulation.run_simulation` (None: left out).
    setup_s: float | None = None
    #: What made the workload (its generator and config, or the trace files it was imported from), as the
    #: workload file records it (:data:`data.io.SOURCE_KEY`); None when it does not say.
    workload_source: dict | None = None
    #: The factor on the workload's tool and verifier latencies (:attr:`simulator.config.SimConfig.time_scale`).
    time_scale: float = 1.0
    #: Median seconds from a finished request to its trajectory's next one (:class:`simulator.round_trip.RoundTrip`).
    round_trip_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The summary as ``summary.json`` holds it: every field by name, sub-records' fields inline."""
        out: dict[str, Any] = {}
        for name, value in _flat(self).items():
            if is_dataclass(value):
                out.update(_flat(value))
            elif name != "setup_s" or value is not None:
                out[name] = value
        return out


def render_metrics(m: RunMetrics) -> str:
    """Plain-text report of a run's metrics (per-group and per-step lists summarised)."""
    steps = "  ".join(f"{x:.2f}" for x in m.makespan_per_step_s)
    return "\n".join([
        (f"requests {m.requests}  turns {m.turns}  trajectories {m.trajectories}  "
         f"simulated {m.simulated_s:.2f} s"),
        (f"makespan {m.makespan_s:.2f} s/step (per step: {steps})  "
         f"throughput {m.tokens_per_s:.1f} tok/s ({m.output_tokens} output tokens)"),
        (f"prefix hit rate {m.prefix_hit_rate:.3f}  preemptions {m.preemptions}  "
         f"recomputed tokens {m.recomputed_tokens} (preemption {m.recomputed_tokens_preemption}, "
         f"eviction {m.recomputed_tokens_eviction})"),
        (f"trajectory p50 {m.trajectory_p50_s:.2f} s  p99 {m.trajectory_p99_s:.2f} s  "
         f"group completion p50 {m.group_completion_p50_s:.2f} s  p99 {m.group_completion_p99_s:.2f} s  "
         f"mean {m.group_completion_mean_s:.2f} s ({len(m.group_completion_s)} groups)"),
        f"tail bubble {m.tail_bubble_s:.2f} s/step",
        (f"critical trajectory (the step's last): queued {m.critical_queue_s:.1f} s, served "
         f"{m.critical_service_s:.1f} s, tools and verifier {m.critical_other_s:.1f} s (per step)"),
    ])


def render_summary(s: RunSummary) -> str:
    """Plain-text report of a run: its metrics, then the bound, training, GPU time and the CPU tier."""
    b, t, tb, g, o = s.bound, s.trained, s.throughput_bound, s.gpu, s.offload
    lines = [render_metrics(s.metrics),
             f"lower bound {b.bound_s:.2f} s/step ({b.bound_total_s:.2f} s in all): the run is "
             f"{b.makespan_over_bound:.3f}x the bound"]
    if tb.throughput_bound_trajectories_per_s:
        trainer = (f", {s.driver.weight_updates} weight updates, trainer idle {t.trainer_idle_share:.2f}, max "
                   f"staleness {t.max_staleness}" if s.driver.weight_updates else "")
        lines.append(f"trained {t.trajectories_per_s:.4g} trajectories/s over {t.run_s:.1f} s (bound "
                     f"{tb.throughput_bound_trajectories_per_s:.4g}, {tb.throughput_over_bound:.3f} of it, "
                     f"{tb.throughput_bound_binding}-bound){trainer}")
    causes = ("decode", "prefill_new", "recompute_preemption", "recompute_eviction", "offload_wait", "idle")
    lines.append("GPU seconds: " + "  ".join(f"{c.replace('_', ' ')} {getattr(g, f'gpu_{c}_s'):.1f}" for c in causes))
    if o.offload_blocks:
        lines.append(f"CPU offload tier {o.offload_gib:g} GiB ({o.offload_blocks} blocks): "
                     f"loaded {o.offload_load_bytes / 2**30:.2f} GiB in {o.offload_loads} jobs, "
                     f"stored {o.offload_store_bytes / 2**30:.2f} GiB in {o.offload_stores} jobs")
    return "\n".join(lines)
