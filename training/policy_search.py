"""Policy search by simulation: the admission residual's weights that shorten the logged workloads' RL steps.

Off-policy learning from logged decisions has not beaten the prior's shortest-first order: the logs hold too few
informative admissions. The logs do hold the workloads they came from, though, and the simulator replays them on
vLLM's real scheduler. So, as Decima trained its scheduler, the policy is improved by simulating it: the
cross-entropy method (CEM) samples weights of the learned policy's admission residual (``admission_residual``,
:mod:`policy.learned.policy`: weights on standardised candidate features and on the scorer's admission head, added
to the prior's key), simulates each sample on every logged workload on the logs' own engine (preset, KV blocks, CPU
tier, decode stride), and moves its sampling distribution toward the samples with the shortest makespans relative to
the zero residual (the prior's order). The best sample is kept only if it beats the zero residual by
:attr:`SearchConfig.min_gain`; otherwise the residual stays empty and the policy serves its prior's order. Before
the residual, the admission order and the levers are chosen the same way, from a small action set: the bundle as
trained (the prior's shortest-first order), each admission order of ``orders`` (by default a request whose GRPO
group has a request running first, the trajectories' returning turns first, and vLLM's own queue order; heddle's
progress first on request). An order is kept only if
it beats the bundle as trained by ``min_gain``, the best one where several do. Then, with ``levers_off``, each lever
the bundle trained (the CPU tier, the preemption head) is simulated off with the order kept, and stays on only where
it beats off by ``min_gain``: a trained lever is served only where the logs' engine runs it faster (on vLLM's CPU
server the preemption head's victims simulated level with (0.999x) or behind (1.030x) vLLM's on two logging runs'
steps, and cost the champion about 9% on the next step). Then, with ``width``, the choice kept is simulated
once more with the rollout's width on (:class:`policy.group_width.WidthHolds`: a younger GRPO group's turns wait
while the older groups' contexts do not fit in GPU KV plus the tier), kept where it beats that choice by
``min_gain``: where memory binds over a tier every session of a synchronous step in flight at once evicts
the others' paused contexts. The rules disagree by regime (shortest-first and the width win where memory binds, the
returning turns first on short search sessions, vLLM's queue order on short agent turns on vLLM's CPU server as
the simulator models it), and the logged workloads say which regime the logs' engine serves. A server's
telemetry has no simulator summary to name its engine: the search then simulates the preset ``kvpilot calibrate``
fitted to that server (:attr:`SearchConfig.engine_preset`). With ``iterations = 0`` only this choice runs (``kvpilot
train``'s default: a few simulations), and the CEM runs only over the shortest-first order, which its residual
moves. Samples run in parallel on a process pool (``backend="process"``) or as Ray tasks (``backend="ray"``).

Everything the search does is in :func:`search_admission`, its hyper-parameters in :class:`SearchConfig`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: The residual's inputs the search moves by default: how far the candidate's GRPO group is (seer's and
#: SortedRL's signal), the session's turn (progress-first, heddle's), the wait (FCFS), the context it will hold
#: at the end (its memory), and the scorer's admission head (what offline learning ranked).
DEFAULT_INPUTS = ("group_done_frac", "turn", "log_wait_s", "log_pred_final_context", "scorer")
#: The admission orders the search may try beside the prior's shortest-first (``LearnedPolicy``'s option
#: ``admission``).
#: ``siblings`` (a request whose GRPO group has a request running first: their shared prompt is in KV) is tried:
#: on vLLM's CPU server's calibrated preset, memory binding, agentic steps of five seeds simulated it at
#: 0.79-0.95x vllm-default where shortest-first ran 0.93-1.08x; on the server it ran 0.83x on one held-out step and
#: 1.04x on another (docs/results/2026-12-07-siblings-first.md).
#: ``sessions`` (continuum's program order: the session's first arrival, a returning turn in its place) is tried:
#: continuum, which admits in that order, was the best rule on both held-out steps on the server (0.88x, 0.89x).
ORDER_CHOICES = ("siblings", "sessions", "returning", "progress", "queue")
#: Those it tries by default. Heddle's ``progress`` is left out: on Search-R1 it and ``returning`` simulated within
#: 0.2% of each other on PolyTrace step 0, and held out on step 1 ``progress`` ran 1.7% slower than shortest-first
#: where ``returning`` ran 1.1% faster (docs/results/2026-12-07-admission-order-by-simulation.md): one more order is
#: one more chance to keep a lucky one. vLLM's own ``queue`` order is tried: where shortest-first loses to vLLM
#: (simulated on a preset fitted to vLLM's CPU server, 64-token agent turns: 1.6x), it is the choice that does not.
#: On two logged steps it was also kept where the next step did not favour it
#: (docs/results/2026-12-07-real-engine-engine-preset.md): few logged steps make any choice a noisy one.
DEFAULT_ORDERS = ("siblings", "sessions", "returning", "queue")


class SearchError(ValueError):
    """Logs the search cannot replay (no workload beside them, a multi-replica run), raised before simulating."""


@dataclass(frozen=True)
class SearchConfig:
    """The cross-entropy method's hyper-parameters."""

    iterations: int = 0  # CEM iterations; 0: the admission order only, no CEM
    population: int = 8  # samples per iteration
    elite: int = 3  # the samples the next distribution is fitted to
    init_std: float = 1.0  # weights are on standardised features; the prior's key, log1p(remaining), has std ~1-2
    min_std: float = 0.1
    min_gain: float = 0.005  # keep the best sample only if its mean makespan ratio is below 1 - min_gain
    inputs: tuple[str, ...] = DEFAULT_INPUTS
    orders: tuple[str, ...] = DEFAULT_ORDERS  # admission orders tried beside shortest-first (of ORDER_CHOICES)
    levers_off: bool = True  # then each trained lever (offload, preempt) kept on only where it beats off
    width: bool = True  # then the width (policy.group_width.WidthHolds) tried on, with the order and levers kept
    seed: int = 0
    jobs: int = 2
    backend: str = "process"  # or "ray"
    address: str | None = None  # Ray cluster address (backend "ray"); None: a local Ray
    #: The engine of logs that carry no simulator summary (a server's telemetry): a preset file that
    #: ``kvpilot calibrate`` fitted to that server. None: such logs cannot be replayed.
    engine_preset: str | None = None

    @property
    def active(self) -> bool:
        """Whether there is anything to simulate: another admission order, a lever off, the width or CEM
        iterations."""
        return bool(self.orders or self.levers_off or self.width or self.iterations)

    def __post_init__(self) -> None:
        from policy.learned.features import FEATURES
        from policy.learned.policy import SCORER_INPUT

        if not (self.iterations >= 0 and self.population >= 2 and 1 <= self.elite <= self.population):
            raise SearchError(f"search needs iterations >= 0, population >= 2 and 1 <= elite <= population, got "
                              f"{self.iterations}, {self.population}, {self.elite}")
        unknown = [k for k in self.inputs if k not in (*FEATURES, SCORER_INPUT)]
        if unknown or not self.inputs:
            raise SearchError(f"search inputs must be names of {', '.join((*FEATURES, SCORER_INPUT))}; got "
                              f"{', '.join(unknown) or 'none'}")
        bad = [o for o in self.orders if o not in ORDER_CHOICES]
        if bad:
            raise SearchError(f"search admission orders must be among {', '.join(ORDER_CHOICES)}; got "
                              f"{', '.join(bad)}")
        if not (self.init_std > 0 and self.min_std > 0 and self.min_gain >= 0 and self.jobs >= 1):
            raise SearchError("search init_std and min_std must be > 0, min_gain >= 0 and jobs >= 1")
        if self.backend not in ("process", "ray"):
            raise SearchError(f"search backend must be 'process' or 'ray', got {self.backend!r}")
        if self.engine_preset is not None:
            fitted_engine(self.engine_preset)  # a named error now, before anything is fitted


