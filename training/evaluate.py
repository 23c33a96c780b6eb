"""Evaluate policies side by side: one workload, the same seeds and cost model, a grid of KV sizes, replicas and
routers.

:func:`evaluate` runs every case of a :class:`training.grid.Grid` (policy x KV fraction x replica count
x router; the router only with several replicas, one case per policy and KV
fraction at one replica; each a run of the grid's base :class:`simulator.config.SimConfig`) with
:func:`simulator.simulation.run_config`, as an :class:`Execution` says, each into
``out_dir/runs/<policy>-kv<f>-r<R>`` (``-<router>`` appended for R > 1), in this process, in ``jobs`` worker
processes (spawn context; each worker imports vLLM once, reads and prepares the workload
once and runs several cases, handed out longest expected first: :func:`expected_cost`), or as Ray tasks
(``backend="ray"``: a local Ray instance of ``jobs`` CPUs, or the cluster at ``address``; each Ray worker
process prepares the workload once; the same rows as the process pool). A case that fails is a row with an ``error``,
not a failed evaluation. ``vllm-default`` is always run, for the ratios.
Cases run at the simulator's decode stride :data:`training.grid.DEFAULT_DECODE_STRIDE` unless the grid's base
says otherwise (1 is the exact path, see :mod:`simulator.runner`).
Each finished case leaves ``runs/<case>/summary.json``,
``trajectories.json`` and its telemetry (``requests`` and ``steps``; ``decisions`` and ``kv_events`` too with
the grid's ``full_telemetry``); with ``resume`` a case that an earlier evaluation into
the same folder finished is read back, not rerun, where its workload (request count and source), preset,
stride, cache rule, router and tier are this evaluation's (:func:`finished_case`).

It writes, under ``out_dir`` (:mod:`training.reports`):

* ``summary.json``: a list of rows, each with ``policy``, ``kv_fraction``,
  ``replicas``, ``router`` (``None`` at one replica), ``error`` (``None`` when it ran), the simulator's summary keys
  (:meth:`simulator.summary.RunSummary.to_dict`) and the ratios
  to vllm-default at the same KV fraction, replicas and router:
  ``makespan_ratio_vs_default``, ``recompute_ratio_vs_default`` (recomputed
  tokens), ``hit_rate_ratio_vs_default`` (prefix hit rate) and
  ``simulated_ratio_vs_default`` (first step start to last step end: the fair
  one for tail batching, whose long rounds count as extra RL steps in the
  per-step mean ``makespan_s``); a ratio is
  ``None`` when either side failed or the default's value is 0 (1.0 when both
  are 0); ``makespan_ratio_vs_round_robin_default`` (several replicas only): the makespan over
  vllm-default's behind ``round-robin`` at the same KV fraction and replicas (``None`` when that case
  is not in the grid), the router's criterion; beside them the run's lower bound (``bound_s``, ``bound_total_s``,
  ``makespan_over_bound``: :mod:`simulator.bound`) and ``gap_closed``, the share
  of vllm-default's gap to the bound the policy closes (:func:`gap_closed`). A KV
  fraction of ``None`` (``--kv-fractions gpu``) is the preset GPU's own capacity:
  its runs are ``runs/<policy>-kvgpu-r<R>``, its tables say ``gpu``;
* ``summary.csv`` and ``summary.md``: the same rows, scalar metrics only;
* ``makespan.png``, ``hit_rate.png``, ``recompute.png``: the metric against
  the KV fraction (the GPU's capacity at its share of the need,
  ``kv_share_of_need``), one line per policy (per policy and router at several replicas when the grid
  has several routers), one panel per replica count; the
  makespan is the whole workload's (``simulated_s``), so tail batching's long
  rounds count, and the bound is drawn beside it;
* ``trajectory_ecdf.png``: the ECDF of trajectory completion times (first turn
  released to verification done) per policy (and router) at the smallest KV fraction, one
  panel per replica count.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.grid import Case, EvaluationError, Grid
from training.reports import add_ratios, write_reports

#: Where cases run: ``process`` (this process or a spawned pool), ``ray`` (Ray tasks; :func:`_run_ray`).
BACKENDS = ("process", "ray")


@dataclass(frozen=True)
class Execution:
    """How an evaluation runs its cases, checked when made: ``backend`` ``process`` (this process, or ``jobs``
    spawned worker processes) or ``ray`` (Ray tasks of one CPU each: with no ``address`` on a local Ray instance
    of ``jobs`` CPUs started here, else on the cluster at ``address``, as many at once as it schedules; see
    :func:`_run_ray`); ``resume``: cases an earlier evaluation into the same folder finished are read back;
    ``progress``: a progress bar on stderr."""

    jobs: int = 1
    backend: str = "process"
    address: str | None = None
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or self.jobs < 1:
            raise EvaluationError(f"jobs must be an integer >= 1, got {self.jobs!r}")
        if self.backend not in BACKENDS:
            raise EvaluationError(f"unknown backend {self.backend!r}; known backends: {', '.join(BACKENDS)}")
        if self.address is not None and self.backend != "ray":
            raise EvaluationError(f"address {self.address!r} is for the ray backend, not {self.backend!r}")


@dataclass
class EvaluationResult:
    rows: list[dict[str, Any]]
    out_dir: Path
    files: list[Path] = field(default_factory=list)
    trajectory_s: dict[str, list[float]] = field(default_factory=dict)  # case name -> completion times


# ---------------------------------------------------------------- running cases

#: Relative wall time of a policy's case against vllm-default's (measured on the default grid: its mean ratio,
#: rounded; the hooks of the eviction baselines rank every cached prefix, rollpacker reruns cut prompts).
_POLICY_COST = {"oracle": 1.6, "kvflow": 1.5, "lrb": 1.4, "marconi": 1.4, "lrb-online": 1.8, "rollpacker": 1.4,
                "continuum": 1.2, "heddle": 1.2, "seer": 1.2, "vllm-default": 1.0}


def expected_cost(case: Case) -> float:
    """A case's relative expected run time: a policy's costs (:data:`_POLICY_COST`), smaller KV caches (more steps
    and preemptions), and more replicas (each steps on its own; measured 1.3x for two). Only its order matters."""
    kv = case.kv_fraction if case.kv_fraction is not None else 1.0
    return _POLICY_COST.get(case.policy, 1.1) * (1.0 + 0.02 / kv) * (1.0 + 0.3 * (case.replicas - 1))


_WORKER: dict[str, Any] = {}
#: What a worker process (pool or Ray) needs in its environment.
_WORKER_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING"}


def _init_worker(workload_path: str) -> None:
    """Worker start-up: vLLM imported and the workload read and prepared once per process."""
    for k, v in _WORKER_ENV.items():
        os.environ.setdefault(k, v)
    from simulator import engine
    from simulator.workload import load_workload

    engine.make_vllm_config()  # the first ModelConfig's cost, once
    _WORKER["workload"] = load_workload(workload_path)
    _WORKER["path"] = workload_path


def run_case(workload: Any, grid: Grid, case: Case, out_dir: Path) -> tuple[dict[str, Any], list[float]]:
    """Simulate one case of ``grid``; returns its row (``error`` set instead of raising) and its trajectory
    durations. ``workload``: a :class:`simulator.workload.PreparedWorkload` (validated once, shared by the cases).
    """
    from simulator.simulation import run_config

    row = case.row()
    run_dir = Path(out_dir) / "runs" / case.name
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)  # an earlier evaluation's run of this case
    try:
        result = run_config(workload, grid.config(case, run_dir))
    except Exception as e:  # noqa: BLE001 - reported in the table, not a crash of the evaluation
        row["error"] = f"{type(e).__name__}: {e}"
        return row, []
    durations = [t.end_s - t.start_s for t in result.trajectories]
    (run_dir / "trajectories.json").write_text(json.dumps(durations))
    return _row(row, result.summary.to_dict()), durations


def _row(row: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    row.update({k: v for k, v in summary.items()
                if k not in ("policy", "kv_fraction", "replicas", "router", "tier_gib")})
    return row


def finished_case(grid: Grid, case: Case, out_dir: Path,
                  workload: tuple[int, Any] | None = None) -> tuple[dict[str, Any], list[float]] | None:
    """A case of ``grid`` that an earlier evaluation into ``out_dir`` finished on the same preset, stride, router,
    cache rule and CPU offload tier (summary and trajectories), or None.

    ``workload``: ``(requests, source)`` of this evaluation's workload; a run of another number of requests or
    another workload source (``kvpilot.source``) is not reused."""
    run_dir = Path(out_dir) / "runs" / case.name
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        durations = json.loads((run_dir / "trajectories.json").read_text())
    except (OSError, ValueError):
        return None
    base = grid.base
    if summary.get("preset") != base.preset or (workload is not None and (
            summary.get("requests"), summary.get("workload_source")) != workload):
        return None  # another workload or cost model
    if summary.get("decode_stride", 1) != base.decode_stride or \
            summary.get("keep_cache_across_steps") != base.keep_cache_across_steps:
        return None  # another stride, or another cache rule at weight sync (or a run from before it existed)
    if summary.get("router") != case.router:
        return None  # another router behind the same replicas
    tier = case.tier_gib if case.tier_gib is not None else base.offload_gib
    if summary.get("offload_blocks") and summary.get("offload_gib") != tier:
        return None  # a policy with a CPU tier, run with another tier size
    return _row(case.row(), summary), [float(d) for d in durations]


def _json_source(source: Any) -> Any:
    """A workload's source as its ``summary.json`` reads back (tuples become lists)."""
    return json.loads(json.dumps(source)) if source is not None else None


