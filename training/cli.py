"""The ``kvpilot`` command line.

Heavy imports (vLLM, torch, LightGBM, MLflow) happen inside the commands that
need them, so ``kvpilot workload ...`` starts in well under a second.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

from data.errors import DataValidationError
from simulator.config import DEFAULT_OFFLOAD_GIB, SimConfig
from simulator.summary import RunSummary, render_summary
from training import policy_cli, predictors_cli
from training.cli_errors import fail, reported
from training.grid import DEFAULT_DECODE_STRIDE
from training.train import HELDOUT_KV_FRACTION, HELDOUT_PRESET, HELDOUT_SEED

if TYPE_CHECKING:
    from training.evaluate import Execution
    from training.grid import Grid

#: Every command group is made here; a command is mounted on its group with ``group.command(name)``: as a
#: decorator for the commands of this module, on the command functions of the sub-CLI modules at the end.
app = typer.Typer(
    help="kvpilot: a learned, KV-cache-aware scheduler for vLLM rollout servers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
workload_app = typer.Typer(help="Generate, import, validate and describe workloads.", no_args_is_help=True)
#: ``kvpilot train --logs ...`` trains everything (the group's own callback); ``train predictors`` and ``train
#: policy`` train one part.
train_app = typer.Typer(help="Train kvpilot's models: with --logs, predictors and policy into one MLflow run; or one "
                        "part with a subcommand.", no_args_is_help=True, invoke_without_command=True,
                        pretty_exceptions_enable=False)
predictors_app = typer.Typer(help="Inspect and evaluate trained predictors.", no_args_is_help=True,
                             pretty_exceptions_enable=False)
app.add_typer(workload_app, name="workload")
app.add_typer(train_app, name="train")
app.add_typer(predictors_app, name="predictors")

console = Console(stderr=True)

#: What reading a user's input file raises (:class:`DataValidationError` located in the file; a missing one).
_INPUT_ERRORS = (DataValidationError, ValueError, OSError)


class ImportFormat(str, Enum):
    """Trace formats that `kvpilot workload import` understands."""

    mooncake = "mooncake"
    polytrace_multiturn = "polytrace-multiturn"
    polytrace_lengths = "polytrace-lengths"


@workload_app.command("synth")
def workload_synth(
    out: Annotated[Path, typer.Option("-o", "--out", help="Output Parquet file.")],
    config: Annotated[Optional[Path], typer.Option(
        "--config", help="TOML config over the preset; keys it leaves out keep the preset's values.")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Override the config's seed.")] = None,
    preset: Annotated[str, typer.Option(
        "--preset", help="Named workload: default (the mixed RL mix), short (the mix before the swe domain) "
        "or agentic (long-horizon agents).")] = "default",
) -> None:
    """Generate a seeded synthetic mixed-domain RL workload."""
    from data.io import write_workload
    from data.synth import SynthConfig, generate

    with reported(*_INPUT_ERRORS):
        base = SynthConfig.preset(preset)
        cfg = SynthConfig.from_file(config, base) if config else base
        if seed is not None:
            cfg = dataclasses.replace(cfg, seed=seed)
        t0 = time.perf_counter()
        table = generate(cfg)
        write_workload(table, out)
    console.print(f"wrote {table.num_rows:,} requests to {out} in {time.perf_counter() - t0:.2f} s")


@workload_app.command("import")
def workload_import(
    inputs: Annotated[list[Path], typer.Argument(help="Trace files (JSONL).")],
    fmt: Annotated[ImportFormat, typer.Option("--format", help="Input format.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output Parquet file.")],
    skip_bad: Annotated[bool, typer.Option("--skip-bad", help="Skip malformed lines, then report them.")] = False,
) -> None:
    """Import a public trace into kvpilot's workload format, keeping its prefix structure."""
    from data import importers
    from data.io import with_source, write_workload

    readers = {
        ImportFormat.mooncake: importers.import_mooncake,
        ImportFormat.polytrace_multiturn: importers.import_polytrace_multiturn,
        ImportFormat.polytrace_lengths: importers.import_polytrace_lengths,
    }
    with reported(*_INPUT_ERRORS):  # a missing trace file is a FileNotFoundError naming each
        result = readers[fmt](inputs, skip_bad=skip_bad)
    for file, line, reason in result.skipped[:20]:
        console.print(f"[yellow]skipped[/] {file}:{line}: {reason}", highlight=False)
    if result.skipped:
        console.print(f"[yellow]skipped {len(result.skipped)} bad line(s) in all[/]")
    if result.table.num_rows == 0:  # nothing a simulation could run: say so here, not at the next command
        raise fail(f"{', '.join(str(p) for p in inputs)}: no request to import"
                   + (" (every line was skipped)" if result.skipped else "") + f"; {out} not written")
    with reported(*_INPUT_ERRORS):
        source = {"generator": "kvpilot workload import", "format": fmt.value, "files": [p.name for p in inputs]}
        write_workload(with_source(result.table, source), out)
    if result.repaired:
        first_file, first_line, first_reason = result.repaired[0]
        console.print(
            f"repaired {len(result.repaired)} inconsistent value(s) in the trace, "
            f"e.g. {first_file}:{first_line}: {first_reason}",
            highlight=False,
        )
    console.print(f"wrote {result.table.num_rows:,} requests to {out}")


