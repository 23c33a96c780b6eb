"""``kvpilot train``: fit both predictors and the policy in one MLflow run, evaluate it, register one version.

:func:`train_and_register` loads telemetry run folders, fits the LightGBM
length and reuse predictors (:func:`predictors.pipeline.train_bundle`, whole RL
steps held out, or whole GRPO groups when the logs hold a single RL step; printed,
and the report's ``split``), fits the learned policy on them (:func:`policy.learning.offline.train_policy`,
which writes a POLICY_DIR carrying those predictors), simulates the trained
policy against vLLM default on a held-out workload (:func:`training.evaluate.evaluate`; on the logs' engine:
preset, KV size and CPU tier, and a fresh step of the logs' own synthetic mix, where they agree and the caller
sets none),
and logs all of it to one MLflow run: every hyper-parameter and the data's
time range and row counts as params; predictor quality, OPE estimates with
their CIs and the simulator's ratios as metrics; the evaluation table, plots
and the predictors' report as artifacts. The POLICY_DIR becomes a new version
of the registered model ``kvpilot`` (one version = one consistent set of
boosters, torch policy, feature schema and telemetry schema version).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

#: The seed of the default held-out workload; synthetic training workloads use small seeds (0, 1, ...).
HELDOUT_SEED = 90_001
#: The default held-out evaluation's KV size: small enough that vLLM default preempts.
HELDOUT_KV_FRACTION = 0.3
#: The default held-out evaluation's cost-model preset.
HELDOUT_PRESET = "H200-7B"
#: The settings of a held-out evaluation that follow where the policy was trained unless given: the engine
#: (:func:`logs_engine`) and the synthetic mix (:func:`logs_mix`); ``promote``: the version's training run.
ENGINE_FIELDS = ("preset", "kv_fraction", "offload_share", "offload_gib", "mix")
#: The decode stride of the held-out evaluations (``train``'s, the promotion gate's, the demo's). Finer than
#: ``evaluate``'s 32: held-out workloads are small (a step of 32 iterations is a larger share of a run), and on
#: tests/test_promote.py's tiny one stride 32 reverses the makespan order of its two learned policies.
HELDOUT_DECODE_STRIDE = 16
#: The training run's artifact that holds the held-out step's synthetic mix (``promote`` follows it).
HELDOUT_MIX_ARTIFACT = "heldout/mix.json"


class TrainError(ValueError):
    """Bad training input (missing logs, no decisions, an unreadable held-out workload), raised before fitting."""


@dataclass(frozen=True)
class PredictorParams:
    """The predictors' hyper-parameters (see ``kvpilot train predictors``)."""

    test_steps: tuple[int, ...] | None = None  # held-out RL steps; None: the last quarter
    horizon_s: float = 10.0
    num_trees: int = 100
    num_threads: int = 2