def _worker_case(grid: Grid, case: Case, out_dir: str) -> tuple[dict[str, Any], list[float]]:
    return run_case(_WORKER["workload"], grid, case, Path(out_dir))


def _ray_case(workload_path: str, grid: Grid, case: Case, out_dir: str) -> tuple[dict[str, Any], list[float]]:
    """A Ray task's body: the workload prepared once per Ray worker process (and workload), then the case."""
    if _WORKER.get("path") != workload_path:
        _init_worker(workload_path)
    return _worker_case(grid, case, out_dir)


def _failed(case: Case, e: BaseException) -> tuple[dict[str, Any], list[float]]:
    """The row of a case whose worker died or whose task raised."""
    return {**case.row(), "error": f"worker failed: {type(e).__name__}: {e}"}, []


def evaluate(workload_path: str | Path, grid: Grid, out_dir: str | Path, how: Execution = Execution(),
             on_case: Callable[[Case, dict[str, Any]], None] | None = None) -> EvaluationResult:
    """Run every case of ``grid`` on the workload as ``how`` says (see the module docstring); an unreadable
    workload raises :class:`EvaluationError` before anything runs. ``on_case`` sees each case's row as it
    finishes."""
    ray = _import_ray() if how.backend == "ray" else None
    from simulator.workload import load_workload

    try:
        workload = load_workload(workload_path)
    except Exception as e:  # noqa: BLE001 - any unreadable workload is a bad request
        raise EvaluationError(f"cannot read workload {workload_path}: {e}") from None
    # the tier's sizes are a dimension for the policies that use it
    cases = grid.cases(grid.tier_users(workload) if grid.tier_gibs is not None else ())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[Case, tuple[dict[str, Any], list[float]]] = {}

    bar, task = _progress(how.progress, len(cases))

    def done(case: Case, res: tuple[dict[str, Any], list[float]]) -> None:
        results[case] = res
        if bar is not None:
            bar.update(task, advance=1, description=f"{case.name}{' (failed)' if res[0]['error'] else ''}")
        if on_case is not None:
            on_case(case, res[0])

    try:
        todo = []
        key = (workload.table.num_rows, _json_source(workload.source))
        for case in cases:
            earlier = finished_case(grid, case, out, key) if how.resume else None
            if earlier is not None:
                done(case, earlier)
            else:
                todo.append(case)
        if ray is not None:
            _run_ray(ray, todo, str(Path(workload_path).resolve()), str(out.resolve()), grid, how, done)
        elif how.jobs == 1 or len(todo) <= 1:
            for case in todo:
                done(case, run_case(workload, grid, case, out))
        else:
            _run_parallel(todo, str(Path(workload_path)), str(out), grid, how.jobs, done)
    finally:
        if bar is not None:
            bar.stop()
    rows = [results[c][0] for c in cases]
    add_ratios(rows)
    traj = {c.name: results[c][1] for c in cases}
    files = write_reports(rows, out, traj, cases)
    return EvaluationResult(rows=rows, out_dir=out, files=files, trajectory_s=traj)


