"""``kvpilot demo``: the whole loop on embedded defaults, from a synthetic workload to the champion served from MLflow.

1. generate a training workload and a held-out one (an unseen seed): small steps of the ``agentic`` preset
   (long-horizon swe agents beside the search agent), where KV competition decides the makespan;
2. simulate the training workload with the exploring ``logging`` policy over vLLM's CPU offload tier
   (decisions with propensities);
3. ``kvpilot train`` on those logs: predictors and policy in one MLflow run, a new version of ``kvpilot``;
4. ``kvpilot promote``: the first version becomes champion, a later one must pass the gate;
5. simulate vLLM default and every baseline on the held-out workload;
6. simulate it again with the hook serving ``models:/kvpilot@champion`` from the registry (policy ``registry``);
7. print the before/after table against vLLM default and the best baseline, each beside the run's lower bound
   (``makespan_over_bound``) and the share of vLLM default's gap to it that it closes (``gap_closed``), and
   write its plot.

The MLflow store is the embedded default (``./mlruns.db``, ``./mlartifacts``) unless ``MLFLOW_TRACKING_URI`` is
set; the demo ends with the ``mlflow ui`` command that opens it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from data.synth import SynthConfig
from training.reports import gap_closed
from training.train import CANDIDATE, CANDIDATE_PRIOR, HELDOUT_DECODE_STRIDE, HELDOUT_SEED, HeldoutParams

if TYPE_CHECKING:
    from simulator.summary import RunSummary

#: The demo's KV size: the agentic criterion's middle size, where vLLM default recomputes paused sessions.
DEMO_KV_FRACTION = 0.2
#: The demo's workloads: steps of the agentic preset with 4 prompts (3 swe, 1 search) x 8 samples each.
DEMO_PROMPTS_PER_STEP = 4
#: Baselines that are not deployable (they read the workload's future) and stay out of "best baseline".
REFERENCES = ("oracle",)


def _baselines() -> tuple[str, ...]:
    from policy.baselines import BASELINES

    return tuple(n for n in BASELINES if n not in REFERENCES)


@dataclass(frozen=True)
class DemoConfig:
    """The demo's sizes, sized to finish in about 10 minutes on 2 cores."""

    train: SynthConfig = field(default_factory=lambda: _agentic(seed=0, steps=2))
    heldout: SynthConfig = field(default_factory=lambda: _agentic(seed=HELDOUT_SEED, steps=1))
    kv_fraction: float = DEMO_KV_FRACTION
    baselines: tuple[str, ...] = field(default_factory=_baselines)
    jobs: int = 2  # worker processes for the baselines
    #: run_simulation options of every simulation (the held-out evaluations' decode stride, so all runs compare)
    sim_options: dict[str, Any] = field(default_factory=lambda: {"decode_stride": HELDOUT_DECODE_STRIDE})
    #: OfflineConfig overrides. The demo trains the learned preemption head (``preempt=True``) and serves over
    #: vLLM's CPU offload tier (``offload=True``); ``train`` then serves the head only where the logged workload
    #: runs 0.5% faster with it than with vLLM's tail victim (on the demo's log: 1.0065x, so it is off, and the
    #: champion runs 0.564x vLLM default's makespan on the held-out step, against infercept-offload's 0.568x).
    policy_options: dict[str, Any] = field(default_factory=lambda: {"preempt": True, "offload": True})
    #: The exploring policy's options: it logs over the same CPU offload tier the champion serves with.
    logging_options: dict[str, Any] = field(default_factory=lambda: {"offload": True})
    experiment: str = "kvpilot-demo"


@dataclass
class DemoResult:
    rows: list[dict[str, Any]]  # the before/after table's rows
    version: str
    promoted: bool
    tracking_uri: str
    files: list[Path]


def _agentic(seed: int, steps: int) -> SynthConfig:
    return dataclasses.replace(SynthConfig.preset("agentic"), seed=seed, steps=steps,
                               prompts_per_step=DEMO_PROMPTS_PER_STEP)


def _synth(cfg: SynthConfig, path: Path) -> Path:
    from data.io import write_workload
    from data.synth import generate

    write_workload(generate(cfg), path)
    return path


def _simulate(workload: Path, policy: str, out_dir: Path, cfg: DemoConfig,
              policy_options: dict[str, Any] | None = None) -> RunSummary:
    from simulator.simulation import run_simulation
    from simulator.workload import load_workload

    shutil.rmtree(out_dir, ignore_errors=True)  # the demo's own output of an earlier run
    result = run_simulation(load_workload(workload), policy, kv_fraction=cfg.kv_fraction, out_dir=out_dir,
                            progress=True, policy_options=dict(policy_options or {}), **cfg.sim_options)
    return result.summary