@workload_app.command("stats")
def workload_stats(
    path: Annotated[Path, typer.Argument(help="Workload Parquet file or directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Describe a workload: counts, token percentiles per domain, and prefix sharing."""
    from data.io import read_workload
    from data.stats import render_stats
    from data.stats import workload_stats as compute

    with reported(*_INPUT_ERRORS):
        stats = compute(read_workload(path))
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
    else:
        typer.echo(render_stats(stats))


@workload_app.command("validate")
def workload_validate(path: Annotated[Path, typer.Argument(help="Workload Parquet file or directory.")]) -> None:
    """Check a workload against the schema and its structural rules."""
    from data.io import read_workload

    with reported(*_INPUT_ERRORS):
        table = read_workload(path)
    console.print(f"{path}: valid, {table.num_rows:,} requests")


#: Options that several commands share.
WorkloadOpt = Annotated[Path, typer.Option("--workload", "-w", help="Workload Parquet file or directory.")]
AsJsonOpt = Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object.")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")]
KvBlocks = Annotated[Optional[int], typer.Option("--kv-blocks", help="KV blocks (16 tokens) per replica.")]
KvFraction = Annotated[Optional[float], typer.Option(
    "--kv-fraction", help="KV per replica as a fraction of what the largest step needs at once.")]
Replicas = Annotated[int, typer.Option("--replicas", help="Number of replicas.")]
Preset = Annotated[str, typer.Option("--preset", help="Cost-model preset <GPU>-<model>, or a preset file that "
                                     "`kvpilot calibrate` fitted to an engine (PRESET.toml).")]
TimeScale = Annotated[float, typer.Option(
    "--time-scale", help="Factor on the workload's tool and verifier latencies (0: no waits); `replay` and "
    "`simulate` of one workload at one scale describe the same run.")]
OffloadGib = Annotated[float, typer.Option(
    "--offload-gib", help="Host memory (GiB) per replica of the CPU offload tier (vLLM's native KV offloading), "
    "for policies that use it (vllm-offload, *-offload); 0 turns the tier off. Default: a quarter of a DGX "
    "H200's host memory per GPU.")]


DriverOpt = Annotated[str, typer.Option(
    "--driver", help="sync (synchronous RL steps) or async (no step barrier: a trainer consumes batches of finished "
    "groups under a staleness bound; runs the synchronous baseline with the same trainer beside it).")]
#: ``--staleness`` and ``--weight-sync`` of an async run that names neither.
DEFAULT_STALENESS, DEFAULT_WEIGHT_SYNC = "1", "keep"
StalenessOpt = Annotated[Optional[str], typer.Option(
    "--staleness", help="--driver async: staleness bound(s) eta, comma-separated integers >= 0 (e.g. 1,2,4); "
    "default 1.")]
WeightSyncOpt = Annotated[Optional[str], typer.Option(
    "--weight-sync", help="--driver async: weight-update mode(s), comma-separated: abort, recompute (keep + clear), "
    "keep (version-salted cache, no reset); default keep.")]
TrainBatchOpt = Annotated[Optional[int], typer.Option(
    "--train-batch", help="GRPO groups per training step (default: the workload's groups per RL step).")]
TrainerOpt = Annotated[bool, typer.Option(
    "--trainer", help="--driver sync: price a training step and a weight update after each RL step (as --driver "
    "async does), so that both drivers do the same work.")]
AdmissionOpt = Annotated[str, typer.Option(
    "--admission", help="--driver async: staleness (AReaL's capacity rule, FCFS), kv-pressure (prime-rl's KV "
    "controller inside the staleness rule), working-set (kvpilot's: groups in flight while their predicted "
    "working set fits in GPU KV plus the host tier, inside the staleness rule) or auto: working-set for the "
    "learned policy (its logged prior of session contexts), else staleness.")]
MaxGroupsOpt = Annotated[Optional[int], typer.Option(
    "--max-groups", min=1, help="--driver async: at most this many GRPO groups in flight, under the --admission rule "
    "(default: no cap beyond it). Where memory binds it decides throughput: "
    "docs/results/2026-12-05-async-32b-twelve-batches.md.")]


TrainerPresetOpt = Annotated[Optional[str], typer.Option(
    "--trainer-preset", help="The roofline preset (e.g. H200-7B) that prices the trainer; default: the run's "
    "--preset (replay: H200-7B). Needed where --preset is a fitted engine's (kvpilot calibrate's).")]


def _trainer_spec(driver: str, trainer: bool, train_batch: Optional[int], preset: Optional[str] = None):
    """The run's Trainer (None: a synchronous run without one); bad settings exit 2."""
    from simulator.config import DRIVERS, SimulationError, Trainer, check_choice

    with reported(SimulationError):
        check_choice("driver", driver, DRIVERS)
        if driver == "sync" and not trainer:
            for flag, given in (("--train-batch", train_batch), ("--trainer-preset", preset)):
                if given is not None:
                    raise fail(f"{flag} needs --trainer or --driver async")
            return None
        return Trainer(train_batch=train_batch, preset=preset)


def _check_async_only(driver: str, max_groups: Optional[int], admission: str, staleness: Optional[str],
                      weight_sync: Optional[str]) -> tuple[str, str]:
    """``--max-groups``, ``--admission``, ``--staleness`` and ``--weight-sync`` set the async driver's rollout: with
    another driver they are an error (exit 2). The staleness bounds and weight-update modes to run."""
    if driver != "async":
        for flag, given in (("--max-groups", max_groups is not None), ("--staleness", staleness is not None),
                            ("--weight-sync", weight_sync is not None), ("--admission", admission != "auto")):
            if given:
                raise fail(f"{flag} needs --driver async")
    return (DEFAULT_STALENESS if staleness is None else staleness,
            DEFAULT_WEIGHT_SYNC if weight_sync is None else weight_sync)


def _async_runs(staleness: str, weight_sync: str, admission: str, max_groups: Optional[int]) -> list:
    """The asynchronous runs of ``--staleness`` x ``--weight-sync`` (each value once), as
    :class:`simulator.config.AsyncRL` settings checked before any run (exit 2)."""
    from simulator.config import AsyncRL, SimulationError

    etas = list(dict.fromkeys(_number_list(staleness, int, "--staleness")))  # each once (a run per value)
    modes = list(dict.fromkeys(m.strip() for m in weight_sync.split(",") if m.strip()))
    if not modes:
        raise fail("--weight-sync is empty")
    with reported(SimulationError):
        return [AsyncRL(e, m, admission, max_groups) for e in etas for m in modes]


def _async_sweep(workload: Path, out_dir: Path, bases: list, runs: list, progress: bool, as_json: bool) -> None:
    """``--driver async``: the synchronous run and every asynchronous one (``runs``) of each base run."""
    from simulator.config import SimulationError
    from simulator.workload import load_workload
    from training.async_sweep import sweep_grid, write_sweep

    with reported(*_INPUT_ERRORS):  # SimulationError is a ValueError
        prepared = load_workload(workload)
    with reported(SimulationError):  # a bad run: before any runs
        rows = sweep_grid(prepared, bases, runs, out_dir, progress)
    write_sweep(rows, out_dir)
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
    else:
        shown = ("policy", "kv_fraction", "replicas", "run", "async_admission", "trajectories_per_s", "ratio_vs_sync",
                 "throughput_over_bound", "gap_closed", "max_staleness", "reprefill_tokens_per_update")
        typer.echo("  ".join(f"{c:>14}" for c in shown))
        for r in rows:
            typer.echo("  ".join(f"{(f'{v:.4g}' if isinstance(v, float) else '-' if v is None else str(v)):>14}"
                                 for v in (r.get(c) for c in shown)))
    console.print(f"async_summary.md, async_summary.json and throughput_vs_staleness.png in {out_dir}",
                  highlight=False)


OutDirOpt = Annotated[Path, typer.Option("-o", "--out-dir", help="Where telemetry and summary.json go.")]
PolicyOpt = Annotated[str, typer.Option("--policy", "-p", help="Policy registry name.")]
PolicyOptionsOpt = Annotated[
    Optional[str], typer.Option("--policy-options", help="JSON object of keyword options for the policy.")
]
RouterOpt = Annotated[
    str, typer.Option("--router", help="round-robin, least-loaded, cache-aware, kv-aware, session-affinity, "
                      "fewest-sessions or kvpilot (several replicas).")
]
MaxNumSeqsOpt = Annotated[Optional[int], typer.Option(
    "--max-num-seqs", help="vLLM max_num_seqs (default: a fitted preset's engine's, else 256).")]
MaxNumBatchedTokensOpt = Annotated[Optional[int], typer.Option(
    "--max-num-batched-tokens", help="vLLM max_num_batched_tokens, chunked prefill (default: a fitted "
    "preset's engine's, else 8192).")]
DecodeStrideOpt = Annotated[
    int, typer.Option("--decode-stride", help="Tokens each request decodes per simulated step (1: exact; "
                      "k > 1: k times fewer scheduler calls, approximate).")
]
KeepCacheOpt = Annotated[bool, typer.Option(
    "--keep-cache-across-steps", help="Keep each replica's prefix cache across RL steps (default: reset it at "
    "every step, as RL frameworks do at weight sync).")]
SessionIdsOpt = Annotated[bool, typer.Option(
    "--session-ids/--no-session-ids", help="Send each request's session id, turn and tool (kvpilot_* keys); "
    "--no-session-ids sends none, as verl and AReaL do, and the hook infers sessions from the block-hash "
    "chain.")]


@app.command("simulate")
def simulate(
    workload: WorkloadOpt,
    out_dir: OutDirOpt,
    policy: PolicyOpt = "vllm-default",
    policy_options: PolicyOptionsOpt = None,
    replicas: Replicas = 1,
    router: RouterOpt = "round-robin",
    kv_blocks: KvBlocks = None,
    kv_fraction: KvFraction = None,
    preset: Preset = "H200-7B",
    max_num_seqs: MaxNumSeqsOpt = None,
    max_num_batched_tokens: MaxNumBatchedTokensOpt = None,
    time_scale: TimeScale = 1.0,
    decode_stride: DecodeStrideOpt = 1,
    as_json: AsJsonOpt = False,
    progress: ProgressOpt = True,
    keep_cache: KeepCacheOpt = False,
    offload_gib: OffloadGib = DEFAULT_OFFLOAD_GIB,
    session_ids: SessionIdsOpt = True,
    driver: DriverOpt = "sync",
    staleness: StalenessOpt = None,
    weight_sync: WeightSyncOpt = None,
    train_batch: TrainBatchOpt = None,
    trainer_preset: TrainerPresetOpt = None,
    trainer: TrainerOpt = False,
    admission: AdmissionOpt = "auto",
    max_groups: MaxGroupsOpt = None,
) -> None:
    """Simulate a workload on vLLM's real scheduler (CPU) with a policy, and summarise the run."""
    from simulator.config import SimulationError

    trainer_spec = _trainer_spec(driver, trainer, train_batch, trainer_preset)
    staleness, weight_sync = _check_async_only(driver, max_groups, admission, staleness, weight_sync)
    with reported(SimulationError):  # every setting of the run, checked once, before anything runs
        config = SimConfig(policy, policy_options=_policy_options(policy_options), replicas=replicas, router=router,
                           kv_blocks=kv_blocks, kv_fraction=kv_fraction, preset=preset, out_dir=out_dir,
                           progress=progress, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, session_ids=session_ids,
                           decode_stride=decode_stride, keep_cache_across_steps=keep_cache, offload_gib=offload_gib,
                           trainer=trainer_spec, time_scale=time_scale)
    if driver == "async":
        _async_sweep(workload, out_dir, [config], _async_runs(staleness, weight_sync, admission, max_groups),
                     progress, as_json)
        return
    summary = _simulate(workload, config)
    if as_json:
        typer.echo(json.dumps(summary.to_dict(), indent=2))
    else:
        typer.echo(render_summary(summary))
    console.print(f"telemetry and summary.json in {out_dir}", highlight=False)


@app.command("bound")
def bound(
    workload: WorkloadOpt,
    kv_blocks: KvBlocks = None,
    kv_fraction: KvFraction = None,
    replicas: Replicas = 1,
    preset: Preset = "H200-7B",
    decode_stride: Annotated[
        int, typer.Option("--decode-stride", help="The simulator's decode stride the bound is for (1: exact).")
    ] = 1,
    time_scale: TimeScale = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the bound as one JSON object.")] = False,
) -> None:
    """A lower bound of each RL step's makespan that no schedule beats under the same cost model."""
    from simulator.bound import render_bound, workload_bound
    from simulator.workload import load_workload

    with reported(*_INPUT_ERRORS):
        if not (math.isfinite(time_scale) and time_scale >= 0):
            raise ValueError(f"--time-scale must be a number >= 0, got {time_scale}")
        table = load_workload(workload).time_scaled(time_scale)
        result = workload_bound(table, preset=preset, kv_blocks=kv_blocks, kv_fraction=kv_fraction,
                                replicas=replicas, decode_stride=decode_stride)
    typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else render_bound(result))


