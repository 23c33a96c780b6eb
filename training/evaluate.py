"""Evaluate policies side by side: one workload, the same seeds and cost model, a grid of KV sizes, replicas and
routers.

:func:`evaluate` runs every :class:`Case` (policy x KV fraction x replica count
x router; the router only with several replicas, one case per policy and KV
fraction at one replica) with :func:`simulator.simulation.run_simulation`, each into
``out_dir/runs/<policy>-kv<f>-r<R>`` (``-<router>`` appended for R > 1), in this process, in ``jobs`` worker
processes (spawn context; each worker imports vLLM once, reads and prepares the workload
once and runs several cases, handed out longest expected first: :func:`expected_cost`), or as Ray tasks
(``backend="ray"``: a local Ray instance of ``jobs`` CPUs, or the cluster at ``address``; each Ray worker
process prepares the workload once; the same rows as the process pool). A case that fails is a row with an ``error``,
not a failed evaluation. ``vllm-default`` is always run, for the ratios.
Cases run at the simulator's decode stride :data:`DEFAULT_DECODE_STRIDE`
(``decode_stride``; 1 is the exact path, see :mod:`simulator.runner`).
Each finished case leaves ``runs/<case>/summary.json``,
``trajectories.json`` and its telemetry (``requests`` and ``steps``; ``decisions`` and ``kv_events`` too with
``full_telemetry``); with ``resume`` a case that an earlier evaluation into
the same folder finished at the same stride and router is read back, not rerun (the
workload and preset must be the same: they are not checked).

It writes, under ``out_dir``:

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

import csv
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy.catalog import LEARNED_ABLATIONS

DEFAULT = "vllm-default"
#: The learned policy's prior (no trained network), evaluated beside ``learned`` whenever that is listed.
PRIOR = "learned-prior"
#: The router the issue's criterion compares against (``makespan_ratio_vs_round_robin_default``).
ROUND_ROBIN = "round-robin"
#: Where cases run: ``process`` (this process or a spawned pool), ``ray`` (Ray tasks; :func:`_run_ray`).
BACKENDS = ("process", "ray")
#: The simulator's decode stride for evaluations: 32, because a stride's error is as large at 16 and the
#: default grid (78 cases) needs 32 to finish in under 20 minutes on 2 cores (vLLM's own work alone is about
#: 19.5 min at 16). Makespan ratio to vllm-default at the same stride, default workload, KV 0.4, one replica
#: (exact k = 1 / k = 16 / k = 32): seer 1.025 / 1.003 / 1.031, heddle 1.030 / 1.035 / 1.012, sjf-predicted
#: 1.040 / 1.041 / 1.041; vllm-default's makespan 250.0 / 250.2 / 250.0 s, its hit rate 0.741 / 0.736 / 0.732.
#: At KV 0.1 (benchmarks/bench_stride.py, an older tree): oracle 1.031 / 1.029 / 1.032, sjf-predicted
#: 1.015 / 1.028 / 1.014. Over the whole default grid, k = 32 moves a ratio from its k = 16 value by 0.3 % or
#: less in 63 of 77 cells and by 1-2.8 % in 9 (seer, heddle, rolloutpipe, sjf-predicted: admission-ordering
#: policies, whose tail moves with the step at which a long decode is admitted), for 0.71x the CPU of k = 16.
DEFAULT_DECODE_STRIDE = 32
#: KV fractions per replica of a grid that gives neither fractions nor fleet totals.
DEFAULT_KV_FRACTIONS = (0.1, 0.2, 0.4)

#: Registered policies that ``--policies all`` leaves out, so that ``all`` is the baselines (the field's thirteen,
#: InferCept, the working set and vLLM native offload, and the CPU-tier variants of continuum, kvflow, infercept
#: and working-set):
#: those that need a trained model (``learned`` and its ablations, :data:`policy.learned.ABLATIONS`:
#: ``model=POLICY_DIR``; ``registry``: the MLflow champion),
#: the exploring behaviour policy (``logging``), which is for collecting logs, not for comparison, and
#: ``lrb-online`` (learned eviction that trains as it runs; still runnable by name).
#: ``version-aware`` (asynchronous ``keep`` runs only: LRU on synchronous steps) is left out too.
NOT_IN_ALL = frozenset({"learned", *LEARNED_ABLATIONS, "registry", "logging", "lrb-online", "version-aware"})
RATIOS = {
    "makespan_ratio_vs_default": "makespan_s",
    "recompute_ratio_vs_default": "recomputed_tokens",
    "hit_rate_ratio_vs_default": "prefix_hit_rate",
    "simulated_ratio_vs_default": "simulated_s",
}
#: At several replicas: the makespan over vllm-default's behind round-robin (the router's criterion).
RR_RATIO = "makespan_ratio_vs_round_robin_default"
#: Summary keys that are lists or dicts (kept in summary.json, left out of the tables).
_NON_SCALAR = ("makespan_per_step_s", "group_completion_s", "tail_bubble_per_step_s", "bound_per_step_s")


class EvaluationError(ValueError):
    """A bad evaluation request (unknown policy, bad grid), raised before anything runs."""


@dataclass(frozen=True)
class Case:
    """One simulation of the grid: a router exactly when there are several replicas (one replica never asks)."""

    policy: str
    kv_fraction: float | None  # None: the preset GPU's own KV capacity
    replicas: int
    router: str | None = None
    #: The CPU offload tier's GiB per replica, when the grid sweeps it (``offload_gibs``; only for policies that
    #: use the tier); None: the run's one tier size (``sim_options["offload_gib"]``).
    tier_gib: float | None = None

    def __post_init__(self) -> None:
        if (self.router is None) != (self.replicas == 1):
            raise ValueError(f"a case has a router exactly when it has several replicas, got {self.replicas} "
                             f"replica(s) and router {self.router!r}")

    @property
    def name(self) -> str:
        kv = "gpu" if self.kv_fraction is None else f"{self.kv_fraction:g}"
        tier = f"-off{self.tier_gib:g}" if self.tier_gib is not None else ""
        return f"{self.policy}-kv{kv}{tier}-r{self.replicas}" + (f"-{self.router}" if self.router else "")

    def row(self) -> dict[str, Any]:
        """The grid keys a row of this case starts with, and ``error`` (``None``: it ran)."""
        return {"policy": self.policy, "kv_fraction": self.kv_fraction, "replicas": self.replicas,
                "router": self.router, "tier_gib": self.tier_gib, "error": None}


@dataclass
class EvaluationResult:
    rows: list[dict[str, Any]]
    out_dir: Path
    files: list[Path] = field(default_factory=list)
    trajectory_s: dict[str, list[float]] = field(default_factory=dict)  # case name -> completion times


def resolve_policies(policies: str | Sequence[str]) -> list[str]:
    """Policy names from a comma list or a sequence (``all``: see :data:`NOT_IN_ALL`); vllm-default first.

    ``all`` expands in place, so names beside it are added to it (``all,learned`` runs the baselines and the
    learned policy); ``learned`` brings ``learned-prior`` before it. Unknown names raise :class:`EvaluationError`
    naming the known ones."""
    import serving_hook  # noqa: F401 - registers the policy "registry" (the hook serving the MLflow champion)
    from policy.baselines import BASELINES
    from policy.catalog import known_policies

    known = known_policies()
    # the built-in baselines only: a policy registered at run time (training's candidate, a user's) is run by name
    every = [p for p in known if p in BASELINES and p not in NOT_IN_ALL]
    names = _expand_names(policies, every, known, ("policy", "policies"))
    out = [DEFAULT]
    for p in names:
        if p == "learned" and PRIOR not in names and PRIOR not in out:
            out.append(PRIOR)  # the trained network's value is always shown beside the rules it starts from
        if p not in out:
            out.append(p)
    return out


def resolve_routers(routers: str | Sequence[str]) -> list[str]:
    """Router names from a comma list or a sequence, each once (``all``: every name in
    :data:`simulator.routers.ROUTERS`, in its order). Unknown names raise :class:`EvaluationError` naming the
    known ones."""
    from simulator.routers import ROUTERS

    return list(dict.fromkeys(_expand_names(routers, list(ROUTERS), list(ROUTERS), ("router", "routers"))))


def _expand_names(given: str | Sequence[str], every: Sequence[str], known: Sequence[str],
                  noun: tuple[str, str]) -> list[str]:
    """Names from a comma list or a sequence, ``all`` expanded in place to ``every``; none, or an unknown one,
    raises :class:`EvaluationError` naming the ``known`` ones (``noun``: singular and plural)."""
    if isinstance(given, str):
        given = given.split(",")
    names = [q for p in (x.strip() for x in given) if p for q in (every if p == "all" else [p])]
    if not names:
        raise EvaluationError(f"no {noun[1]} given")
    unknown = [p for p in names if p not in known]
    if unknown:
        raise EvaluationError(f"unknown {noun[0] if len(unknown) == 1 else noun[1]} {', '.join(map(repr, unknown))}; "
                              f"known {noun[1]}: {', '.join(known)}")
    return names


def build_cases(policies: Sequence[str], kv_fractions: Iterable[float | None] | None,
                replicas: Iterable[int], routers: Sequence[str] = (ROUND_ROBIN,), *,
                kv_totals: Iterable[float] | None = None, tier_gibs: Iterable[float] | None = None,
                tier_users: Iterable[str] = ()) -> list[Case]:
    """The grid; a KV fraction of ``None`` is the preset GPU's own capacity (listed last). Each router is a case
    only with several replicas; at one replica there is one case per policy and KV fraction. ``tier_gibs``: CPU
    offload tier sizes (GiB per replica), a dimension for the policies in ``tier_users`` only (the others run
    once; a tier they do not use changes nothing).

    ``kv_totals`` instead of ``kv_fractions``: KV fractions of the whole fleet, each split evenly over each replica
    count's replicas (0.2 at 4 replicas: 0.05 per replica; at 8: 0.025), so that every replica count has the same
    KV in all."""
    reps = sorted({int(r) for r in replicas})
    if not reps or any(r < 1 for r in reps):
        raise EvaluationError(f"replica counts must be >= 1, got {reps}")
    if not routers:
        raise EvaluationError("no routers given")
    if kv_totals is not None:
        if kv_fractions is not None:
            raise EvaluationError("give KV fractions per replica or KV totals for the fleet, not both")
        totals = sorted({float(t) for t in kv_totals})
        if not totals or any(not (t > 0 and math.isfinite(t)) for t in totals):
            raise EvaluationError(f"KV totals must be positive numbers, got {sorted(set(kv_totals), key=str)}")
        per_replica = {r: sorted({float(f"{t / r:.12g}") for t in totals}) for r in reps}
    else:
        given = set(kv_fractions if kv_fractions is not None else DEFAULT_KV_FRACTIONS)
        kvs: list[float | None] = sorted({float(k) for k in given if k is not None})
        if not given or any(not (k > 0 and math.isfinite(k)) for k in kvs):
            raise EvaluationError(f"KV fractions must be positive numbers, got {sorted(given, key=str)}")
        if None in given:
            kvs.append(None)
        per_replica = {r: kvs for r in reps}
    tiers: list[float | None] = [None] if tier_gibs is None else list(tier_sizes(tier_gibs))
    users = set(tier_users)
    return [Case(p, k, r, rt, g) for r in reps for k in per_replica[r] for rt in (routers if r > 1 else [None])
            for p in policies for g in (tiers if p in users else [None])]


def tier_sizes(tier_gibs: Iterable[float]) -> list[float]:
    """CPU offload tier sizes (GiB per replica), sorted, each once; none, or one below 0, raises
    :class:`EvaluationError`."""
    from simulator.config import SimulationError, check_offload_gib

    try:
        tiers = sorted({check_offload_gib(g) for g in tier_gibs})
    except SimulationError as e:
        raise EvaluationError(f"CPU tier sizes: {e}") from None
    if not tiers:
        raise EvaluationError("no CPU tier size (offload_gib) given")
    return tiers


def check_run(jobs: int, backend: str, address: str | None, decode_stride: int) -> None:
    """How an evaluation runs (see :func:`evaluate`); a bad setting raises :class:`EvaluationError`."""
    if jobs < 1:
        raise EvaluationError(f"jobs must be >= 1, got {jobs}")
    if backend not in BACKENDS:
        raise EvaluationError(f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")
    if address is not None and backend != "ray":
        raise EvaluationError(f"address {address!r} is for the ray backend, not {backend!r}")
    if not isinstance(decode_stride, int) or decode_stride < 1:
        raise EvaluationError(f"decode_stride must be an integer >= 1, got {decode_stride!r}")


def tier_users(policies: Sequence[str], workload: Any, policy_options: dict[str, dict[str, Any]] | None) -> list[str]:
    """The policies (by name) that run over the CPU offload tier (``Policy.uses_offload``), built once each."""
    from simulator.config import SimConfig

    out = []
    for p in policies:
        opts = (policy_options or {}).get(p, {})
        try:
            probe = SimConfig(p, policy_options=opts).policy_factory(workload)()
        except Exception as e:  # noqa: BLE001 - a bad policy fails in its own case, with its error in the row
            del e
            continue
        if probe.uses_offload:
            out.append(p)
    return out


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


def run_case(workload: Any, case: Case, out_dir: Path, *, preset: str = "H200-7B",
             sim_options: dict[str, Any] | None = None,
             policy_options: dict[str, dict[str, Any]] | None = None) -> tuple[dict[str, Any], list[float]]:
    """Simulate one case; returns its row (``error`` set instead of raising) and its trajectory durations.

    ``workload``: a :class:`simulator.workload.PreparedWorkload` (validated once, shared by the cases).
    ``policy_options`` maps a policy name to its keyword options (e.g. ``{"learned": {"model": POLICY_DIR}}``).
    """
    from simulator.simulation import run_simulation

    row = case.row()
    run_dir = Path(out_dir) / "runs" / case.name
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)  # an earlier evaluation's run of this case
    try:
        opts = dict(sim_options or {})
        if case.tier_gib is not None:
            opts["offload_gib"] = case.tier_gib
        if policy_options and case.policy in policy_options:
            opts["policy_options"] = {**opts.get("policy_options", {}), **policy_options[case.policy]}
        # one replica never asks its router: round-robin stands in
        result = run_simulation(workload, case.policy, replicas=case.replicas, router=case.router or ROUND_ROBIN,
                                kv_fraction=case.kv_fraction, preset=preset, out_dir=run_dir, progress=False,
                                **opts)
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


def finished_case(case: Case, out_dir: Path, decode_stride: int, keep_cache_across_steps: bool = False,
                  offload_gib: float | None = None,
                  workload: tuple[str, int, Any] | None = None) -> tuple[dict[str, Any], list[float]] | None:
    """A case an earlier evaluation into ``out_dir`` finished at this stride, router, cache rule and CPU offload
    tier (summary and trajectories), or None.

    ``workload``: ``(preset, requests, source)`` of this evaluation; a run of another preset, another number of
    requests or another workload source (``kvpilot.source``) is not reused."""
    run_dir = Path(out_dir) / "runs" / case.name
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        durations = json.loads((run_dir / "trajectories.json").read_text())
    except (OSError, ValueError):
        return None
    if workload is not None and (summary.get("preset"), summary.get("requests"),
                                 summary.get("workload_source")) != workload:
        return None  # another workload or cost model
    if summary.get("decode_stride", 1) != decode_stride or \
            summary.get("keep_cache_across_steps") != keep_cache_across_steps:
        return None  # another stride, or another cache rule at weight sync (or a run from before it existed)
    if summary.get("router") != case.router:
        return None  # another router behind the same replicas
    if summary.get("offload_blocks") and offload_gib is not None and summary.get("offload_gib") != offload_gib:
        return None  # a policy with a CPU tier, run with another tier size
    return _row(case.row(), summary), [float(d) for d in durations]


def _json_source(source: Any) -> Any:
    """A workload's source as its ``summary.json`` reads back (tuples become lists)."""
    return json.loads(json.dumps(source)) if source is not None else None


