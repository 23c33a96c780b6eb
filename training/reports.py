"""The reports of an evaluation: every row's ratios to vLLM default (and to round-robin at several replicas) and
the share of its gap to the bound a policy closes; ``summary.{json,csv,md}`` and the plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from training.grid import DEFAULT, ROUND_ROBIN, Case

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