@dataclass(frozen=True)
class HeldoutParams:
    """The simulator evaluation after training: the trained policy vs vLLM default on a held-out workload."""

    workload: Path | None = None  # None: a fresh synthetic workload of ``mix`` (seed ``seed``, ``steps`` steps)
    seed: int = HELDOUT_SEED
    steps: int = 1
    prompts_per_step: int = 16  # of the default mix (``mix`` None)
    #: the synthetic mix (a data.synth.SynthConfig) of the held-out step, e.g. the logs' own; None: the default
    mix: Any = None
    kv_fraction: float | None = HELDOUT_KV_FRACTION  # None: the GPU's own KV capacity (the preset's)
    preset: str = HELDOUT_PRESET
    #: the CPU tier of the policies that use it: a share of the workload's KV need (the logs' memory pressure,
    #: whatever the workload's size), else GiB per replica; neither: simulate's default
    offload_share: float | None = None
    offload_gib: float | None = None
    #: run_simulation options of its simulations
    sim_options: dict[str, Any] = field(default_factory=lambda: {"decode_stride": HELDOUT_DECODE_STRIDE})
    #: the settings (:data:`ENGINE_FIELDS`) that follow where the policy was trained, in place of these: ``train``
    #: takes them from the logs (:func:`logs_engine`, :func:`logs_mix`), ``promote`` from the version's training
    follow: tuple[str, ...] = ENGINE_FIELDS

    def __post_init__(self) -> None:
        from simulator.cost_model import PRESETS

        if self.workload is not None and not Path(self.workload).exists():
            raise TrainError(f"no such held-out workload: {self.workload}")
        if self.kv_fraction is not None and not self.kv_fraction > 0:
            raise TrainError(f"held-out kv_fraction must be > 0 (or the GPU's capacity), got {self.kv_fraction}")
        if self.preset not in PRESETS:
            raise TrainError(f"unknown held-out preset {self.preset!r}; known presets: {', '.join(PRESETS)}")
        if self.offload_share is not None and not self.offload_share >= 0:
            raise TrainError(f"held-out offload_share must be >= 0, got {self.offload_share}")
        if self.offload_gib is not None:
            from simulator.config import SimulationError, check_offload_gib

            try:
                check_offload_gib(self.offload_gib)
            except SimulationError as e:
                raise TrainError(f"held-out {e}") from None

    def engine(self) -> str:
        """Its engine in words, e.g. ``H200-32B, KV 0.47, tier 0.49 of the need``."""
        kv = "gpu" if self.kv_fraction is None else f"{self.kv_fraction:g}"
        tier = (f", tier {self.offload_share:g} of the need" if self.offload_share is not None
                else f", tier {self.offload_gib:g} GiB" if self.offload_gib is not None else "")
        return f"{self.preset}, KV {kv}{tier}"

    def describe_workload(self) -> str:
        """The held-out workload in words."""
        if self.workload is not None:
            return str(self.workload)
        if self.mix is None:
            return f"a step of the default synthetic mix ({self.prompts_per_step} prompts, seed {self.seed})"
        return f"a fresh step of the logs' synthetic mix ({self.mix.prompts_per_step} prompts, seed {self.seed})"

    def run(self, workload: Path, policies: list[str], out_dir: Path, progress: bool):
        """Evaluate ``policies`` on ``workload`` in this engine (:func:`training.evaluate.evaluate`)."""
        from training.evaluate import Execution, evaluate
        from training.grid import Grid, evaluation_config

        opts = dict(self.sim_options)
        if self.offload_share is not None:
            from simulator.cost_model import CostModel
            from simulator.tokens import VLLM_BLOCK_SIZE
            from simulator.workload import load_workload

            block = CostModel.preset(self.preset).kv_block_bytes(VLLM_BLOCK_SIZE)
            opts["offload_gib"] = self.offload_share * load_workload(workload).kv_need * block / 2**30
        elif self.offload_gib is not None:
            opts["offload_gib"] = self.offload_gib
        grid = Grid(policies, evaluation_config(preset=self.preset, **opts), kv_fractions=[self.kv_fraction])
        return evaluate(workload, grid, out_dir, Execution(progress=progress))