def _worker_case(case: Case, out_dir: str, preset: str, sim_options: dict[str, Any] | None,
                 policy_options: dict[str, dict[str, Any]] | None = None) -> tuple[dict[str, Any], list[float]]:
    return run_case(_WORKER["workload"], case, Path(out_dir), preset=preset, sim_options=sim_options,
                    policy_options=policy_options)


def _ray_case(workload_path: str, case: Case, out_dir: str, preset: str, sim_options: dict[str, Any] | None,
              policy_options: dict[str, dict[str, Any]] | None) -> tuple[dict[str, Any], list[float]]:
    """A Ray task's body: the workload prepared once per Ray worker process (and workload), then the case."""
    if _WORKER.get("path") != workload_path:
        _init_worker(workload_path)
    return _worker_case(case, out_dir, preset, sim_options, policy_options)


def _failed(case: Case, e: BaseException) -> tuple[dict[str, Any], list[float]]:
    """The row of a case whose worker died or whose task raised."""
    return {**case.row(), "error": f"worker failed: {type(e).__name__}: {e}"}, []


def evaluate(
    workload_path: str | Path,
    policies: str | Sequence[str],
    out_dir: str | Path,
    *,
    kv_fractions: Sequence[float | None] | None = None,
    replicas: Sequence[int] = (1,),
    routers: str | Sequence[str] = (ROUND_ROBIN,),
    preset: str = "H200-7B",
    jobs: int = 1,
    backend: str = "process",
    address: str | None = None,
    progress: bool = True,
    decode_stride: int = DEFAULT_DECODE_STRIDE,
    resume: bool = False,
    sim_options: dict[str, Any] | None = None,
    on_case: Callable[[Case, dict[str, Any]], None] | None = None,
    policy_options: dict[str, dict[str, Any]] | None = None,
    full_telemetry: bool = False,
    kv_totals: Sequence[float] | None = None,
    offload_gibs: Sequence[float] | None = None,
) -> EvaluationResult:
    """Run the grid (see the module docstring); bad requests raise :class:`EvaluationError` before running.

    ``kv_fractions``: KV per replica (default :data:`DEFAULT_KV_FRACTIONS`); or ``kv_totals``: KV of the whole
    fleet, the same at every replica count (:func:`build_cases`).
    ``routers``: router names (:func:`resolve_routers`), a grid dimension at several replicas.
    ``backend``: ``process`` (this process, or ``jobs`` spawned worker processes) or ``ray`` (Ray tasks of one
    CPU each: with no ``address`` on a local Ray instance of ``jobs`` CPUs started here, else on the cluster at
    ``address``, as many at once as it schedules; see :func:`_run_ray`).
    ``policy_options``: per-policy keyword options, by policy name (``learned`` needs ``model``).
    ``offload_gibs``: CPU offload tier sizes (GiB per replica) to sweep, a grid dimension for the policies that use
    the tier (one size: the same as ``sim_options["offload_gib"]``).
    ``full_telemetry``: also write each run's ``decisions`` (every candidate's features at every decision: what
    training and OPE read) and ``kv_events`` telemetry (every block stored or removed); off by default, since
    the comparison needs only the summaries, which read ``requests`` and ``steps``.
    """
    names = resolve_policies(policies)
    if offload_gibs is not None and len(tier_sizes(offload_gibs)) == 1:
        sim_options = {**(sim_options or {}), "offload_gib": float(next(iter(offload_gibs)))}
        offload_gibs = None
    cases = build_cases(names, kv_fractions, replicas, resolve_routers(routers), kv_totals=kv_totals,
                        tier_gibs=offload_gibs)
    check_run(jobs, backend, address, decode_stride)
    ray = _import_ray() if backend == "ray" else None
    sim_options = {"decode_stride": decode_stride, "decision_log": full_telemetry, "kv_event_log": full_telemetry,
                   **(sim_options or {})}
    from simulator.workload import load_workload

    try:
        workload = load_workload(workload_path)
    except Exception as e:  # noqa: BLE001 - any unreadable workload is a bad request
        raise EvaluationError(f"cannot read workload {workload_path}: {e}") from None
    if offload_gibs is not None:  # the tier's sizes are a dimension for the policies that use it
        cases = build_cases(names, kv_fractions, replicas, resolve_routers(routers), kv_totals=kv_totals,
                            tier_gibs=offload_gibs, tier_users=tier_users(names, workload, policy_options))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[Case, tuple[dict[str, Any], list[float]]] = {}

    bar, task = _progress(progress, len(cases))

    def done(case: Case, res: tuple[dict[str, Any], list[float]]) -> None:
        results[case] = res
        if bar is not None:
            bar.update(task, advance=1, description=f"{case.name}{' (failed)' if res[0]['error'] else ''}")
        if on_case is not None:
            on_case(case, res[0])

    try:
        todo = []
        for case in cases:
            earlier = finished_case(case, out, decode_stride, bool(sim_options.get("keep_cache_across_steps")),
                                    case.tier_gib if case.tier_gib is not None else sim_options.get("offload_gib"),
                                    (preset, workload.table.num_rows, _json_source(workload.source))) \
                if resume else None
            if earlier is not None:
                done(case, earlier)
            else:
                todo.append(case)
        if ray is not None:
            _run_ray(ray, todo, str(Path(workload_path).resolve()), str(out.resolve()), preset, sim_options, jobs,
                     address, done, policy_options)
        elif jobs == 1 or len(todo) <= 1:
            for case in todo:
                done(case, run_case(workload, case, out, preset=preset, sim_options=sim_options,
                                    policy_options=policy_options))
        else:
            _run_parallel(todo, str(Path(workload_path)), str(out), preset, sim_options, jobs, done,
                          policy_options)
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