def _progress(enabled: bool, total: int) -> tuple[Any, Any]:
    if not enabled:
        return None, None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True))
    bar.start()
    return bar, bar.add_task("cases", total=total)


def _run_parallel(cases: list[Case], workload_path: str, out_dir: str, grid: Grid, jobs: int,
                  done: Callable) -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    ctx = mp.get_context("spawn")
    # Longest expected first, so that the workers run out of work at about the same time.
    cases = sorted(cases, key=expected_cost, reverse=True)
    with ProcessPoolExecutor(max_workers=min(jobs, len(cases)), mp_context=ctx, initializer=_init_worker,
                             initargs=(workload_path,)) as pool:
        futures = {pool.submit(_worker_case, grid, c, out_dir): c for c in cases}
        for fut in as_completed(futures):
            case = futures[fut]
            try:
                res = fut.result()
            except Exception as e:  # noqa: BLE001 - the worker died (e.g. out of memory)
                res = _failed(case, e)
            done(case, res)


def _import_ray() -> Any:
    """The ``ray`` module, imported only for ``backend="ray"``; a clear request error without it."""
    try:
        import ray
    except ImportError:
        raise EvaluationError("backend 'ray' needs Ray: pip install 'ray>=2.60' (kvpilot's [ray] extra)") \
            from None
    return ray