def logs_engine(log_dirs: Sequence[Path], *, same_mix: bool = False) -> tuple[dict[str, Any], list[str]]:
    """The engine the logs were taken on, where every log's ``summary.json`` agrees: its preset, and its KV and CPU
    tier as shares of the logged workload's need (``kv_fraction``, ``offload_share``: the same memory pressure on a
    held-out workload of another size) or, with ``same_mix`` (the held-out step is of the logs' own mix), as they
    were set (the KV fraction given, else the GPU's capacity, as ``kv_fraction`` None; the tier in GiB); a note
    for each setting they do not give."""
    from simulator.cost_model import PRESETS, CostModel
    from simulator.tokens import VLLM_BLOCK_SIZE

    tier_key = "offload_gib" if same_mix else "offload_share"
    seen: dict[str, set] = {k: set() for k in ("preset", "kv_fraction", tier_key)}
    notes: list[str] = []
    for log in log_dirs:
        path = Path(log) / "summary.json"
        try:
            s = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}, [f"{path}: no readable summary, so the logs' engine is unknown"]
        preset = s.get("preset")
        seen["preset"].add(preset if preset in PRESETS else None)
        if same_mix and not s.get("kv_fraction") and preset in PRESETS and \
                s.get("kv_blocks") == CostModel.preset(preset).max_kv_blocks(VLLM_BLOCK_SIZE):
            seen["kv_fraction"].add(_GPU)  # the GPU's capacity: the same engine on the same mix
        else:
            kv = s.get("kv_fraction") or s.get("kv_share_of_need")  # (a fraction given is exact; blocks rounded)
            seen["kv_fraction"].add(float(f"{kv:.4g}") if kv else None)
        tier = s.get("offload_gib" if same_mix else "offload_share_of_need") if s.get("offload_blocks") else 0.0
        seen[tier_key].add(float(f"{tier:.4g}") if tier is not None else None)
    out: dict[str, Any] = {}
    for k, values in seen.items():
        if len(values) != 1:
            notes.append(f"the logs differ in {k} ({', '.join(sorted(map(str, values)))})")
        elif (v := next(iter(values))) is None:
            notes.append(f"the logs do not say their {k}")
        elif k != tier_key or v > 0:  # (no tier in the logs: the held-out's tier is left as it is)
            out[k] = None if v is _GPU else v
    if same_mix and "offload_gib" in out:
        out["offload_share"] = None  # a size in GiB, not the default's share
    return out, notes


_GPU = "gpu"  # logs_engine: a KV size that is the GPU's capacity


def logs_mix(log_dirs: Sequence[Path]) -> tuple[Any, list[str]]:
    """The synthetic mix (a :class:`data.synth.SynthConfig`, its seed and steps aside) that every log's workload
    (``LOG/workload.parquet``, which ``simulate`` writes) was generated from, and a note where there is none:
    a held-out step of that mix has the logs' sessions, tools and context sizes."""
    import pyarrow.parquet as pq

    from data.io import source_of
    from data.synth import SynthConfig

    mixes = []
    for log in log_dirs:
        path = Path(log) / "workload.parquet"
        try:
            source = source_of(pq.read_schema(path).empty_table()) if path.is_file() else None
        except (OSError, ValueError) as err:
            return None, [f"{path}: unreadable ({err}), so the logs' mix is unknown"]
        if not source or source.get("generator") != "kvpilot workload synth":
            return None, [f"{log}: no synthesized workload beside the logs, so the held-out step is the default mix"]
        try:
            cfg = SynthConfig.from_dict(source.get("config"))
        except ValueError as err:
            return None, [f"{path}: its recorded synth config does not load ({err}); the held-out step is the "
                          "default mix"]
        mixes.append(dataclasses.replace(cfg, seed=0, steps=1))
    if not mixes:
        return None, []
    if any(m != mixes[0] for m in mixes[1:]):
        return None, ["the logs' workloads are of different synthetic mixes, so the held-out step is the default mix"]
    return mixes[0], []


@dataclass
class TrainResult:
    run_id: str
    version: str
    policy_dir: Path
    metrics: dict[str, float]
    evaluation: list[dict[str, Any]]
    tracking_uri: str
    #: how each part held data out: {"predictors": "step" | "group", "policy": "log" | "time" | "group"}
    split: dict[str, str] = field(default_factory=dict)


def heldout_workload(params: HeldoutParams, out_dir: Path) -> Path:
    """The held-out workload file: ``params.workload``, or a synthetic one generated into ``out_dir``."""
    if params.workload is not None:
        return Path(params.workload)
    from data.io import write_workload
    from data.synth import SynthConfig, generate

    path = out_dir / f"heldout-seed{params.seed}.parquet"
    cfg = (dataclasses.replace(params.mix, seed=params.seed, steps=params.steps) if params.mix is not None else
           SynthConfig(seed=params.seed, steps=params.steps, prompts_per_step=params.prompts_per_step))
    write_workload(generate(cfg), path)
    return path