def _run_parallel(cases: list[Case], workload_path: str, out_dir: str, preset: str,
                  sim_options: dict[str, Any] | None, jobs: int, done: Callable,
                  policy_options: dict[str, dict[str, Any]] | None = None) -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    ctx = mp.get_context("spawn")
    # Longest expected first, so that the workers run out of work at about the same time.
    cases = sorted(cases, key=expected_cost, reverse=True)
    with ProcessPoolExecutor(max_workers=min(jobs, len(cases)), mp_context=ctx, initializer=_init_worker,
                             initargs=(workload_path,)) as pool:
        futures = {pool.submit(_worker_case, c, out_dir, preset, sim_options, policy_options): c for c in cases}
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


def _run_ray(ray: Any, cases: list[Case], workload_path: str, out_dir: str, preset: str,
             sim_options: dict[str, Any] | None, jobs: int, address: str | None, done: Callable,
             policy_options: dict[str, dict[str, Any]] | None = None) -> None:
    """Each case a Ray task of one CPU, submitted longest expected first, reported (``done``) as it finishes.

    Without ``address`` (and no Ray already initialized in this process) it starts a local Ray instance of
    ``jobs`` CPUs, so at most ``jobs`` cases run at once; with one it joins that cluster. Ray is shut down at
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

        ray.init(address=address, num_cpus=jobs if address is None else None, include_dashboard=False,
                 logging_level=logging.WARNING)
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(_ray_case).options(runtime_env={"env_vars": env})
        pending = {task.remote(workload_path, c, out_dir, preset, sim_options, policy_options): c
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


def gap_closed(policy_s: Any, default_s: Any, bound_s: Any) -> float | None:
    """(default - policy) / (default - bound): the share of vLLM default's gap to the bound a policy closes
    (1: it reaches the bound; 0: no better than default; negative: worse). ``None`` without a gap."""
    if policy_s is None or default_s is None or bound_s is None or not default_s - bound_s > 1e-9 * default_s:
        return None
    return (default_s - policy_s) / (default_s - bound_s)


def _ratio(a: Any, b: Any) -> float | None:
    """a / b; ``None`` without both or when only b is 0 (1.0 when both are)."""
    if a is None or b is None:
        return None
    if b == 0:
        return 1.0 if a == 0 else None
    return a / b


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's ratios to vllm-default's row at the same KV fraction, replicas and router, the share of
    default's gap to the bound it closes (``gap_closed``, on the whole run's ``simulated_s``), and at several
    replicas its makespan over vllm-default's behind round-robin (:data:`RR_RATIO`), in place."""
    base = {(r["kv_fraction"], r["replicas"], r.get("router")): r for r in rows if r["policy"] == DEFAULT}

    def value(row: dict[str, Any] | None, key: str) -> Any:
        return row.get(key) if row is not None and not row.get("error") else None

    for r in rows:
        d = base.get((r["kv_fraction"], r["replicas"], r.get("router")))
        ok = not r.get("error") and d is not None and not d.get("error")
        r["gap_closed"] = gap_closed(r.get("simulated_s"), d.get("simulated_s"), r.get("bound_total_s")) if ok \
            else None
        for ratio, key in RATIOS.items():
            r[ratio] = _ratio(value(r, key), value(d, key))
        rr = base.get((r["kv_fraction"], r["replicas"], ROUND_ROBIN)) if r["replicas"] > 1 else None
        r[RR_RATIO] = _ratio(value(r, "makespan_s"), value(rr, "makespan_s")) if rr is not None else None


