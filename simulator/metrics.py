"""The run's metrics from its telemetry and driver records (:class:`simulator.summary.RunMetrics`,
:class:`simulator.summary.TrainedThroughput`: their fields carry the definitions), and the records they read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from simulator.summary import RunMetrics, TrainedThroughput
from simulator.tokens import unlimited_cached_tokens

if TYPE_CHECKING:
    from simulator.workload import PreparedWorkload


@dataclass(frozen=True)
class TrajectoryRecord:
    """One trajectory as the driver saw it: first turn released to verification done."""

    session_id: str
    step: int
    start_s: float
    end_s: float
    version_start: int = 0  # the weight version it started at
    version_end: int = 0  # the weight version when it ended (it spanned versions start..end)


@dataclass(frozen=True)
class TrainRecord:
    """One training step: on weight version ``version``, from ``start_s`` to ``end_s``, then its weight update
    until ``synced_s``; ``groups`` trajectories (or groups) and their ``tokens``; ``staleness_max`` of its batch."""

    version: int
    start_s: float
    end_s: float
    synced_s: float
    trajectories: int
    tokens: int
    staleness_max: int


@dataclass(frozen=True)
class StepRecord:
    """One RL step as the driver saw it: released to its last trajectory verified."""

    step: int
    start_s: float
    end_s: float


def _pct(values: Sequence[float], q: float) -> float:
    """Percentile (linear interpolation) of a list; 0 when empty."""
    return float(np.percentile(values, q)) if len(values) else 0.0


def _np(table: pa.Table, column: str) -> np.ndarray:
    """A non-null numeric column as a numpy array."""
    return table.column(column).to_numpy()


def summarize(
    workload: PreparedWorkload,
    requests: pa.Table,
    steps: pa.Table,
    trajectories: Sequence[TrajectoryRecord],
    rl_steps: Sequence[StepRecord],
    *,
    batch_capacity: int | None = None,
    aliases: Mapping[str, int] | None = None,
    cache_per_step: bool = False,
    cache_epoch: Sequence[int] | None = None,
) -> RunMetrics:
    """The run's metrics (:class:`RunMetrics`) from its workload, telemetry and driver records.

    ``aliases``: request ids the run gave workload rows beside their own (:meth:`PreparedWorkload.rows`).
    ``cache_per_step``: the run reset its prefix caches at every RL step (weight sync), so the unlimited cache
    that eviction misses are measured against is one per replica and step: what a reset drops is no eviction.
    ``cache_epoch``: instead, per workload row, the cache it could hit (the asynchronous driver's reset epoch or
    version salt).
    """
    tokens = workload.tokens
    rows = workload.rows(requests.column("request_id").to_pylist(), aliases)
    prompt, cached, output = (_np(requests, c).astype(np.int64) for c in ("prompt_tokens", "cached_tokens",
                                                                           "output_tokens"))
    computed = _np(requests, "computed_tokens").astype(np.int64)
    preempt_extra = np.maximum(computed - (prompt - cached) - np.maximum(output - 1, 0), 0)
    replica = np.full(workload.num_rows, -1, np.int64)
    replica[rows] = _np(requests, "replica")
    order = tokens.causal_order()
    order = order[replica[order] >= 0]
    partition = replica
    if cache_per_step or cache_epoch is not None:
        step = np.asarray(workload.step if cache_epoch is None else cache_epoch, np.int64)
        partition = np.where(replica >= 0, replica * (int(step.max()) + 1) + step, -1)
    unlimited = unlimited_cached_tokens(tokens, include_outputs=True, order=order, partition=partition)[rows]
    # Summed with its signs over each cache (replica, and step or epoch), not row by row: where the run admitted a
    # prefix's requests in another order than the reference's (a policy's reordering of GRPO siblings), the first
    # of them pays the prefix the reference's first would have, and the latter hits what the reference's would
    # have paid; the two cancel. Each unique block computed once is no recompute, whichever request computed it.
    _, cache_of = np.unique(partition[rows], return_inverse=True)
    per_cache = np.bincount(cache_of, weights=(unlimited - cached).astype(np.float64))
    evict_extra = int(np.maximum(per_cache, 0.0).sum())

    ordered = sorted(rl_steps, key=lambda s: s.step)
    makespans = [s.end_s - s.start_s for s in ordered]
    simulated = max((s.end_s for s in ordered), default=0.0) - min((s.start_s for s in ordered), default=0.0)
    durations = [t.end_s - t.start_s for t in trajectories]
    groups = _group_completion(workload, trajectories, {s.step: s.start_s for s in ordered})
    bubbles = [_tail_bubble(steps, s, batch_capacity, np.union1d(_np(steps, "replica"), _np(requests, "replica")))
               for s in ordered]
    kinds = np.array(workload.kind, dtype=object)[rows]
    critical = _critical_split(requests, trajectories, ordered)
    return RunMetrics(
        requests=requests.num_rows,
        turns=int(np.count_nonzero(kinds == "rollout")),
        trajectories=len(trajectories),
        simulated_s=simulated,
        makespan_s=float(np.mean(makespans)) if makespans else 0.0,
        makespan_per_step_s=makespans,
        output_tokens=int(output.sum()),
        tokens_per_s=float(output.sum() / simulated) if simulated > 0 else 0.0,
        prefix_hit_rate=float(cached.sum() / prompt.sum()) if prompt.sum() else 0.0,
        preemptions=int(_np(requests, "preemptions").sum()),
        recomputed_tokens=int(preempt_extra.sum()) + evict_extra,
        recomputed_tokens_preemption=int(preempt_extra.sum()),
        recomputed_tokens_eviction=evict_extra,
        trajectory_p50_s=_pct(durations, 50),
        trajectory_p99_s=_pct(durations, 99),
        group_completion_s=groups,
        group_completion_p50_s=_pct(list(groups.values()), 50),
        group_completion_p99_s=_pct(list(groups.values()), 99),
        group_completion_mean_s=float(np.mean(list(groups.values()))) if groups else 0.0,
        tail_bubble_s=float(np.mean(bubbles)) if bubbles else 0.0,
        tail_bubble_per_step_s=bubbles,
        critical_queue_s=critical[0],
        critical_service_s=critical[1],
        critical_other_s=critical[2],
        hook_fallbacks=int(np.count_nonzero(_np(steps, "hook_fallback"))),
    )


def rl_summary(workload: PreparedWorkload, trajectories: Sequence[TrajectoryRecord], trains: Sequence[TrainRecord],
               rollout_s: float, replicas: int, gpu_busy_s: float, staleness: Sequence[int] = ()
               ) -> TrainedThroughput:
    """Trained throughput and where time went, for every run (:class:`TrainedThroughput`, :mod:`simulator.async_rl`).

    ``rollout_s``: the synchronous runs' ``simulated_s``; ``gpu_busy_s``: the engine steps' priced time;
    ``staleness``: per trained trajectory, the version it was trained at minus the version it started at."""
    end = max([rollout_s] + [t.end_s for t in trajectories] + [r.synced_s for r in trains])
    n = len(trajectories)
    group_of = dict(zip(workload.session_id, workload.group_id))
    groups: dict[tuple[int, str], list[float]] = {}
    for t in trajectories:
        g = groups.setdefault((t.step, group_of[t.session_id]), [t.start_s, t.end_s])
        g[0], g[1] = min(g[0], t.start_s), max(g[1], t.end_s)
    latency = [hi - lo for lo, hi in groups.values()]
    out = TrainedThroughput(
        run_s=end,
        trajectories_per_s=n / end if end > 0 else 0.0,
        rollout_idle_share=max(0.0, 1.0 - gpu_busy_s / (replicas * end)) if end > 0 else None,
        group_latency_p50_s=_pct(latency, 50),
        group_latency_p90_s=_pct(latency, 90),
        versions_spanned_mean=float(np.mean([t.version_end - t.version_start + 1 for t in trajectories]))
        if trajectories else 0.0,
        trainer_idle_share=None, trained_tokens=0, trained_tokens_per_s_after_warmup=None,
        trajectories_per_s_after_warmup=None, staleness_counts={}, max_staleness=0, mean_staleness=0.0,
    )
    if not trains:
        return out
    trained = list(trains)
    stale: dict[int, int] = {}
    for x in staleness:
        stale[x] = stale.get(x, 0) + 1
    busy = sum(r.synced_s - r.start_s for r in trained)
    tokens_rate = trajectories_rate = None
    if len(trained) > 1:
        span = trained[-1].synced_s - trained[0].synced_s
        if span > 0:
            tokens_rate = sum(r.tokens for r in trained[1:]) / span
            trajectories_rate = sum(r.trajectories for r in trained[1:]) / span
    return replace(out, staleness_counts=dict(sorted(stale.items())), max_staleness=max(staleness, default=0),
                   mean_staleness=float(np.mean(staleness)) if len(staleness) else 0.0,
                   trainer_idle_share=max(0.0, 1.0 - busy / end) if end > 0 else None,
                   trained_tokens=sum(r.tokens for r in trained), trained_tokens_per_s_after_warmup=tokens_rate,
                   trajectories_per_s_after_warmup=trajectories_rate)


def _critical_split(requests: pa.Table, trajectories: Sequence[TrajectoryRecord],
                    rl_steps: Sequence[StepRecord]) -> tuple[float, float, float]:
    """(queue, service, other) seconds of each RL step's last-ending trajectory, means over steps."""
    session = np.asarray(requests.column("session_id").to_pylist(), dtype=object)
    arrival, first, finish = (_np(requests, c) for c in ("arrival_s", "first_scheduled_s", "finish_s"))
    splits = []
    for rl in rl_steps:
        mine = [t for t in trajectories if t.step == rl.step]
        if not mine:
            continue
        last = max(mine, key=lambda t: t.end_s)
        rows = session == last.session_id
        queue = float(np.nansum(first[rows] - arrival[rows]))
        service = float(np.nansum(finish[rows] - first[rows]))
        splits.append((queue, service, max(last.end_s - last.start_s - queue - service, 0.0)))
    if not splits:
        return 0.0, 0.0, 0.0
    q, sv, o = np.mean(splits, axis=0)
    return float(q), float(sv), float(o)