@dataclass(frozen=True)
class Replay:
    """One logged workload and the engine it was logged on (its run's ``summary.json``)."""

    workload: Path
    options: dict[str, Any]  # run_simulation's keyword options


@dataclass
class SearchResult:
    residual: dict[str, float]  # the weights kept ({}: the prior's order)
    ratio: float  # the kept policy's mean makespan over the bundle's as trained with the prior's order
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per residual sample
    levers: dict[str, Any] = field(default_factory=dict)  # runtime options set (the admission order, levers off)

    def runtime(self) -> dict[str, Any]:
        """The runtime options to serve: the levers chosen and the residual."""
        return {**self.levers, "admission_residual": self.residual}

    def metrics(self) -> dict[str, float]:
        """MLflow metrics: the kept ratio, the samples simulated, the kept weights and levers."""
        order = self.levers.get("admission", "shortest")
        return {"search.makespan_ratio_vs_trained_prior_order": self.ratio, "search.samples": float(len(self.history)),
                **{f"search.residual.{k}": v for k, v in self.residual.items()},
                **{f"search.lever.{k}": float(v) for k, v in self.levers.items() if isinstance(v, bool)},
                **{f"search.admission.{o}": float(o == order) for o in ("shortest", *ORDER_CHOICES)}}


def replays(log_dirs: Sequence[Path], engine_preset: str | Path | None = None) -> list[Replay]:
    """Each log's workload (``LOG/workload.parquet``) and engine, checked before anything runs: its run's
    ``summary.json`` (a simulation's), else ``engine_preset`` (a server's telemetry, on a preset fitted to it)."""
    out = []
    for log in map(Path, log_dirs):
        wl, summary = log / "workload.parquet", log / "summary.json"
        if not wl.is_file():
            raise SearchError(f"{log}: no workload.parquet beside the telemetry, so it cannot be replayed (simulate "
                              "writes one; copy the workload a serving log came from there)")
        if not summary.is_file() and engine_preset is not None:
            out.append(Replay(wl.resolve(), fitted_engine(engine_preset)))
            continue
        try:
            s = json.loads(summary.read_text())
        except (OSError, ValueError) as e:
            raise SearchError(f"{summary}: unreadable ({e}), so the logs' engine is unknown; for a server's telemetry "
                              "give the preset `kvpilot calibrate` fitted to that server (--engine-preset)") from None
        if s.get("driver", "sync") != "sync" or int(s.get("replicas", 1) or 1) != 1:
            raise SearchError(f"{log}: the policy search replays one-replica synchronous runs only")
        try:
            opts = {"preset": s["preset"], "kv_blocks": int(s["kv_blocks"]), "decode_stride": int(s["decode_stride"]),
                    "offload_gib": float(s.get("offload_gib") or 0.0) if s.get("offload_blocks") else 0.0,
                    "keep_cache_across_steps": bool(s.get("keep_cache_across_steps", False))}
        except (KeyError, TypeError, ValueError) as e:
            raise SearchError(f"{summary}: missing or bad field {e}") from None
        out.append(Replay(wl.resolve(), opts))
    return out