def _run_ray(ray: Any, cases: list[Case], workload_path: str, out_dir: str, grid: Grid, how: Execution,
             done: Callable) -> None:
    """Each case a Ray task of one CPU, submitted longest expected first, reported (``done``) as it finishes.

    Without ``how.address`` (and no Ray already initialized in this process) it starts a local Ray instance of
    ``how.jobs`` CPUs, so at most that many cases run at once; with one it joins that cluster. Ray is shut down at
    the end only if it was started here. The workers get :data:`_WORKER_ENV` and this process's ``PYTHONPATH``;
    ``workload_path`` and ``out_dir`` must be the same paths on every node (a shared file system). A task that
    raises or whose worker dies is an error row; tasks are not retried.
    """
    if not cases:
        return
    env = dict(_WORKER_ENV)
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    started = not ray.is_initialized()
    if started:
        import logging

        ray.init(address=how.address, num_cpus=how.jobs if how.address is None else None, include_dashboard=False,
                 logging_level=logging.WARNING)
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(_ray_case).options(runtime_env={"env_vars": env})
        pending = {task.remote(workload_path, grid, c, out_dir): c
                   for c in sorted(cases, key=expected_cost, reverse=True)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                case = pending.pop(ref)
                try:
                    res = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the task raised or its worker died
                    res = _failed(case, e)
                done(case, res)
    finally:
        if started:
            ray.shutdown()