def run_demo(out_dir: Path, cfg: DemoConfig | None = None, console: Console | None = None) -> DemoResult:
    """Run the loop (see the module docstring) under ``out_dir`` (``cfg`` None: the embedded defaults)."""
    from policy.learning.config import OfflineConfig
    from training import registry
    from training.evaluate import Execution, evaluate
    from training.grid import Grid, evaluation_config
    from training.promote import promote, render_comparison
    from training.train import train_and_register

    cfg = cfg or DemoConfig()
    console = console or Console(stderr=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def stage(n: int, text: str) -> None:
        console.rule(f"[bold]{n}/7 {text}[/]  ({time.perf_counter() - t_start:.0f} s)")

    stage(1, "generate the training and held-out workloads")
    train_wl = _synth(cfg.train, out_dir / "workload-train.parquet")
    heldout_wl = _synth(cfg.heldout, out_dir / "workload-heldout.parquet")
    for path, w in ((train_wl, cfg.train), (heldout_wl, cfg.heldout)):
        console.print(f"{path}: seed {w.seed}, {w.steps} RL step(s) x {w.prompts_per_step} prompts x "
                      f"{w.group_size} samples", highlight=False)

    stage(2, f"simulate the training workload with the exploring `logging` policy, KV {cfg.kv_fraction:g}")
    log_dir = out_dir / "logs" / "logging"
    summary = _simulate(train_wl, "logging", log_dir, cfg, cfg.logging_options)
    shutil.copy(train_wl, log_dir / "workload.parquet")  # the predictors join prompt ids and tools from it
    console.print(f"makespan {summary.metrics.makespan_s:.1f} s, {summary.metrics.preemptions} preemptions, "
                  f"simulated in {summary.wall_s:.0f} s; telemetry in {log_dir}", highlight=False)

    stage(3, "kvpilot train: predictors and policy in one MLflow run")
    # the engine of every evaluation here (follow=(): the baselines of stage 5 run on the same one)
    heldout = HeldoutParams(workload=heldout_wl, kv_fraction=cfg.kv_fraction, sim_options=dict(cfg.sim_options),
                            follow=())
    trained = train_and_register([log_dir], out_dir / "train", experiment=cfg.experiment, heldout=heldout,
                                 policy_config=dataclasses.replace(OfflineConfig(), **cfg.policy_options),
                                 console=console)

    stage(4, f"kvpilot promote --version {trained.version}")
    gate = promote(trained.version, heldout=heldout, out_dir=out_dir / "promote")
    print(render_comparison(gate), flush=True)

    stage(5, "vLLM default and the baselines on the held-out workload")
    grid = Grid(list(cfg.baselines), evaluation_config(**cfg.sim_options), kv_fractions=[cfg.kv_fraction])
    base = evaluate(heldout_wl, grid, out_dir / "baselines", Execution(jobs=cfg.jobs))

    stage(6, "the hook serving models:/kvpilot@champion from the registry (policy `registry`)")
    before_uri = os.environ.get("KVPILOT_MODEL_URI")
    os.environ["KVPILOT_MODEL_URI"] = registry.DEFAULT_MODEL_URI
    try:
        served = _simulate(heldout_wl, "registry", out_dir / "serve-champion", cfg).to_dict()
    finally:
        if before_uri is None:
            del os.environ["KVPILOT_MODEL_URI"]
        else:
            os.environ["KVPILOT_MODEL_URI"] = before_uri
    champion = registry.get_champion()

    stage(7, "before / after")
    rows = before_after(base.rows, served, trained.evaluation, champion.version if champion else None)
    files = write_table(rows, out_dir)
    print(render_rows(rows))
    print(f"\nfiles: {', '.join(str(f) for f in files)}; baseline plots in {out_dir / 'baselines'}")
    print(f"the whole loop took {time.perf_counter() - t_start:.0f} s. Open the registry with:\n"
          f"  {ui_command(trained.tracking_uri)}", flush=True)
    return DemoResult(rows, trained.version, gate.promoted, trained.tracking_uri, files)


def ui_command(tracking_uri: str) -> str:
    """The ``mlflow ui`` command that opens the store the demo wrote to."""
    return f"mlflow ui --backend-store-uri {tracking_uri}"


def before_after(baseline_rows: list[dict[str, Any]], served: dict[str, Any], direct_rows: list[dict[str, Any]],
                 champion: str | None) -> list[dict[str, Any]]:
    """vLLM default, the best deployable baseline, the served champion, with ratios to the default.

    The best baseline has the lowest ``simulated_s`` (first RL step's start to the last one's end), the fair
    makespan for tail batching, whose long rounds count as extra steps in the per-step mean ``makespan_s``.
    ``direct_rows`` (the training's held-out evaluation of the same model loaded from its folder) adds its prior's
    row (``learned-prior``: the same bundle with no trained network) and the directly-loaded makespan, which the
    served one should reproduce."""
    ok = [r for r in baseline_rows if not r.get("error")]
    default = next(r for r in ok if r["policy"] == "vllm-default")
    rivals = [r for r in ok if r["policy"] not in ("vllm-default", *REFERENCES)]
    best = min(rivals, key=lambda r: r["simulated_s"]) if rivals else None
    rows = [dict(default, label="vLLM default (before)")]
    if best is not None:
        rows.append(dict(best, label=f"best baseline: {best['policy']}"))
    prior = next((r for r in direct_rows if r["policy"] == CANDIDATE_PRIOR), None)
    if prior is not None:
        rows.append(dict(prior, policy="learned-prior",
                         label="learned-prior: the trained version with no trained network"))
    rows.append(dict(served, policy="registry", label=f"kvpilot champion v{champion} from the registry (after)"))
    direct = next((r for r in direct_rows if r["policy"] == CANDIDATE), None)
    if direct is not None:
        rows[-1]["direct_makespan_s"] = direct["makespan_s"]
    for r in rows:
        for ratio, key in RATIOS.items():
            r[ratio] = r[key] / default[key] if default[key] else (1.0 if r[key] == 0 else None)
        r["gap_closed"] = gap_closed(r["makespan_s"], default["makespan_s"], r.get("bound_s"))
        r["makespan_over_bound"] = r["makespan_s"] / r["bound_s"] if r.get("bound_s") else None
    return rows


#: The table's ratios to vLLM default and the metric each divides.
RATIOS = {"makespan_ratio": "makespan_s", "simulated_ratio": "simulated_s", "recompute_ratio": "recomputed_tokens"}
_COLUMNS = ("makespan_s", "makespan_ratio", "makespan_over_bound", "gap_closed", "simulated_s", "simulated_ratio",
            "recomputed_tokens", "recompute_ratio", "preemptions", "prefix_hit_rate", "trajectory_p99_s")


def render_rows(rows: list[dict[str, Any]]) -> str:
    from training.promote import _fmt

    lines = ["| policy | " + " | ".join(_COLUMNS) + " |", "|---|" + "---|" * len(_COLUMNS)]
    lines += [f"| {r['label']} | " + " | ".join(_fmt(r.get(c)) for c in _COLUMNS) + " |" for r in rows]
    served = rows[-1]
    if served.get("direct_makespan_s") is not None:
        lines.append(f"\nserved from the registry: makespan {served['makespan_s']:.3f} s; the same model loaded "
                     f"from its folder in training: {served['direct_makespan_s']:.3f} s; hook fallbacks: "
                     f"{served.get('hook_fallbacks', 'n/a')}")
    return "\n".join(lines)


def write_table(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """``before_after.md`` and ``before_after.png`` (makespan and recompute ratios to vLLM default; the makespan's
    panel marks each run's lower bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    md = out_dir / "before_after.md"
    md.write_text("# kvpilot demo: before and after\n\nRatios are to vLLM default on the held-out workload "
                  "(lower is better); makespan_s is the mean per RL step, simulated_s the first step's start to the "
                  "last one's end.\n\n" + render_rows(rows) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = [r["label"].replace(" from the registry", "\nfrom the registry") for r in rows]
    for ax, key, title in ((axes[0], "simulated_ratio", "makespan (first step start to last step end)"),
                           (axes[1], "recompute_ratio", "recomputed tokens")):
        values = [r.get(key) or 0.0 for r in rows]
        ax.barh(labels, values, color=["#999999"] + ["#4c72b0"] * (len(rows) - 2) + ["#dd8452"])
        ax.axvline(1.0, color="black", linewidth=0.8)
        if key == "simulated_ratio" and rows[0].get("bound_s") and rows[0].get("makespan_s"):
            bound = rows[0]["bound_s"] / rows[0]["makespan_s"]  # the bound as a ratio to vLLM default's makespan
            ax.axvline(bound, color="#c44e52", linestyle="--", linewidth=1.0, label="lower bound")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xlabel("ratio to vLLM default")
        ax.set_title(title)
        ax.invert_yaxis()
    axes[1].set_yticklabels([])
    png = out_dir / "before_after.png"
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [md, png]
