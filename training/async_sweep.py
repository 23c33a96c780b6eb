"""Synchronous against asynchronous RL on one workload: a sweep over staleness bounds and weight-sync modes.

:func:`sweep` runs the synchronous driver with the trainer (the same training steps and weight updates after
each RL step) and the asynchronous driver at every ``eta`` x mode, each into ``out_dir/<run>``, and
:func:`write_sweep` writes ``async_summary.{json,md}`` and ``throughput_vs_staleness.png`` (trained trajectories
per second against eta, one line per mode, the synchronous run and the throughput bound beside them). Each row
has ``ratio_vs_sync`` and ``gap_closed``: the share of the synchronous run's gap to the bound the run closes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulator.config import AsyncRL, SimConfig

__all__ = ["COLUMNS", "sweep", "sweep_grid", "write_sweep"]

#: The table's columns, in order (summary keys, and the sweep's own).
COLUMNS = ("policy", "kv_fraction", "replicas", "run", "eta", "weight_sync", "async_admission", "trajectories_per_s",
           "ratio_vs_sync", "throughput_bound_trajectories_per_s", "throughput_over_bound", "gap_closed",
           "throughput_bound_binding",
           "run_s", "max_staleness", "mean_staleness", "reprefill_tokens_per_update", "weight_updates",
           "trainer_idle_share", "rollout_idle_share", "prefix_hit_rate", "preemptions", "recomputed_tokens",
           "group_latency_p50_s", "group_latency_p90_s", "gpu_decode_s", "gpu_prefill_new_s",
           "gpu_recompute_preemption_s", "gpu_recompute_eviction_s", "gpu_offload_wait_s", "gpu_idle_s", "error")


def sweep(workload: Any, base: SimConfig, runs: Sequence[AsyncRL], out_dir: Path,
          progress: bool = True) -> list[dict[str, Any]]:
    """The synchronous run of ``base`` (a :class:`simulator.config.SimConfig`; with a :class:`Trainer` if it has
    none) and an asynchronous run per ``runs`` (each an :class:`AsyncRL`: staleness bound, weight-sync mode,
    admission, cap on groups in flight), each into ``out_dir/<run>``; their rows. Every run is checked before
    any runs (:class:`simulator.config.SimulationError`)."""
    from simulator.config import SimulationError, Trainer
    from simulator.simulation import Simulation

    if not runs:
        raise SimulationError("a sweep needs at least one asynchronous run (a staleness bound and weight-sync mode)")
    base = replace(base, trainer=base.trainer or Trainer(), progress=False, driver="sync", async_rl=None)
    plan = [("sync", base)] + [(f"async-eta{a.staleness}-{a.weight_sync}", replace(base, driver="async", async_rl=a))
                               for a in runs]
    sims = [(name, Simulation(workload, config=replace(cfg, out_dir=Path(out_dir) / name)))
            for name, cfg in plan]  # checked first
    policy = base.policy if isinstance(base.policy, str) else type(base.policy).__name__
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(sims), file=sys.stderr, unit="run", desc=f"{policy} sync/async", dynamic_ncols=True)
    rows = []
    try:
        for name, sim in sims:
            row = {"policy": policy, "kv_fraction": base.kv_fraction, "replicas": base.replicas, "run": name,
                   "error": None}
            try:
                s = sim.run().summary.to_dict()
            except Exception as e:  # noqa: BLE001 - a row with its error, not a lost sweep
                row["error"] = f"{type(e).__name__}: {e}"
                s = {}
            rows.append({**row, "eta": s.get("staleness_eta"), **{k: s.get(k) for k in COLUMNS[5:] if k in s}})
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    sync = rows[0].get("trajectories_per_s")
    for r in rows:
        rate, bound = r.get("trajectories_per_s"), r.get("throughput_bound_trajectories_per_s")
        ok = rate is not None and sync
        r["ratio_vs_sync"] = rate / sync if ok else None
        r["gap_closed"] = (rate - sync) / (bound - sync) if ok and bound and bound - sync > 1e-12 else None
    return rows


def sweep_grid(workload: Any, bases: Sequence[SimConfig], runs: Sequence[AsyncRL], out_dir: Path,
               progress: bool = True) -> list[dict[str, Any]]:
    """:func:`sweep` for every base run (a policy at a KV size and replica count), each into
    ``out_dir/<policy>-kv<kv>-r<n>`` (``out_dir`` itself for a single one); their rows."""
    rows = []
    for base in bases:
        kv = "gpu" if base.kv_fraction is None else f"{base.kv_fraction:g}"
        sub = out_dir if len(bases) == 1 else out_dir / f"{base.policy}-kv{kv}-r{base.replicas}"
        rows += sweep(workload, base, runs, sub, progress)
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_sweep(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """``async_summary.json``, ``async_summary.md`` and ``throughput_vs_staleness.png`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "async_summary.json", out_dir / "async_summary.md"]
    files[0].write_text(json.dumps(rows, indent=2, default=str))
    md = ["# Synchronous vs asynchronous RL", "",
          "Trained trajectories per second (`trajectories_per_s`), its ratio to the synchronous run with the same "
          "trainer (`ratio_vs_sync`), its upper bound from the same cost model and the share of the synchronous "
          "run's gap to it that the run closes (`gap_closed`).", "",
          "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    md += ["| " + " | ".join(_fmt(r.get(k)) for k in COLUMNS) + " |" for r in rows]
    files[1].write_text("\n".join(md) + "\n")
    files.append(plot_sweep(rows, out_dir / "throughput_vs_staleness.png"))
    return files


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> Path:
    """Throughput against eta: one line per (policy, setting, mode), the synchronous runs and bounds dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys((r["policy"], r["kv_fraction"], r["replicas"]) for r in rows))
    fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4), squeeze=False)
    for ax, key in zip(axes[0], settings):
        mine = [r for r in rows if (r["policy"], r["kv_fraction"], r["replicas"]) == key]
        etas = sorted({r["eta"] for r in mine if r["eta"] is not None})
        for mode, marker in zip(("abort", "recompute", "keep"), ("o", "s", "^")):
            pts = sorted((r["eta"], r["trajectories_per_s"]) for r in mine
                         if r.get("weight_sync") == mode and not r.get("error"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=f"async {mode}")
        sync = next((r for r in mine if r["run"] == "sync"), None)
        if sync is not None and etas and not sync.get("error"):
            ax.hlines(sync["trajectories_per_s"], min(etas), max(etas), colors="k", linestyles="--", label="sync")
            ax.hlines(sync["throughput_bound_trajectories_per_s"], min(etas), max(etas), colors="grey",
                      linestyles=":", label="bound")
        policy, kv, reps = key
        ax.set_title(f"{policy}, KV {'gpu' if kv is None else f'{kv:g}'}, {reps} replica(s)")
        ax.set_xlabel("staleness bound eta")
        ax.set_ylabel("trained trajectories / s")
        ax.set_xticks(etas)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