def fitted_engine(preset: str | Path) -> dict[str, Any]:
    """``run_simulation``'s engine options for a server's logs: the preset ``kvpilot calibrate`` fitted to it (its
    KV capacity and scheduler limits; no host tier), exact decode steps."""
    from simulator.fitted_cost import PresetFileError, read_preset_file

    try:
        read_preset_file(preset)
    except PresetFileError as e:
        raise SearchError(f"engine preset: {e}") from None
    return {"preset": str(Path(preset).resolve()), "decode_stride": 1}


def _simulate(policy_dir: str, runtime: dict[str, Any], workload: str, options: dict[str, Any]) -> float:
    """The makespan (mean per RL step) of the POLICY_DIR with ``runtime`` options on one workload (a worker's
    task)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from simulator.simulation import run_simulation
    from simulator.workload import load_workload

    res = run_simulation(load_workload(workload), "learned", progress=False,
                         policy_options={"model": policy_dir, **runtime}, **options)
    return float(res.summary.metrics.makespan_s)


def parallel_runner(cfg: Any, task: Callable[..., Any] | None = None) -> Callable[[list[tuple]], list[Any]]:
    """A function that runs a batch of ``task`` argument tuples (default: :func:`_simulate`) in parallel (``cfg``'s
    ``jobs``, ``backend``, ``address``) and returns their results in order."""
    task = task or _simulate
    if cfg.backend == "ray":
        from training.evaluate import _import_ray

        ray = _import_ray()
        if not ray.is_initialized():
            ray.init(address=cfg.address, runtime_env={"env_vars": {"PYTHONHASHSEED": os.environ.get(
                "PYTHONHASHSEED", "0"), "VLLM_TARGET_DEVICE": "cpu"}}, log_to_driver=False)
        remote = ray.remote(num_cpus=1)(task)
        return lambda batch: ray.get([remote.remote(*a) for a in batch])

    def run(batch: list[tuple]) -> list[Any]:
        if cfg.jobs == 1:
            return [task(*a) for a in batch]
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=min(cfg.jobs, len(batch)), mp_context=mp.get_context("spawn")) as pool:
            return list(pool.map(task, *zip(*batch)))

    return run


def search_admission(policy_dir: Path, log_dirs: Sequence[Path], cfg: SearchConfig | None = None,
                     progress: Callable[[str], None] | None = None) -> SearchResult:
    """CEM over the admission residual of POLICY_DIR on the logs' workloads (see the module docstring)."""
    cfg = cfg or SearchConfig()
    plays = replays(log_dirs, cfg.engine_preset)
    say = progress or (lambda _: None)
    run = parallel_runner(cfg)
    rng = np.random.default_rng(cfg.seed)
    d = len(cfg.inputs)

    def weights(theta: np.ndarray) -> dict[str, float]:
        return {k: round(float(v), 4) for k, v in zip(cfg.inputs, theta) if round(float(v), 4) != 0.0}

    def makespans(runtimes: list[dict[str, Any]]) -> list[list[float]]:
        made = run([(str(policy_dir), r, str(p.workload), p.options) for r in runtimes for p in plays])
        n = len(plays)
        return [made[i * n:(i + 1) * n] for i in range(len(runtimes))]

    def ratio(made: list[float], base: list[float]) -> float:
        return float(np.mean([m / b for m, b in zip(made, base)]))

    # the admission order first (a small action set): the bundle as trained, and each other order
    policy_dir = Path(policy_dir).resolve()
    orders = order_choices(cfg.orders)
    got = makespans([{**o, "admission_residual": {}} for o in orders])
    base = got[0]
    say(f"search: the bundle as trained, shortest first: {', '.join(f'{b:.1f} s' for b in base)} on {len(plays)} "
        f"logged workload(s)")
    kept = 0  # the index of the order kept
    for i, (lv, made) in enumerate(zip(orders[1:], got[1:]), start=1):
        r = ratio(made, base)
        say(f"search: {lv}: {r:.4f}x")
        if r < 1.0 - cfg.min_gain and r < ratio(got[kept], base):
            kept = i
    lever, base = orders[kept], got[kept]
    # then each lever the bundle trained, off, with the order kept: it stays on only where it beats off by min_gain
    # (a trained lever, like another order or the width, is served only where it wins)
    for name in trained_levers(policy_dir) if cfg.levers_off else ():
        off = {**lever, name: False}
        made = makespans([{**off, "admission_residual": {}}])[0]
        r = ratio(base, made)
        say(f"search: {lever} with {name} on: {r:.4f}x the same with it off")
        if r >= 1.0 - cfg.min_gain:
            lever, base = off, made
    if cfg.width and not read_runtime(policy_dir).get("width"):
        wide = {**lever, "width": True}
        made = makespans([{**wide, "admission_residual": {}}])[0]
        r = ratio(made, base)
        say(f"search: {wide}: {r:.4f}x")
        if r < 1.0 - cfg.min_gain:
            lever, base = wide, made
    lever_ratio = ratio(base, got[0])
    say(f"search: kept {lever} ({lever_ratio:.4f}x)")
    if not cfg.iterations or lever["admission"] != "shortest":  # the residual moves shortest-first only
        return SearchResult({}, lever_ratio, [{"iteration": 0, "residual": {}, "ratio": 1.0, "levers": lever}],
                            lever)

    def ratios(thetas: list[np.ndarray], base: list[float]) -> list[float]:
        return [ratio(m, base) for m in makespans([{**lever, "admission_residual": weights(t)} for t in thetas])]

    mean, std = np.zeros(d), np.full(d, cfg.init_std)
    history: list[dict[str, Any]] = [{"iteration": 0, "residual": {}, "ratio": 1.0, "levers": lever}]
    best_theta, best = np.zeros(d), 1.0
    for it in range(1, cfg.iterations + 1):
        thetas = [mean + std * rng.standard_normal(d) for _ in range(cfg.population)]
        got = ratios(thetas, base)
        history += [{"iteration": it, "residual": weights(t), "ratio": r} for t, r in zip(thetas, got)]
        order = np.argsort(got)
        if got[order[0]] < best:
            best, best_theta = got[order[0]], thetas[order[0]]
        elite = np.array([thetas[i] for i in order[:cfg.elite]])
        mean, std = elite.mean(axis=0), np.maximum(elite.std(axis=0), cfg.min_std)
        say(f"search: iteration {it}/{cfg.iterations}: best {got[order[0]]:.4f}x the prior's makespan "
            f"({weights(thetas[order[0]]) or 'zero'}); best so far {best:.4f}x")
    if best > 1.0 - cfg.min_gain:
        say(f"search: no sample beat the prior's order by {cfg.min_gain:.1%}: the residual stays empty")
        return SearchResult({}, lever_ratio, history, lever)
    return SearchResult(weights(best_theta), best * lever_ratio, history, lever)


def read_runtime(policy_dir: Path) -> dict[str, Any]:
    """POLICY_DIR's runtime options as trained."""
    from policy.learned.bundle import read_manifest

    return read_manifest(Path(policy_dir)).get("config", {}).get("runtime", {})


def order_choices(orders: Sequence[str] = DEFAULT_ORDERS) -> list[dict[str, Any]]:
    """The admission orders tried: the bundle as trained with the prior's shortest-first order, then each of
    ``orders``."""
    return [{"admission": "shortest"}, *({"admission": o} for o in orders)]


def trained_levers(policy_dir: Path) -> list[str]:
    """The runtime levers POLICY_DIR was trained to serve that the search may turn off: the CPU tier (``offload``)
    and the preemption head (``preempt``)."""
    runtime = read_runtime(policy_dir)
    return [k for k in ("offload", "preempt") if runtime.get(k)]