def _simulate(workload: Path, config: SimConfig) -> RunSummary:
    """Read and check the workload, then simulate it as ``config`` says;
    user errors exit with status 2 before anything runs."""
    from simulator.workload import load_workload

    with reported(*_INPUT_ERRORS):  # SimulationError is a ValueError
        prepared = load_workload(workload)
    from simulator.simulation import SimulationError, run_config

    with reported(SimulationError):
        result = run_config(prepared, config)
    from data.io import write_workload

    # beside the telemetry: `kvpilot train` joins its tools to the logs and replays it in its policy search
    write_workload(prepared.table, config.out_dir / "workload.parquet")
    return result.summary


def _checked_preset(preset: str) -> str:
    """``--preset`` checked before anything runs (exit 2); a preset file by its absolute path, for workers."""
    from simulator.fitted_cost import load_cost

    with reported(ValueError, prefix="--preset: "):
        load_cost(preset)
    return str(Path(preset).resolve()) if preset.endswith(".toml") else preset


def _policy_options(text: Optional[str]) -> dict:
    """``--policy-options``: a JSON object (empty when not given); anything else exits 2."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        raise fail(f"--policy-options is not valid JSON: {err}") from None
    if not isinstance(options, dict):
        raise fail("--policy-options must be a JSON object")
    return options


def _fmt_gap(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _number_list(text: str, kind: type, option: str) -> list:
    try:
        values = [kind(x) for x in (p.strip() for p in text.split(",")) if x]
    except ValueError:
        raise fail(f"{option} must be a comma-separated list of {kind.__name__}s, got {text!r}") from None
    if not values:
        raise fail(f"{option} is empty")
    return values


EvalOutDirOpt = Annotated[Path, typer.Option("-o", "--out-dir",
                                             help="Where summary.{md,csv,json}, plots and runs/ go.")]
PoliciesOpt = Annotated[
    str, typer.Option("--policies", "-p", help="Comma-separated policy names; 'all' is every baseline, and "
                      "names beside it are added (all,learned); vllm-default is always added (ratios are to it).")
]
KvFractionsOpt = Annotated[
    Optional[str], typer.Option("--kv-fractions", help="Comma-separated KV fractions per replica; 'gpu': the "
                                "preset GPU's own KV capacity. Default: 0.1,0.2,0.4.")
]
KvTotalOpt = Annotated[
    Optional[str], typer.Option("--kv-total", help="Instead of --kv-fractions: comma-separated KV fractions "
                                "of the whole fleet, split evenly over each replica count's replicas (0.2 at "
                                "--replicas 4,8: 0.05 and 0.025 per replica).")
]
ReplicasOpt = Annotated[str, typer.Option("--replicas", help="Replica count(s), e.g. 1 or 1,2.")]
RoutersOpt = Annotated[
    str, typer.Option("--routers", "--router", help="Comma-separated routers (simulator.routers.ROUTERS: "
                      "round-robin, least-loaded, cache-aware, kv-aware, ...; 'all' is every one), a grid "
                      "dimension at several replicas (one replica has no router).")
]
JobsOpt = Annotated[int, typer.Option("--jobs", "-j", help="Worker processes (each imports vLLM once); with "
                                  "--backend ray and no --address, the local Ray instance's CPUs.")]
BackendOpt = Annotated[str, typer.Option("--backend", help="process (this process or --jobs worker processes) or "
                                     "ray (one Ray task per case; needs the ray package).")]
AddressOpt = Annotated[Optional[str], typer.Option(
    "--address", help="Ray cluster to join with --backend ray (e.g. auto or ray://HEAD:10001); default: a "
    "local Ray instance of --jobs CPUs.")]
EvalDecodeStrideOpt = Annotated[
    Optional[int], typer.Option("--decode-stride", help="Tokens each request decodes per simulated step; "
                                f"1 is exact. Default: {DEFAULT_DECODE_STRIDE} (training.grid."
                                "DEFAULT_DECODE_STRIDE); benchmarks/bench_stride.py measures what a stride "
                                "changes.")
]
ResumeOpt = Annotated[
    bool, typer.Option("--resume", help="Reuse the cases an earlier evaluation into -o finished for this "
                       "workload and preset, at this stride, router and tier; without it, -o must hold no "
                       "earlier evaluation.")
]
ModelOpt = Annotated[Optional[Path], typer.Option(
    "--model", help="POLICY_DIR of the learned policy (from `kvpilot train policy`), for `learned` and its "
    "ablations (learned-prior: no trained network, the rules it starts from; learned-admission: + the network's "
    "admission residual; learned-tier-rule: every trained lever but the tier model; learned: every lever it "
    "trained; learned-no-tier, learned-gpu-evict, learned-tier-lru: levers off). With `learned` listed, "
    "`learned-prior` is evaluated beside it.")]
FullTelemetryOpt = Annotated[bool, typer.Option(
    "--full-telemetry", help="Also write each run's decisions and kv_events telemetry (for training, OPE or "
    "cache analysis; slower). Without it a run writes the requests and steps tables the summary reads.")]
OffloadGibsOpt = Annotated[str, typer.Option(
    "--offload-gib", help="Host memory (GiB) per replica of the CPU offload tier (vLLM's native KV offloading) "
    "for the policies that use it (vllm-offload, *-offload, learned over the tier); comma-separated sizes "
    "(16,64,256) are a grid dimension for those policies; 0 turns the tier off. Default: a quarter of a DGX "
    "H200's host memory per GPU.")]


@app.command("evaluate")
def evaluate_cmd(
    workload: WorkloadOpt,
    out_dir: EvalOutDirOpt,
    policies: PoliciesOpt = "all",
    kv_fractions: KvFractionsOpt = None,
    kv_total: KvTotalOpt = None,
    replicas: ReplicasOpt = "1",
    routers: RoutersOpt = "round-robin",
    jobs: JobsOpt = 1,
    backend: BackendOpt = "process",
    address: AddressOpt = None,
    preset: Preset = "H200-7B",
    time_scale: TimeScale = 1.0,
    decode_stride: EvalDecodeStrideOpt = None,
    resume: ResumeOpt = False,
    progress: ProgressOpt = True,
    model: ModelOpt = None,
    full_telemetry: FullTelemetryOpt = False,
    keep_cache: KeepCacheOpt = False,
    offload_gib: OffloadGibsOpt = f"{DEFAULT_OFFLOAD_GIB:g}",
    driver: DriverOpt = "sync",
    staleness: StalenessOpt = None,
    weight_sync: WeightSyncOpt = None,
    train_batch: TrainBatchOpt = None,
    trainer_preset: TrainerPresetOpt = None,
    trainer: TrainerOpt = False,
    admission: AdmissionOpt = "auto",
    max_groups: MaxGroupsOpt = None,
) -> None:
    """Run several policies on one workload (same seeds and cost model) over KV sizes and replicas; compare them."""
    from simulator.config import SimulationError
    from training.evaluate import Execution
    from training.grid import EvaluationError, Grid, evaluation_config, resolve_routers

    with reported(EvaluationError, prefix="--routers: "):
        resolve_routers(routers)
    kvs, totals = _kv_sizes(kv_fractions, kv_total)
    reps, tiers = _number_list(replicas, int, "--replicas"), _number_list(offload_gib, float, "--offload-gib")
    preset = _checked_preset(preset)
    trainer_spec = _trainer_spec(driver, trainer, train_batch, trainer_preset)
    staleness, weight_sync = _check_async_only(driver, max_groups, admission, staleness, weight_sync)
    with reported(EvaluationError, SimulationError):  # the grid, its base run and how it runs: before anything runs
        base = evaluation_config(preset=preset, keep_cache_across_steps=keep_cache, time_scale=time_scale,
                                 trainer=trainer_spec, offload_gib=tiers[0], **({} if decode_stride is None else
                                                                                {"decode_stride": decode_stride}))
        grid = Grid(policies, base, kv_fractions=kvs, kv_totals=totals, replicas=reps, routers=routers,
                    tier_gibs=tiers, full_telemetry=full_telemetry)
        how = Execution(jobs, backend, address, resume, progress)
    learned = _check_learned_model(list(grid.policies), model)
    if model is not None:
        grid = dataclasses.replace(grid, policy_options={n: {"model": str(model)} for n in learned})
    if driver == "async":  # in this process, case after case (each sweep runs sync and every eta x mode)
        _evaluate_async(workload, out_dir, grid, _async_runs(staleness, weight_sync, admission, max_groups),
                        progress)
        return
    _run_grid(workload, grid, out_dir, how)


def _evaluate_async(workload: Path, out_dir: Path, grid: Grid, runs: list, progress: bool) -> None:
    """``evaluate --driver async``: a sweep per policy x KV size x replica count (the first router)."""
    if grid.kv_totals is not None:
        raise fail("--driver async takes --kv-fractions, not --kv-total")
    if grid.tier_gibs is not None:
        raise fail("--driver async takes one --offload-gib size")
    cases = sorted((c for c in grid.cases() if c.router in (None, grid.routers[0])),
                   key=lambda c: grid.policies.index(c.policy))  # policy by policy, as listed
    _async_sweep(workload, out_dir, [grid.config(c) for c in cases], runs, progress, False)


def _run_grid(workload: Path, grid: Grid, out_dir: Path, how: Execution) -> None:
    """``evaluate``: the grid run as ``how`` says, announced, each case's line printed; exit 1 if every case
    failed. An earlier evaluation in ``out_dir`` is kept unless ``--resume``."""
    from training.evaluate import evaluate
    from training.grid import EvaluationError

    runs = out_dir / "runs"
    earlier = sorted(p.name for p in runs.iterdir()) if runs.is_dir() else []
    if earlier and not how.resume:  # run_case replaces a case's run: never an earlier evaluation's without a word
        raise fail(f"{out_dir} already holds an evaluation ({len(earlier)} run(s) in {runs}, e.g. {earlier[0]}): "
                   "--resume keeps the cases it finished for this workload and preset and runs the rest; or choose "
                   "another -o")
    where = f"{how.jobs} job(s)" if how.backend == "process" else f"Ray at {how.address}" if how.address else \
        f"a local Ray instance of {how.jobs} CPU(s)"
    sizes = f"{len(set(grid.kv_totals))} fleet KV size(s)" if grid.kv_totals is not None else \
        f"{len(set(grid.kv_fractions))} KV size(s)"
    console.print(f"evaluating {len(grid.policies)} policies x {sizes} x {len(set(grid.replicas))} replica count(s)"
                  + (f" x {len(grid.routers)} routers" if len(grid.routers) > 1 and max(grid.replicas) > 1 else "")
                  + f" = {len(grid.cases(grid.policies))} simulations, {where}, decode stride "
                  f"{grid.base.decode_stride}", highlight=False)
    t0 = time.perf_counter()
    with reported(EvaluationError):
        result = evaluate(workload, grid, out_dir, how)
    _print_rows(result.rows)
    failed = [r for r in result.rows if r.get("error")]
    console.print(f"{len(result.rows)} case(s), {len(failed)} failed, in {time.perf_counter() - t0:.1f} s; "
                  f"summary.md, summary.csv, summary.json and plots in {out_dir}", highlight=False)
    if failed and len(failed) == len(result.rows):
        raise fail("every case failed (their errors are above and in summary.json)", code=1)


def _kv_sizes(kv_fractions: Optional[str], kv_total: Optional[str]) -> tuple[Optional[list], Optional[list]]:
    """``--kv-fractions`` (``gpu``: the preset GPU's capacity, None) and ``--kv-total`` as lists (exit 2 on a bad
    one): (fractions per replica, fleet totals), one of them None."""
    from training.grid import DEFAULT_KV_FRACTIONS

    totals = _number_list(kv_total, float, "--kv-total") if kv_total is not None else None
    kvs: list | None = None if totals is not None else list(DEFAULT_KV_FRACTIONS)
    if kv_fractions is not None:
        parts = [p.strip() for p in kv_fractions.split(",") if p.strip()]
        kvs = [None] * ("gpu" in parts)
        if [p for p in parts if p != "gpu"]:
            kvs += _number_list(",".join(p for p in parts if p != "gpu"), float, "--kv-fractions")
        if not kvs:
            raise fail("--kv-fractions is empty")
    return kvs, totals


def _print_rows(rows: list[dict]) -> None:
    """One line per case: its makespan and ratios, or its error."""
    for r in rows:
        ratio, whole = r.get("makespan_ratio_vs_default"), r.get("simulated_ratio_vs_default")
        status = f"error: {r['error']}" if r.get("error") else (
            f"makespan {r['makespan_s']:.2f} s/step  x{ratio:.3f} vs default (whole run x{whole:.3f})  "
            f"x{_fmt_gap(r.get('makespan_over_bound'), 3)} bound  gap closed {_fmt_gap(r.get('gap_closed'))}  "
            f"hit {r['prefix_hit_rate']:.3f}  recomputed {r['recomputed_tokens']}"
            + (f"  offload load {r['offload_load_bytes'] / 2**30:.1f} GiB"
               f" store {r['offload_store_bytes'] / 2**30:.1f} GiB"
               if r.get("offload_blocks") else "")
            if ratio is not None and whole is not None else f"makespan {r['makespan_s']:.2f} s/step")
        kv = "gpu" if r["kv_fraction"] is None else f"{r['kv_fraction']:g}"
        if r.get("tier_gib") is not None:
            kv += f" tier {r['tier_gib']:g} GiB"
        rr = r.get("makespan_ratio_vs_round_robin_default")
        typer.echo(f"{r['policy']:<16} kv {kv:<5} r{r['replicas']}{' ' + r['router'] if r['router'] else ''}  "
                   f"{status}{f'  x{rr:.3f} vs round-robin default' if rr is not None else ''}")


def _check_learned_model(names: list[str], model: Optional[Path]) -> list[str]:
    """``learned`` and its ablations (returned) need ``--model``, a POLICY_DIR: checked once, before any case runs."""
    learned = [n for n in names if n == "learned" or n.startswith("learned-")]
    if not learned:
        return learned
    if model is None:
        raise fail(f"--policies {learned[0]} needs --model POLICY_DIR (written by `kvpilot train`)")
    from policy.learned.bundle import PolicyLoadError, read_manifest

    try:
        read_manifest(model)
    except PolicyLoadError as e:
        hint = f" ({model / 'policy'} is one)" if (model / "policy" / "policy.json").is_file() else ""
        raise fail(f"--model: {e}{hint}") from None
    return learned


#: The held-out evaluation's engine options of ``train`` and ``promote``; unset, each follows where the policy
#: was trained (``train``: the logs; ``promote``: the version's training), else the defaults.
HeldoutKv = Annotated[Optional[str], typer.Option(
    "--kv-fraction", help=f"KV of the held-out evaluation: a fraction of its largest step's need, or 'gpu' (the "
    f"GPU's own capacity); default: the training's share of its need, else {HELDOUT_KV_FRACTION:g}.")]
HeldoutPreset = Annotated[Optional[str], typer.Option(
    "--preset", help=f"Cost-model preset of the held-out evaluation; default: where the policy was trained, else "
    f"{HELDOUT_PRESET}.")]
HeldoutTier = Annotated[Optional[float], typer.Option(
    "--offload-gib", help="CPU tier (GiB per replica) of the held-out evaluation, for the policies that use it; "
    "default: the training's tier as a share of the workload's need, else simulate's.")]


def _heldout(workload: Optional[Path], seed: int, kv_fraction: Optional[str], preset: Optional[str],
             offload_gib: Optional[float]):
    """The held-out evaluation's parameters, the settings not given following the training's (``follow``); a
    missing workload or a bad KV size, preset or tier exits 2."""
    from training.train import ENGINE_FIELDS, HeldoutParams, TrainError

    given: dict = {}
    if kv_fraction is not None:
        if kv_fraction.strip().lower() == "gpu":
            given["kv_fraction"] = None
        else:
            try:
                given["kv_fraction"] = float(kv_fraction)
            except ValueError:
                raise fail(f"--kv-fraction: expected a number or 'gpu', got {kv_fraction!r}") from None
    if preset is not None:
        given["preset"] = preset
    if offload_gib is not None:  # a size in GiB, not the training's share
        given.update(offload_gib=offload_gib, offload_share=None)
    with reported(TrainError):
        return HeldoutParams(workload=workload, seed=seed, follow=tuple(k for k in ENGINE_FIELDS if k not in given),
                             **given)


@train_app.callback()
def train(
    ctx: typer.Context,
    logs: Annotated[Optional[list[Path]], typer.Option(
        "--logs", help="Telemetry run folders with decisions (e.g. `simulate --policy logging`); repeat.")] = None,
    experiment: Annotated[str, typer.Option("--experiment", help="MLflow experiment.")] = "kvpilot",
    out: Annotated[Path, typer.Option("-o", "--out", help="Work folder: the POLICY_DIR and the held-out "
                                      "evaluation.")] = Path("kvpilot-train"),
    test_steps: Annotated[Optional[str], typer.Option(
        "--test-steps", help="Predictors' held-out RL steps, e.g. '6-7'; default: the last quarter.")] = None,
    trees: Annotated[int, typer.Option("--trees", min=1, help="Boosting rounds per predictor.")] = 100,
    policy_config: Annotated[Optional[str], typer.Option(
        "--policy-config",
        help="JSON object of policy.learning.config.OfflineConfig fields, e.g. '{\"epochs\": 20}'.")] = None,
    heldout_workload: Annotated[Optional[Path], typer.Option(
        "--heldout-workload", help="Held-out workload for the simulator evaluation; default: a fresh synthetic "
        "one with an unseen seed.")] = None,
    heldout_seed: Annotated[int, typer.Option("--heldout-seed", help="Seed of the default held-out workload.")]
    = HELDOUT_SEED,
    kv_fraction: HeldoutKv = None,
    preset: HeldoutPreset = None,
    offload_gib: HeldoutTier = None,
    admission_orders: Annotated[str, typer.Option(
        "--admission-orders", help="Admission orders tried beside the prior's shortest-first, each simulated on "
        "every logged workload (LOG/workload.parquet), the best kept where it beats shortest-first by 0.5%: "
        "comma separated among siblings (a request whose GRPO group is running first), sessions (by the session's "
        "first arrival, as continuum admits), returning, progress, queue (vLLM's own order); 'none': "
        "shortest-first, no simulation.")] = "siblings,sessions,returning,queue",
    width: Annotated[bool, typer.Option(
        "--width/--no-width", help="Then the rollout's width (a younger GRPO group's turns wait while the older "
        "groups' contexts do not fit in GPU KV plus the CPU tier) simulated on every logged workload with the order "
        "kept, and kept where it is 0.5% faster; --no-width: never on.")] = True,
    levers_off: Annotated[bool, typer.Option(
        "--levers-off/--no-levers-off", help="Then each lever the bundle trained (the CPU tier, the preemption "
        "head) simulated off on every logged workload with the order kept, and left off where that is 0.5% faster; "
        "--no-levers-off: served as trained.")] = True,
    engine_preset: Annotated[Optional[Path], typer.Option(
        "--engine-preset", help="The engine of logs served by a real vLLM server (telemetry with no simulator "
        "summary.json): the preset `kvpilot calibrate` fitted to that server's steps. The admission order and the "
        "width are then chosen by simulating it; without it they are not chosen on such logs.")] = None,
    search_iterations: Annotated[int, typer.Option(
        "--search-iterations", min=0, help="Policy search: CEM iterations over the admission residual, each "
        "simulating --search-population samples on every logged workload (LOG/workload.parquet), on the order "
        "and levers kept; 0: no CEM.")] = 0,
    search_population: Annotated[int, typer.Option("--search-population", min=2, help="Samples per search "
                                                   "iteration.")] = 8,
    tier_rounds: Annotated[int, typer.Option(
        "--tier-rounds", min=0, help="CPU tier: fits of its next-use model, each replayed on every logged workload "
        "(LOG/workload.parquet) to score it and to record the states it leads to; the best is kept where it beats "
        "the session-state rule. 0: the rule orders the tier.")] = 2,
    tier_time_scales: Annotated[str, typer.Option(
        "--tier-time-scales", help="CPU tier: the tool-latency scales each logged workload is replayed at, comma "
        "separated; scales above 1 show the model the longer pauses (in admissions) of a faster engine or slower "
        "tools.")] = "1,3",
    jobs: Annotated[int, typer.Option("--jobs", "-j", min=1, help="Parallel simulations of the search and the "
                                      "tier training.")] = 2,
    backend: Annotated[str, typer.Option("--backend", help="Where the search's and the tier training's "
                                         "simulations run: process or ray.")] = "process",
    address: Annotated[Optional[str], typer.Option("--address", help="Ray cluster address (--backend ray).")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bars on stderr.")] = True,
) -> None:
    """Fit the predictors and the policy on logs in one MLflow run, evaluate, and register a new `kvpilot` version."""
    if ctx.invoked_subcommand is not None:
        if logs:
            raise fail(f"--logs before `{ctx.invoked_subcommand}`: give the subcommand's options after its name")
        return
    if not logs:
        raise fail("kvpilot train needs --logs DIR (repeatable), or a subcommand (see --help)")
    from policy.learning.config import OfflineConfig
    from predictors.logs import parse_steps
    from training.train import PredictorParams, TrainError, train_and_register

    with reported(ValueError, prefix="--test-steps: "):
        steps = parse_steps(test_steps)
    with reported(ValueError, prefix="--policy-config: "):
        policy_cfg = OfflineConfig.from_json(policy_config)
    params = PredictorParams(test_steps=tuple(steps) if steps else None, num_trees=trees)
    heldout = _heldout(heldout_workload, heldout_seed, kv_fraction, preset, offload_gib)
    from training.policy_search import ORDER_CHOICES, SearchConfig, SearchError

    orders = () if admission_orders.strip().lower() == "none" else \
        tuple(o.strip() for o in admission_orders.split(",") if o.strip())
    bad = [o for o in orders if o not in ORDER_CHOICES]
    if bad or not (orders or admission_orders.strip().lower() == "none"):
        raise fail(f"--admission-orders: unknown order(s) {', '.join(bad) or repr(admission_orders)}; give some of "
                   f"{', '.join(ORDER_CHOICES)} (comma separated), or none")
    with reported(SearchError, prefix="policy search: "):
        search = SearchConfig(iterations=search_iterations, population=search_population,
                              elite=min(SearchConfig.elite, search_population), orders=orders,
                              levers_off=levers_off, width=width,
                              jobs=jobs, backend=backend, address=address,
                              engine_preset=str(engine_preset) if engine_preset else None)
    from training.tier_training import TierConfig, TierTrainingError

    with reported(TierTrainingError, prefix="tier training: "):
        tier = TierConfig(rounds=tier_rounds, jobs=jobs, backend=backend, address=address,
                          time_scales=tuple(_number_list(tier_time_scales, float, "--tier-time-scales")))
    from serving_hook.model_registry import RegistryError

    # a missing log is a TrainError naming it; a store MLflow cannot open or write a RegistryError naming it
    with reported(TrainError, DataValidationError, RegistryError):
        result = train_and_register(logs, out, experiment=experiment, predictor_params=params,
                                    policy_config=policy_cfg, heldout=heldout,
                                    search=search, tier=tier, progress=progress, console=console)
    from training.promote import render_table
    from training.train import CANDIDATE, CANDIDATE_PRIOR

    typer.echo(render_table(result.evaluation, {CANDIDATE: f"kvpilot v{result.version}",
                                                CANDIDATE_PRIOR: f"learned-prior v{result.version}"}))
    console.print(f"run {result.run_id} in {result.tracking_uri}; next: kvpilot promote --version {result.version}",
                  highlight=False)


@app.command("promote")
def promote_cmd(
    version: Annotated[int, typer.Option("--version", help="Registered version of `kvpilot` to promote.")],
    force: Annotated[bool, typer.Option("--force", help="Move the champion alias without the gate.")] = False,
    workload: Annotated[Optional[Path], typer.Option(
        "--workload", "-w", help="Held-out workload; default: a fresh synthetic one with an unseen seed.")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the default held-out workload.")] = HELDOUT_SEED,
    kv_fraction: HeldoutKv = None,
    preset: HeldoutPreset = None,
    offload_gib: HeldoutTier = None,
    out_dir: Annotated[Optional[Path], typer.Option("-o", "--out-dir", help="Keep the evaluation here.")] = None,
    progress: ProgressOpt = True,
) -> None:
    """Move the `champion` alias to a version if it is no worse than the champion on makespan and recompute."""
    from serving_hook.model_registry import RegistryError
    from training.promote import PromotionError, promote, render_comparison

    heldout = _heldout(workload, seed, kv_fraction, preset, offload_gib)
    with reported(PromotionError, RegistryError):
        result = promote(version, force=force, heldout=heldout, out_dir=out_dir, progress=progress)
    typer.echo(render_comparison(result))
    if result.rows and not result.promoted:
        raise typer.Exit(1)  # refused by the gate


@app.command("replay")
def replay_cmd(
    url: Annotated[str, typer.Option("--url", help="The vLLM OpenAI server, e.g. http://127.0.0.1:8000.")],
    workload: WorkloadOpt,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Requests in flight at most.")] = 64,
    time_scale: TimeScale = 1.0,
    require_hook: Annotated[bool, typer.Option(
        "--require-hook/--no-require-hook", help="Refuse a server that does not run the kvpilot hook.")] = True,
    keep_cache: Annotated[bool, typer.Option(
        "--keep-cache-across-steps", help="Do not reset the server's prefix cache between RL steps (default: "
        "reset it, as RL frameworks do at weight sync; needs VLLM_SERVER_DEV_MODE=1 on the server).")] = False,
    timeout_s: Annotated[float, typer.Option("--timeout", help="Seconds one request may take.")] = 600.0,
    stream: Annotated[bool, typer.Option(
        "--stream/--no-stream", help="Stream each answer, token by token, to measure TTFT and TPOT; --no-stream: one "
        "answer per request, as RL rollout clients ask, with no per-token work in the server's API process "
        "(synchronous driver).")] = True,
    driver: DriverOpt = "sync",
    staleness: Annotated[int, typer.Option("--staleness", help="--driver async: the staleness bound eta.")] = 2,
    weight_sync: Annotated[str, typer.Option(
        "--weight-sync", help="--driver async: abort, recompute or keep, through the server's /pause and /resume "
        "(VLLM_SERVER_DEV_MODE=1).")] = "keep",
    trainer: TrainerOpt = False,
    train_batch: TrainBatchOpt = None,
    trainer_preset: TrainerPresetOpt = None,
    as_json: AsJsonOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """Replay a workload's RL steps against a running vLLM server (a real client), and summarise what it measured.
    With --trainer or --driver async the client also trains (the priced time, slept) and updates the weights."""
    from simulator.config import SimulationError
    from simulator.workload import load_workload
    from training.replay import ReplayConfig, ReplayError, render_replay, replay
    from training.replay_async import AsyncReplay, trained_replayer

    trainer_spec = _trainer_spec(driver, trainer, train_batch, trainer_preset)
    if driver != "async" and (staleness != 2 or weight_sync != "keep"):
        raise fail("--staleness and --weight-sync need --driver async")
    if driver == "async" and not stream:
        raise fail("--driver async streams its answers (a weight update cuts them off): drop --no-stream")
    with reported(*_INPUT_ERRORS, SimulationError):  # ReplayError is a ValueError
        cfg = ReplayConfig(url, concurrency, time_scale, timeout_s, require_hook, not keep_cache, progress, stream)
        rl = AsyncReplay(driver, trainer_spec, staleness, weight_sync)
        prepared = load_workload(workload)
    bar = None
    if progress:
        import sys

        from tqdm import tqdm

        def bar(total: int):
            return tqdm(total=total, file=sys.stderr, unit="req", desc="replaying", mininterval=0.5)
    with reported(ReplayError):
        summary = replay(prepared, cfg, bar, replayer=trained_replayer(rl) if rl.trainer is not None else None)
    typer.echo(json.dumps(summary, indent=2) if as_json else render_replay(summary))
    if summary["failed"]:
        raise typer.Exit(1)


@app.command("calibrate")
def calibrate_cmd(
    telemetry: Annotated[list[Path], typer.Option(
        "--telemetry", help="Telemetry of one engine (KVPILOT_TELEMETRY_DIR, or a run folder with telemetry/); "
        "repeat.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="The preset file to write (PRESET.toml).")],
    holdout: Annotated[float, typer.Option("--holdout", help="Share of steps held out to score the fit.")] = 0.2,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the held-out split.")] = 0,
    workload: Annotated[Optional[Path], typer.Option(
        "--workload", help="The workload the telemetry's client replayed: measures the client's round trip "
        "(a finished turn to the next one, tool wait aside), which the simulator adds to every follow-up.")] = None,
    time_scale: Annotated[float, typer.Option("--time-scale", help="replay's --time-scale for --workload's tool "
                                              "waits.")] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the fit as one JSON object.")] = False,
) -> None:
    """Fit the simulator's step-cost model to an engine's measured steps; write a preset for --preset."""
    from simulator.fitted_cost import write_preset_file
    from training.calibrate import CalibrateConfig, calibrate

    if out.suffix != ".toml":
        raise fail(f"-o {out}: a preset file's name ends in .toml (how --preset tells it from a named preset)")
    with reported(*_INPUT_ERRORS):  # CalibrationError is a ValueError
        result = calibrate(telemetry, CalibrateConfig(holdout=holdout, seed=seed, name=out.stem,
                                                      workload=workload, time_scale=time_scale))
        write_preset_file(result.cost, out, result.fit_record())
    typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.render())
    console.print(f"preset in {out}: --preset {out} --kv-fractions gpu models this engine", highlight=False)


@app.command("demo")
def demo(
    out_dir: Annotated[Path, typer.Option("-o", "--out-dir", help="Where the demo writes its files.")] = Path(
        "kvpilot-demo"
    ),
) -> None:
    """Run the whole loop on embedded defaults: log, train, register, promote, serve from the registry, compare."""
    from training.demo import run_demo

    run_demo(out_dir, console=console)


train_app.command("predictors")(predictors_cli.train_predictors)
train_app.command("policy")(policy_cli.train_policy_cmd)
predictors_app.command("eval")(predictors_cli.eval_predictors)


#: Python's string-hash seed the command line runs under unless the caller set ``PYTHONHASHSEED``. vLLM iterates
#: sets of request ids (for one, ``SchedulerOutput.finished_req_ids``, in which order the CPU tier's LRU ranks
#: finished requests' chunks), so with a random seed per process the same long simulation ran 3,577 s and
#: 3,653 s; under a fixed one it repeats to the bit.
HASH_SEED = "0"


def main() -> None:
    """Console-script entry point: re-runs itself once under a fixed hash seed (:data:`HASH_SEED`) if none is set."""
    if "PYTHONHASHSEED" not in os.environ:
        os.environ["PYTHONHASHSEED"] = HASH_SEED
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    try:
        app()
    except OSError as e:  # a path a command cannot create, read or write: which one and why, not a traceback
        where = f"{e.filename}: " if e.filename is not None else ""
        raise SystemExit(fail(f"{where}{e.strerror or e}").exit_code) from None


if __name__ == "__main__":
    main()
