"""The event-driven rollout simulation: RL drivers and replicas around vLLM's real scheduler.

:func:`run_simulation` replays a WORKLOAD table (:data:`data.schemas.WORKLOAD`)
on ``replicas`` copies of the kvpilot-hooked vLLM v1 scheduler
(:class:`serving_hook.KVPilotScheduler`, built by :mod:`simulator.engine` on the
CPU), behind a router (:mod:`simulator.routers`), and returns the run's summary
(:class:`simulator.summary.RunSummary`) with the hook's telemetry written under
``out_dir/telemetry``.

This module wires a run; each part is its own module:

* :mod:`simulator.config`: the run's options (:class:`SimConfig`), checked before anything runs;
* :mod:`simulator.workload`: the workload, validated and prepared once (:class:`PreparedWorkload`);
* :mod:`simulator.clock`: the event heap that drives everything (Time);
* :mod:`simulator.replica`: the replicas, their clocks, engine steps and routing;
* :mod:`simulator.runner`: the fake model runner, step costs and the decode stride;
* :mod:`simulator.drivers`: the RL drivers (synchronous steps, multi-turn tool
  pauses, verification and scoring, over-provisioning, trace replay);
* :mod:`simulator.tail`: tail batching (RollPacker);
* :mod:`simulator.async_rl`: asynchronous RL (no step barrier, a trainer, weight updates mid-session);
* :mod:`simulator.metrics`, :mod:`simulator.summary`: the run's metrics and its summary record;
* :mod:`simulator.engine`: every call into vLLM.
"""

from __future__ import annotations

import gc
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from simulator import engine
from simulator.async_rl import AsyncDriver
from simulator.bound import makespan_bound, throughput_bound
from simulator.clock import ARRIVE, FOLLOW_UP, KICK, RELEASE, STEP_END, SYNC_END, TRAIN_END, VERIFIED, EventClock
from simulator.config import Overprovision, PolicySpec, SimConfig, SimulationError
from simulator.drivers import StepDriver
from simulator.metrics import StepRecord, TrajectoryRecord, rl_summary, summarize
from simulator.replica import Fleet, Replica, build_replicas
from simulator.round_trip import RoundTrip
from simulator.routers import Router
from simulator.runner import ScriptedRunner
from simulator.summary import (
    AsyncDriverStats,
    MakespanBoundSummary,
    OffloadSummary,
    RunMetrics,
    RunSummary,
    SyncDriverStats,
    ThroughputBoundSummary,
)
from simulator.tail import TailBatchingDriver, tail_batching_spec
from simulator.workload import PreparedWorkload, prepare_workload

__all__ = ["Overprovision", "SimConfig", "SimResult", "Simulation", "SimulationError", "run_simulation"]


@dataclass
class SimResult:
    """What a run returns: the summary (also ``out_dir/summary.json``, :meth:`RunSummary.to_dict`), where telemetry
    went, and timings."""

    out_dir: Path | None
    requests: pa.Table  # the hook's requests telemetry
    steps: pa.Table  # the hook's steps telemetry
    trajectories: list[TrajectoryRecord] = field(default_factory=list)
    rl_steps: list[StepRecord] = field(default_factory=list)
    wall_s: float = 0.0  # the simulation loop (set-up and summary excluded)
    scheduler_s: float = 0.0  # inside schedule() + update_from_output(), hook included
    hook_s: float = 0.0  # the hook's own share of scheduler_s
    router_s: float = 0.0  # routing requests to replicas (Fleet._route), outside scheduler_s
    summary: RunSummary = field(init=False)  # set once the run is summarised

    @property
    def overhead(self) -> float:
        """Simulator time outside the scheduler, over the time inside it."""
        return (self.wall_s - self.scheduler_s) / self.scheduler_s if self.scheduler_s > 0 else 0.0