def data_summary(log_dirs: Sequence[Path]) -> dict[str, Any]:
    """Row counts of every telemetry table and the simulated/served time range, over all logs."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    from data.io import read_telemetry
    from data.schemas import TELEMETRY_TABLES
    from predictors.logs import telemetry_dir

    out: dict[str, Any] = {f"data.{t}_rows": 0 for t in TELEMETRY_TABLES}
    starts, ends, rl_steps = [], [], set()
    for log in log_dirs:
        tdir = telemetry_dir(Path(log))
        if tdir is None:
            raise TrainError(f"{log}: no telemetry (expected {log}/telemetry/requests or {log}/requests)")
        for table in TELEMETRY_TABLES:
            if (tdir / table).is_dir():
                out[f"data.{table}_rows"] += ds.dataset(tdir / table, format="parquet").count_rows()
        steps = read_telemetry(tdir, "steps", ["time_s", "duration_s"])
        if steps.num_rows:
            starts.append(pc.min(steps["time_s"]).as_py())
            ends.append(pc.max(pc.add(steps["time_s"], steps["duration_s"])).as_py())
        rl_steps.update(s for s in read_telemetry(tdir, "requests", ["step"])["step"].to_pylist() if s is not None)
    out["data.logs"] = len(log_dirs)
    out["data.time_start_s"] = min(starts, default=0.0)
    out["data.time_end_s"] = max(ends, default=0.0)
    out["data.rl_steps"] = len(rl_steps)
    return out


def flat_metrics(report: dict[str, Any], prefix: str) -> dict[str, float]:
    """The numeric leaves of a nested report as ``prefix.a.b`` keys (lists are left out)."""
    out: dict[str, float] = {}
    for key, value in report.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            out.update(flat_metrics(value, name))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def _stage(console: Console, text: str) -> None:
    console.rule(f"[bold]{text}")


def train_and_register(
    log_dirs: Sequence[Path],
    work_dir: Path,
    *,
    experiment: str = "kvpilot",
    predictor_params: PredictorParams | None = None,
    policy_config: Any = None,
    heldout: HeldoutParams | None = None,
    search: Any = None,
    tier: Any = None,
    progress: bool = True,
    console: Console | None = None,
) -> TrainResult:
    """Fit, evaluate, log and register (see the module docstring); ``work_dir`` keeps the POLICY_DIR and the evaluation.

    ``policy_config`` is a :class:`policy.learning.config.OfflineConfig`; None (here and for the other parameter
    objects): the defaults. ``heldout.follow``: the held-out settings (:data:`ENGINE_FIELDS`) taken from the
    logs where they all agree (:func:`logs_engine`, :func:`logs_mix`), in place of ``heldout``'s. ``search``: a
    :class:`training.policy_search.SearchConfig` that chooses the admission order (and with iterations learns the
    admission residual) by simulating the logged workloads (None: the defaults, the order chosen, no CEM; skipped
    with a note where the logs cannot be replayed and no iterations were asked for). ``tier``: the
    :class:`training.tier_training.TierConfig` that fits
    the CPU tier's next-use model on replays of the logged workloads (:mod:`training.tier_training`; skipped with
    a note where the logs cannot be replayed or the bundle has no tier; ``rounds=0``: no tier model).
    One training at a time per ``work_dir`` (:class:`TrainError` for a second)."""
    from predictors.logs import existing_logs

    console = console or Console(stderr=True)
    try:
        log_dirs = existing_logs(log_dirs)
    except FileNotFoundError as err:
        raise TrainError(str(err)) from None
    if not log_dirs:
        raise TrainError("no logs given (--logs DIR, repeatable)")
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    with _only_user(work_dir), replacing(work_dir / "policy", console):
        return _train(log_dirs, work_dir, experiment, predictor_params, policy_config, heldout, search, tier,
                      progress, console)


@contextlib.contextmanager
def replacing(policy_dir: Path, console: Console) -> Iterator[None]:
    """Write a new POLICY_DIR at ``policy_dir``; an earlier one there is replaced only when the block succeeds.

    The earlier one waits beside it (``<name>.earlier``) and comes back if the block fails; a training killed
    mid-run leaves it there, and the next training takes it as the earlier one (its partial output goes)."""
    earlier = policy_dir.with_name(policy_dir.name + ".earlier")
    if earlier.exists():
        shutil.rmtree(policy_dir, ignore_errors=True)
    elif policy_dir.exists():
        policy_dir.rename(earlier)
    try:
        yield
    except BaseException:
        if earlier.exists():
            shutil.rmtree(policy_dir, ignore_errors=True)
            earlier.rename(policy_dir)
        raise
    if earlier.exists():
        shutil.rmtree(earlier)
        console.print(f"replaced the earlier policy in {policy_dir} (a version registered from it keeps its own "
                      "copy)", highlight=False)


@contextlib.contextmanager
def _only_user(work_dir: Path) -> Iterator[None]:
    """Hold ``work_dir`` for one training: a second one into it would delete this one's POLICY_DIR mid-run."""
    with open(work_dir / ".kvpilot-train.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TrainError(f"{work_dir} is in use by another `kvpilot train`; give this one another -o") from None
        yield


def _train(log_dirs: list[Path], work_dir: Path, experiment: str, predictor_params: Any, policy_config: Any,
           heldout: Any, search: Any, tier: Any, progress: bool,
           console: Console) -> TrainResult:
    import mlflow

    from predictors.logs import load_logs
    from predictors.pipeline import render_report, train_bundle
    from training import registry

    policy_dir = work_dir / "policy"
    from policy.learned.bundle import read_manifest
    from policy.learning.config import OfflineConfig
    from policy.learning.offline import SPLITS, train_policy

    policy_config = policy_config or OfflineConfig()
    predictor_params = predictor_params or PredictorParams()
    heldout = heldout or HeldoutParams()
    follow_logs = heldout.follow
    mix, notes = logs_mix(log_dirs) if "mix" in follow_logs and heldout.workload is None else (None, [])
    engine, engine_notes = logs_engine(log_dirs, same_mix=mix is not None) if follow_logs else ({}, [])
    engine, notes = {**engine, **({"mix": mix} if mix is not None else {})}, engine_notes + notes
    taken = {k: v for k, v in engine.items() if k in follow_logs}
    heldout = dataclasses.replace(heldout, **taken)

    from training.policy_search import SearchConfig, SearchError, replays

    search = search or SearchConfig()
    if search.active:  # the logs' workloads must be replayable: checked before anything is fitted
        try:
            replays(log_dirs, search.engine_preset)
        except SearchError as err:
            if search.iterations:  # asked for: an error; the default order choice: skipped with a note
                raise TrainError(f"policy search: {err}") from None
            console.print(f"admission order, levers and width: not chosen ({err}); the prior's shortest-first "
                          "order, the levers as trained, no width", highlight=False)
            search = dataclasses.replace(search, orders=(), levers_off=False, width=False)
    _stage(console, f"1/4 data: {len(log_dirs)} log folder(s)")
    console.print(f"held-out evaluation on {heldout.engine()}"
                  + (f" ({', '.join(k for k, v in taken.items() if v is not None or k == 'kv_fraction')} as the "
                     "logs')" if taken else "")
                  + f"; workload: {heldout.describe_workload()}"
                  + "".join(f"; {n}" for n in notes), highlight=False, soft_wrap=True)
    data = data_summary(log_dirs)
    if not data["data.decisions_rows"]:
        raise TrainError(f"no decisions telemetry in {', '.join(map(str, log_dirs))}: simulate or serve with an "
                         "exploring policy (e.g. --policy logging) to log decisions with propensities")
    frame = load_logs(log_dirs)
    console.print(", ".join(f"{k.removeprefix('data.')} {v:,.6g}" for k, v in data.items()), highlight=False)

    registry.configure(experiment)
    with mlflow.start_run() as run:
        mlflow.log_params({**data, **_params("predictors", dataclasses.asdict(predictor_params)),
                           **_params("policy", dataclasses.asdict(policy_config)),
                           **_params("heldout", {**dataclasses.asdict(heldout), "mix": heldout.mix is not None}),
                           "log_dirs": ",".join(str(p) for p in log_dirs)})
        if heldout.mix is not None:  # (too long for a param) what promote's gate follows
            mlflow.log_dict(dataclasses.asdict(heldout.mix), HELDOUT_MIX_ARTIFACT)

        _stage(console, "2/4 predictors: LightGBM length and reuse models")
        try:
            # no session models: no decision of the learned policy reads them (`train predictors` still fits them)
            bundle = train_bundle(frame, test_steps=predictor_params.test_steps,
                                  horizon_s=predictor_params.horizon_s, num_trees=predictor_params.num_trees,
                                  num_threads=predictor_params.num_threads, session=False)
        except ValueError as err:  # too few steps or rows to split and fit
            raise TrainError(f"predictors: {err}") from None
        split = {"predictors": bundle.report["split"]}
        with tempfile.TemporaryDirectory(prefix="kvpilot-predictors-") as tmp:
            predictors_dir = bundle.save(Path(tmp) / "predictors")
            console.print(render_report(bundle.report), highlight=False, soft_wrap=True)  # its first line: the split
            metrics = flat_metrics({k: v for k, v in bundle.report.items() if k in ("length", "reuse")},
                                   "predictors")

            _stage(console, "3/4 policy: offline contextual bandit from logged decisions")
            try:
                policy_metrics = train_policy(log_dirs, predictors_dir, policy_dir, policy_config, progress=progress)
            except ValueError as err:  # no usable decisions, a bad log
                raise TrainError(f"policy: {err}") from None
        metrics.update({k: float(v) for k, v in policy_metrics.items()})
        if search.active:
            metrics.update(_search(policy_dir, log_dirs, search, console))
        if tier is None or tier.rounds:
            metrics.update(_tier(policy_dir, log_dirs, tier, console, served=search.engine_preset is not None))
        split["policy"] = read_manifest(policy_dir)["trained_on"]["split"]
        mlflow.log_params({f"{part}.split": how for part, how in split.items()})
        console.print(f"policy: held out by {SPLITS[split['policy']]}", highlight=False)
        console.print("  ".join(f"{k} {v:.4g}" for k, v in policy_metrics.items()), highlight=False, soft_wrap=True)

        _stage(console, "4/4 held-out simulation: the trained policy vs its prior and vLLM default")
        rows = evaluate_policy_dir(policy_dir, heldout, work_dir / "heldout", progress=progress)
        metrics.update(heldout_metrics(rows))
        mlflow.log_metrics(metrics)
        for path in sorted((work_dir / "heldout" / "evaluation").iterdir()):
            if path.is_file():  # the tables and plots; not runs/ (each case's telemetry)
                mlflow.log_artifact(str(path), artifact_path="heldout")
        mlflow.log_dict(bundle.report, "predictors/report.json")
        mlflow.log_artifact(str(policy_dir / "policy.json"), artifact_path="policy")
        version = registry.log_policy_model(policy_dir).version
    console.print(f"registered [bold]{registry.MODEL_NAME}[/] version {version} (run {run.info.run_id})")
    return TrainResult(run.info.run_id, str(version), policy_dir, metrics, rows, mlflow.get_tracking_uri(), split)


def _search(policy_dir: Path, log_dirs: Sequence[Path], cfg: Any, console: Console) -> dict[str, float]:
    """Choose POLICY_DIR's admission order (and learn its admission residual) by simulating the logged workloads
    (:mod:`training.policy_search`), write them into the bundle's runtime options, log the samples; the search's
    metrics."""
    import mlflow

    from policy.learned.bundle import update_runtime
    from training.policy_search import search_admission

    parts = ["the admission order", *(["the trained levers"] if cfg.levers_off else []),
             *(["the width"] if cfg.width else []),
             *(["the residual"] if cfg.iterations else [])]
    what = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
    _stage(console, f"3b/4 policy search: {what} by "
                    f"simulating {len(log_dirs)} logged workload(s)")
    found = search_admission(policy_dir, log_dirs, cfg, progress=lambda m: console.print(m, highlight=False))
    update_runtime(policy_dir, found.runtime())
    mlflow.log_dict({"residual": found.residual, "samples": found.history}, "policy/search.json")
    console.print(f"levers: {found.levers}; admission residual {found.residual or '{} (the prior order)'}:"
                  f" {found.ratio:.4f}x the bundle's makespan with the prior order on the logged workloads",
                  highlight=False)
    return found.metrics()


def _tier(policy_dir: Path, log_dirs: Sequence[Path], cfg: Any, console: Console,
          served: bool = False) -> dict[str, float]:
    """Fit POLICY_DIR's CPU-tier next-use model on replays of the logged workloads (:mod:`training.tier_training`),
    log its rounds; its metrics. Logs that cannot be replayed (serving logs with no workload beside them), a
    server's logs (``served``: their fitted engine has no tier) or a bundle with no tier skip it with a note."""
    import mlflow

    from training.tier_training import TierTrainingError, train_tier

    _stage(console, f"3c/4 CPU tier: the next-use model on replays of {len(log_dirs)} logged workload(s)")
    if served and not all((Path(log) / "summary.json").is_file() for log in log_dirs):
        console.print("tier: skipped (a server's logs replay on its fitted engine, which has no CPU tier); the "
                      "session-state rule orders the tier", highlight=False)
        return {}
    try:
        found = train_tier(policy_dir, log_dirs, cfg, progress=lambda m: console.print(m, highlight=False))
    except TierTrainingError as err:
        console.print(f"tier: skipped ({err}); the session-state rule orders the tier", highlight=False)
        return {}
    mlflow.log_dict({"kept": found.kept, "rounds": found.history}, "policy/tier.json")
    return found.metrics()


def _params(prefix: str, values: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}.{k}": json.dumps(v, default=str) if isinstance(v, (dict, list, tuple)) else v
            for k, v in values.items()}