# ---------------------------------------------------------------- reports

def _columns(rows: list[dict[str, Any]]) -> list[str]:
    swept = any(r.get("tier_gib") is not None for r in rows)  # the tier's size is a column only when swept
    head = ["policy", "kv_fraction", "replicas", "router", *(["tier_gib"] if swept else []), *RATIOS, RR_RATIO,
            "makespan_over_bound", "gap_closed"]
    rest: list[str] = []
    for r in rows:
        for k, v in r.items():
            if k not in head and k not in rest and k not in ("error", "tier_gib") and k not in _NON_SCALAR \
                    and not isinstance(v, (list, dict)):
                rest.append(k)
    return head + rest + ["error"]


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_reports(rows: list[dict[str, Any]], out: Path, trajectory_s: dict[str, list[float]],
                  cases: list[Case]) -> list[Path]:
    cols = _columns(rows)
    full = [{k: r.get(k) for k in dict.fromkeys([*cols[:-1], *_NON_SCALAR, "error"])} for r in rows]
    files = [out / "summary.json", out / "summary.csv", out / "summary.md"]
    files[0].write_text(json.dumps(full, indent=2, default=str))
    with files[1].open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in rows:
            w.writerow(["gpu" if k == "kv_fraction" and r.get(k) is None else "" if r.get(k) is None else r.get(k)
                        for k in cols])
    md = ["# Policy evaluation", "",
          ("Ratios are to vllm-default at the same KV fraction, replicas and router (makespan, recompute and "
           "simulated time: lower is better; hit rate: higher is better); `makespan_ratio_vs_round_robin_default` "
           "is to vllm-default behind round-robin (several replicas). `makespan_over_bound` is the whole run's "
           "simulated time over its physics lower bound (`bound_total_s`, simulator/bound.py; 1 is optimal), "
           "`gap_closed` the share of vllm-default's gap to that bound the policy closes."), "",
          "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [("gpu" if k == "kv_fraction" and r.get(k) is None else _fmt(r.get(k))) for k in cols]
        md.append("| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |")
    files[2].write_text("\n".join(md) + "\n")
    files += plot_reports(rows, out, trajectory_s, cases)
    return files


def _styles(policies: list[str]) -> dict[str, dict[str, Any]]:
    import matplotlib

    markers = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p", "d", "8"]
    if len(policies) <= 10:
        colors = [matplotlib.colormaps["tab10"](i) for i in range(len(policies))]
    else:  # tab20's dark shades first, then its light ones (with dashed lines)
        order = list(range(0, 20, 2)) + list(range(1, 20, 2))
        colors = [matplotlib.colormaps["tab20"](order[i % 20]) for i in range(len(policies))]
    # Earlier policies get thicker lines and bigger markers, so a later line on top of one never hides it.
    n = len(policies)
    return {p: {"color": colors[i], "marker": markers[i % len(markers)], "linestyle": "-" if i < 10 else "--",
                "linewidth": 1.2 + 1.6 * (n - 1 - i) / max(n - 1, 1), "markersize": 5 + 5 * (n - 1 - i) / max(n - 1, 1)}
            for i, p in enumerate(policies)}


def plot_reports(rows: list[dict[str, Any]], out: Path, trajectory_s: dict[str, list[float]],
                 cases: list[Case]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    several = len({r["router"] for r in rows if r.get("router")}) > 1

    def label(policy: str, router: str | None, tier: float | None = None) -> str:
        """A line's legend label: the policy, with its router when the grid has several, and its CPU tier's size
        when the grid sweeps it."""
        name = f"{policy} @ {router}" if several and router else policy
        return f"{name} ({tier:g} GiB tier)" if tier is not None else name

    labels = list(dict.fromkeys(label(r["policy"], r.get("router"), r.get("tier_gib")) for r in rows))
    style = _styles(labels)
    reps = sorted({r["replicas"] for r in rows})
    xlabel = "KV cache per replica (fraction of the largest step's need)"
    files = []
    for fname, key, ylabel, title in (
            ("makespan.png", "simulated_s", "workload makespan (s, simulated)", "Makespan vs KV size"),
            ("hit_rate.png", "prefix_hit_rate", "prefix hit rate (cached / prompt tokens)",
             "Prefix hit rate vs KV size"),
            ("recompute.png", "recomputed_tokens", "recomputed tokens (tokens)", "Recompute vs KV size")):
        fig, axes = plt.subplots(1, len(reps), figsize=(5.2 * len(reps) + 1.5, 4.2), squeeze=False)
        for ax, r in zip(axes[0], reps):
            for p in labels:
                pts = sorted((_kv_x(x), x.get(key)) for x in rows
                             if label(x["policy"], x.get("router"), x.get("tier_gib")) == p and x["replicas"] == r
                             and not x.get("error")
                             and _kv_x(x) is not None
                             and x.get(key) is not None)
                if pts:
                    ax.plot([a for a, _ in pts], [b for _, b in pts], label=p, **style[p])
            if key == "simulated_s":  # the physics lower bound under the same cost model
                pts = sorted({(_kv_x(x), x["bound_total_s"]) for x in rows if x["replicas"] == r
                              and not x.get("error") and x.get("bound_total_s") is not None
                              and _kv_x(x) is not None})
                if pts:
                    ax.plot([a for a, _ in pts], [b for _, b in pts], color="black", linestyle=":", linewidth=2.0,
                            marker="_", markersize=22, markeredgewidth=2.0, label="lower bound")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title} ({r} replica{'s' if r > 1 else ''})")
            ax.grid(True, alpha=0.3)
        _legend(fig, axes[0][-1], labels, style)
        files.append(_save(fig, out / fname))
    # ECDF of trajectory completion times at the smallest KV fraction, one panel per replica count
    kv0 = min((c.kv_fraction for c in cases if c.kv_fraction is not None), default=None)
    fig, axes = plt.subplots(1, len(reps), figsize=(5.2 * len(reps) + 1.5, 4.2), squeeze=False)
    for ax, r in zip(axes[0], reps):
        for c in (c for c in cases if c.kv_fraction == kv0 and c.replicas == r):
            p = label(c.policy, c.router, c.tier_gib)
            d = np.sort(np.asarray(trajectory_s.get(c.name) or [], dtype=float))
            if d.size:
                ax.step(d, np.arange(1, d.size + 1) / d.size, where="post", label=p, color=style[p]["color"],
                        linestyle=style[p]["linestyle"], linewidth=style[p]["linewidth"])
                ax.plot(d[-1], 1.0, marker=style[p]["marker"], color=style[p]["color"],
                        markersize=style[p]["markersize"])
        ax.set_xlabel("trajectory completion time (s, simulated)")
        ax.set_ylabel("fraction of trajectories completed")
        kv_label = "GPU capacity" if kv0 is None else f"{kv0:g}"
        ax.set_title(f"Trajectory completion ECDF (KV {kv_label}, {r} replica{'s' if r > 1 else ''})")
        ax.grid(True, alpha=0.3)
    _legend(fig, axes[0][-1], labels, style)
    files.append(_save(fig, out / "trajectory_ecdf.png"))
    return files


def _kv_x(row: dict[str, Any]) -> float | None:
    """A row's place on the KV axis: its fraction, or for the GPU's own capacity the share of the need it is."""
    return row["kv_fraction"] if row["kv_fraction"] is not None else row.get("kv_share_of_need")


def _legend(fig: Any, ax: Any, policies: list[str], style: dict) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=style[p]["color"], marker=style[p]["marker"], linestyle=style[p]["linestyle"],
                      label=p) for p in policies]
    if any(line.get_label() == "lower bound" for line in ax.get_lines()):
        handles.append(Line2D([], [], color="black", linestyle=":", linewidth=2.0, marker="_", markersize=12,
                              markeredgewidth=2.0, label="lower bound"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8,
              title="policy")


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