def _group_completion(
    workload: PreparedWorkload, trajectories: Sequence[TrajectoryRecord], step_start: dict[int, float]
) -> dict[str, float]:
    """Per group id: its last trajectory's end minus its RL step's start."""
    group_of = dict(zip(workload.session_id, workload.group_id))
    out: dict[str, float] = {}
    for t in trajectories:
        group = group_of[t.session_id]
        out[group] = max(out.get(group, -np.inf), t.end_s - step_start[t.step])
    return out


def _tail_bubble(steps: pa.Table, rl: StepRecord, capacity: int | None, replicas: np.ndarray) -> float:
    """Mean over replicas of the idle full-batch seconds of one RL step's window (module docstring)."""
    start, end = _np(steps, "time_s"), _np(steps, "time_s") + _np(steps, "duration_s")
    overlap = np.clip(np.minimum(end, rl.end_s) - np.maximum(start, rl.start_s), 0.0, None)
    running, waiting, replica = _np(steps, "running"), _np(steps, "waiting"), _np(steps, "replica")
    window = rl.end_s - rl.start_s
    bubbles = []
    for r in replicas.tolist():
        mine = (replica == r) & (overlap > 0)
        cap = capacity if capacity is not None else int(running[mine].max(initial=0))
        use = np.where(waiting[mine] > 0, 1.0, np.minimum(running[mine] / cap, 1.0) if cap else 0.0)
        bubbles.append(window - float((overlap[mine] * use).sum()))
    return float(np.mean(bubbles)) if bubbles else window