#: The evaluation's name for the trained policy.
CANDIDATE = "kvpilot-candidate"
#: The evaluation's name for the trained policy's prior (the same bundle with no trained network).
CANDIDATE_PRIOR = "kvpilot-candidate-prior"


def register_policy_dir(name: str, policy_dir: Path, as_policy: str = "learned") -> None:
    """Make ``policy_dir`` simulatable under the policy name ``name`` in this process (a learned policy, serving;
    ``as_policy`` ``"learned-prior"``: its prior)."""
    from policy.catalog import create_policy, register

    register(name, lambda: create_policy(as_policy, model=str(policy_dir)), replace=True)


def evaluate_policy_dir(policy_dir: Path, heldout: HeldoutParams, out_dir: Path, *,
                        progress: bool = True) -> list[dict[str, Any]]:
    """Simulate the POLICY_DIR, its prior (``learned-prior``) and vLLM default on the held-out workload; the
    evaluation's rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = heldout_workload(heldout, out_dir)
    register_policy_dir(CANDIDATE, policy_dir)
    register_policy_dir(CANDIDATE_PRIOR, policy_dir, "learned-prior")
    result = heldout.run(workload, [CANDIDATE_PRIOR, CANDIDATE], out_dir / "evaluation", progress)
    failed = [r for r in result.rows if r.get("error")]
    if failed:
        raise TrainError("held-out simulation failed: " + "; ".join(f"{r['policy']}: {r['error']}" for r in failed))
    return result.rows


def heldout_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The candidate's held-out simulator metrics and its ratios to vLLM default (``heldout.*``)."""
    out: dict[str, float] = {}
    names = {CANDIDATE: "candidate", CANDIDATE_PRIOR: "prior"}
    prior = next((r for r in rows if r["policy"] == CANDIDATE_PRIOR), None)
    for row in rows:
        who = names.get(row["policy"], row["policy"])
        for key in ("makespan_s", "recomputed_tokens", "prefix_hit_rate", "preemptions", "trajectory_p99_s"):
            if row.get(key) is not None:
                out[f"heldout.{who}.{key}"] = float(row[key])
        if row["policy"] == CANDIDATE:
            for key in ("makespan_ratio_vs_default", "recompute_ratio_vs_default", "hit_rate_ratio_vs_default"):
                if row.get(key) is not None:
                    out[f"heldout.{key}"] = float(row[key])
            if prior is not None and prior.get("makespan_s"):
                out["heldout.makespan_ratio_vs_prior"] = float(row["makespan_s"]) / float(prior["makespan_s"])
    return out