class Simulation:
    """One configured run; :meth:`run` simulates it. See :func:`run_simulation`.

    ``workload``: a table (validated here) or a :class:`PreparedWorkload`; ``options``: the fields of
    :class:`SimConfig`. Everything is checked here, before anything runs.
    """

    def __init__(self, workload: pa.Table | PreparedWorkload, policy: PolicySpec = "vllm-default", *,
                 config: SimConfig | None = None, **options: Any) -> None:
        t0 = time.perf_counter()
        if config is not None and (options or policy != "vllm-default"):
            raise SimulationError("give a SimConfig or its options, not both")
        self.config = config = config if config is not None else SimConfig(policy, **options)
        w = workload if isinstance(workload, PreparedWorkload) else prepare_workload(workload)
        self.workload = w = w.time_scaled(config.time_scale)
        if config.overprovision is not None and w.trace:
            raise SimulationError("over-provisioning applies to RL steps, not to a trace replay")
        self.policy_factory = config.policy_factory(w)
        probe = self.policy_factory()
        self.tail = tail_batching_spec(probe, config, w)
        if config.driver == "async":
            if self.tail is not None:
                raise SimulationError("tail batching drives synchronous RL steps; it does not run under the async "
                                      "driver")
            if w.trace:
                raise SimulationError("the async driver runs RL steps, not a trace replay (every arrival_s is set)")
        #: Blocks of each replica's CPU offload tier: only for a policy that uses one (0: none).
        self.offload_blocks = config.offload_blocks() if probe.uses_offload else 0
        #: The tier's cache policy is kvpilot's (the policy orders its evictions), else vLLM's LRU.
        self.host_policy = bool(self.offload_blocks and probe.uses_host_eviction)
        #: The policy's logged prior of session contexts (the async driver's ``working-set`` admission).
        self.session_contexts = probe.session_contexts
        self.router = config.make_router()
        self.kv_blocks = config.kv_blocks_for(w)
        self.driver: StepDriver | AsyncDriver | None = None  # the run's, once it ran
        self.runner: ScriptedRunner | None = None
        self.fleet: Fleet | None = None
        self.setup_s = time.perf_counter() - t0

    def run(self) -> SimResult:
        import json

        from data.io import read_telemetry
        from data.schemas import TELEMETRY_TABLES
        from policy.interface import FEATURE_NAMES
        from serving_hook.telemetry import TelemetryWriter

        config = self.config
        tmp = None
        if config.out_dir is None:
            tmp = Path(tempfile.mkdtemp(prefix="kvpilot-sim-"))
            out_dir = tmp
        else:
            out_dir = config.out_dir
            out_dir.mkdir(parents=True, exist_ok=True)
        tel_dir = out_dir / "telemetry"
        if tel_dir.exists() and any(tel_dir.iterdir()):
            raise SimulationError(f"{tel_dir} already holds telemetry; choose an empty output directory")
        if (out_dir / "summary.json").exists():  # another run's or tool's: this run would replace it
            raise SimulationError(f"{out_dir / 'summary.json'} already exists; choose an empty output directory")
        meta = {"decisions": {"kvpilot.feature_names": json.dumps({k: list(v) for k, v in FEATURE_NAMES.items()})}}
        left_out = {t for t, on in (("decisions", config.decision_log), ("kv_events", config.kv_event_log)) if not on}
        tables = [t for t in TELEMETRY_TABLES if t not in left_out] if left_out else None
        writer = TelemetryWriter(tel_dir, capacity=2_000_000, rows_per_file=200_000, flush_interval_s=30.0,
                                 metadata=meta, tables=tables)
        try:
            replicas = build_replicas(config, self.workload, self.kv_blocks, self.policy_factory, self.router, writer,
                                      offload_blocks=self.offload_blocks, host_policy=self.host_policy)
            policy_name = replicas[0].sched.kvpilot_policy.name
            # The block pools are millions of long-lived objects: keep them out of the collector's scans.
            gc.collect()
            gc.freeze()
            try:
                with engine.vllm_envs_cached():
                    result, fleet = self._loop(replicas)
            finally:
                gc.unfreeze()
        finally:
            writer.close()
        requests = read_telemetry(tel_dir, "requests")
        steps = read_telemetry(tel_dir, "steps")
        driver = self.driver
        resets = not config.keep_cache_across_steps and not self.workload.trace
        epochs = driver.cache_epoch if isinstance(driver, AsyncDriver) else None
        metrics = summarize(self.workload, requests, steps, result.trajectories, result.rl_steps,
                            aliases=driver.aliases, cache_per_step=resets and epochs is None, cache_epoch=epochs)
        summary = self.summary(metrics, result, fleet, replicas, policy_name, writer.dropped)
        result.summary, result.requests, result.steps = summary, requests, steps
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            result.out_dir = None
        else:
            (out_dir / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
            result.out_dir = out_dir
        return result

    def summary(self, metrics: RunMetrics, result: SimResult, fleet: Fleet, replicas: list[Replica],
                policy_name: str, dropped_rows: int) -> RunSummary:
        """The run's summary: its metrics beside its setting, counters, bounds, CPU tier, GPU time and training."""
        config, stats = self.config, [rep.sched.kvpilot_stats for rep in replicas]
        offload = self.offload_summary(replicas)
        gpu = self.runner.breakdown(metrics.recomputed_tokens_preemption, metrics.recomputed_tokens_eviction,
                                    config.replicas * metrics.simulated_s, offload.offload_wait_s)
        trained = rl_summary(self.workload, self.driver.traj_records, self.driver.train_records, metrics.simulated_s,
                             config.replicas, gpu.busy_s, self.staleness())
        return RunSummary(
            metrics=metrics, policy=policy_name,
            router=config.router_name if config.replicas > 1 else None,
            replicas=config.replicas, kv_blocks=self.kv_blocks, kv_fraction=config.kv_fraction,
            preset=config.preset, decode_stride=config.decode_stride, engine_steps=fleet.engine_steps,
            aborted_trajectories=self.driver.aborted, session_moves=fleet.session_moves,
            session_move_tokens=fleet.session_move_tokens, telemetry_dropped_rows=dropped_rows, wall_s=result.wall_s,
            scheduler_s=result.scheduler_s, hook_s=result.hook_s, router_s=result.router_s,
            simulator_overhead=result.overhead, model_version=stats[0].model_version,
            model_swaps=sum(st.model_swaps for st in stats), model_failures=sum(st.model_failures for st in stats),
            prefix_cache_resets=fleet.cache_resets,
            keep_cache_across_steps=config.keep_cache_across_steps, session_ids=config.session_ids,
            kv_share_of_need=(self.kv_blocks - 1) / self.workload.kv_need if self.workload.kv_need else None,
            bound=self.makespan_bound(metrics.simulated_s), offload=offload, gpu=gpu, trained=trained,
            driver=self.driver_stats(), throughput_bound=self.throughput_bound(trained.trajectories_per_s),
            workload_source=self.workload.source, time_scale=config.time_scale,
            round_trip_s=0.0 if self.workload.trace else RoundTrip(config.round_trip_quantiles_s).median_s,
        )

    def makespan_bound(self, simulated_s: float) -> MakespanBoundSummary:
        """The run's physics lower bound (:mod:`simulator.bound`) and where the run stands against it."""
        c = self.config
        b = makespan_bound(self.workload, c.cost, self.kv_blocks, replicas=c.replicas, preset=c.preset,
                           decode_stride=c.decode_stride, max_num_seqs=c.max_num_seqs)
        return MakespanBoundSummary(bound_s=b.mean_s, bound_total_s=b.total_s,
                                    bound_per_step_s=[s.bound_s for s in b.steps],
                                    makespan_over_bound=simulated_s / b.total_s if b.total_s > 0 else None)

    def staleness(self) -> list[int]:
        """Per trained trajectory, its staleness (0 on synchronous steps; none without a trainer)."""
        d = self.driver
        return d.staleness if isinstance(d, AsyncDriver) else [0] * len(d.traj_records) * bool(d.train_records)

    def driver_stats(self) -> SyncDriverStats | AsyncDriverStats:
        """The driver's settings and weight updates."""
        d = self.driver
        if not isinstance(d, AsyncDriver):
            return SyncDriverStats(weight_updates=len(d.train_records))
        return AsyncDriverStats(
            staleness_eta=d.spec.staleness, weight_sync=d.spec.weight_sync, async_admission=d.spec.admission,
            train_batch_groups=d.batch, weight_updates=d.updates, cache_reset_retries=self.fleet.cache_reset_retries,
            reprefill_tokens=d.reprefill_tokens,
            reprefill_tokens_per_update=d.reprefill_tokens / d.updates if d.updates else 0.0,
            held_turns=d.held_turns, held_turn_s=d.held_s,
            kv_tokens_by_version_age={a: v / d.updates for a, v in sorted(d.kv_by_age.items())} if d.updates else {})

    def throughput_bound(self, trajectories_per_s: float) -> ThroughputBoundSummary:
        """The run's upper bound on trained trajectories per second (:func:`simulator.bound.throughput_bound`, with
        its trainer's steps and weight updates when it has one) and the run's rate against it."""
        c, d, w = self.config, self.driver, self.workload
        trainer = c.trainer if d.train_records else None
        if trainer is not None:
            tokens = min(d.trained_tokens([x]) for x in d.trajectories)
            bound = throughput_bound(w, c.cost, self.kv_blocks, replicas=c.replicas, decode_stride=c.decode_stride,
                                     max_num_seqs=c.max_num_seqs,
                                     train_s=sum(r.end_s - r.start_s for r in d.train_records),
                                     sync_s=trainer.sync_s(c.cost), updates=len(d.train_records),
                                     last_train_s=trainer.train_s(tokens, c.cost, c.replicas))
        else:
            bound = throughput_bound(w, c.cost, self.kv_blocks, replicas=c.replicas, decode_stride=c.decode_stride,
                                     max_num_seqs=c.max_num_seqs)
        return ThroughputBoundSummary(
            throughput_bound_trajectories_per_s=bound.trajectories_per_s, throughput_bound_s=bound.bound_s,
            throughput_bound_binding=bound.binding,
            throughput_over_bound=trajectories_per_s / bound.trajectories_per_s if bound.trajectories_per_s else None)

    def offload_summary(self, replicas: list[Replica]) -> OffloadSummary:
        """The CPU offload tier's size and transfers, all replicas (zeros without a tier)."""
        workers = [r.offload for r in replicas if r.offload is not None]
        need = self.workload.kv_need
        return OffloadSummary(
            offload_gib=self.config.offload_gib if workers else 0.0,
            offload_blocks=self.offload_blocks,
            offload_share_of_need=self.offload_blocks / need if workers and need else None,
            offload_loads=sum(w.loads for w in workers),
            offload_stores=sum(w.stores for w in workers),
            offload_loaded_blocks=sum(w.load_blocks for w in workers),
            offload_stored_blocks=sum(w.store_blocks for w in workers),
            offload_load_bytes=sum(w.load_bytes for w in workers),
            offload_store_bytes=sum(w.store_bytes for w in workers),
            offload_wait_s=sum(w.blocking_s for w in workers),
            offload_host_evict_calls=sum(r.sched.kvpilot_stats.host_evict_calls for r in replicas),
            offload_host_bypassed=sum(r.sched.kvpilot_stats.host_bypassed for r in replicas),
        )

    def _loop(self, replicas: list[Replica]) -> tuple[SimResult, Fleet]:
        """Wire the run's clock, runner, fleet and driver, and run every event."""
        w, config = self.workload, self.config
        clock = EventClock()
        self.runner = runner = ScriptedRunner(w, config.cost, config.decode_stride)
        fleet = Fleet(replicas, self.router, clock, runner, config)
        bar = None
        if config.progress:
            from tqdm import tqdm

            bar = tqdm(total=w.num_rows, file=sys.stderr, unit="req", desc="simulating", mininterval=0.5,
                       dynamic_ncols=True)
        handlers = {}
        trip = RoundTrip(config.round_trip_quantiles_s, config.round_trip_seed)  # each run its own draws
        if config.driver == "async":
            spec = config.async_rl.resolved(self.session_contexts)
            driver = AsyncDriver(w, fleet, clock, runner, bar, spec=spec, trainer=config.trainer,
                                 session_ids=config.session_ids, tier_tokens=self.offload_blocks * 16 * len(replicas),
                                 session_contexts=self.session_contexts, round_trip=trip)
            handlers = {TRAIN_END: driver.trained, SYNC_END: driver.synced}
        elif self.tail is not None:
            driver = TailBatchingDriver(w, fleet, clock, runner, None, bar, spec=self.tail,
                                        reset_at_weight_sync=not config.keep_cache_across_steps,
                                        session_ids=config.session_ids, round_trip=trip)
        else:
            driver = StepDriver(w, fleet, clock, runner, config.overprovision, bar,
                                reset_at_weight_sync=not config.keep_cache_across_steps,
                                session_ids=config.session_ids,
                                trainer=None if w.trace else config.trainer, round_trip=trip)
        self.driver, self.fleet = driver, fleet
        fleet.on_finished = driver.finished
        driver.start()
        t_start = time.perf_counter()
        try:
            clock.run({ARRIVE: driver.submit, STEP_END: fleet.end_step, VERIFIED: driver.verified,
                       RELEASE: driver.release, KICK: fleet.kicked, FOLLOW_UP: driver.follow_up, **handlers})
        finally:
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - t_start
        hook = fleet.close()
        driver.check_finished()
        return SimResult(out_dir=None, requests=pa.table({}), steps=pa.table({}),
                         trajectories=driver.traj_records, rl_steps=driver.step_records, wall_s=wall,
                         scheduler_s=fleet.scheduler_s, hook_s=hook, router_s=fleet.router_s), fleet

    # ------------------------------------------------------------------ inspection for tests
    @property
    def submitted(self) -> list[int]:
        """Per workload row: how many times it was submitted to an engine."""
        return list(self.driver.submitted)

    @property
    def finished(self) -> list[int]:
        """Per workload row: how many times an engine finished it (aborts excluded)."""
        return list(self.driver.finished_count)

    @property
    def finish_times(self) -> list[float]:
        return list(self.driver.finish_time)


def run_simulation(
    workload: pa.Table | PreparedWorkload,
    policy: PolicySpec = "vllm-default",
    *,
    replicas: int = 1,
    router: str | Router = "round-robin",
    kv_blocks: int | None = None,
    kv_fraction: float | None = None,
    preset: str = "H200-7B",
    out_dir: str | Path | None = None,
    overprovision: Overprovision | None = None,
    progress: bool = True,
    **options: Any,
) -> SimResult:
    """Simulate ``workload`` under ``policy`` (a catalog name, a factory or, for one replica, an instance).

    ``workload``: a WORKLOAD table, validated here, or a :class:`PreparedWorkload` (already validated:
    :func:`simulator.workload.load_workload`, :func:`simulator.workload.prepare_workload`), for many runs of
    one workload. ``kv_blocks`` (vLLM blocks per replica, its null block included) or ``kv_fraction``
    (:func:`simulator.sizing.blocks_for_fraction`); neither: the preset's GPU capacity.
    Other keyword options are :class:`SimConfig`'s (``policy_options``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``sticky_sessions``, ``decision_budget_s``, ``decode_stride``, ...).
    Bad configurations and workloads raise :class:`SimulationError` before anything runs.
    """
    return run_config(workload, SimConfig(policy, replicas=replicas, router=router, kv_blocks=kv_blocks,
                                          kv_fraction=kv_fraction, preset=preset, out_dir=out_dir,
                                          overprovision=overprovision, progress=progress, **options))


def run_config(workload: pa.Table | PreparedWorkload, config: SimConfig) -> SimResult:
    """Simulate ``workload`` as ``config`` (a :class:`SimConfig`, checked when it was made) says."""
    sim = Simulation(workload, config=config)
    result = sim.run()
    result.summary = replace(result.summary, setup_s=sim.setup_s)
    return result
