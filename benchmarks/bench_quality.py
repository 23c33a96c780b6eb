"""Benchmark: every predictor's held-out quality beside its baseline, and the issue's done-when checks.

``python -m benchmarks.bench_quality [--out DIR] [--session-icc 0.6] [--trees 100]``

For each log (default preset, 4 RL steps; agentic preset, 3 steps; Search-R1 when
``../shared/traces/polytrace/search_r1`` holds its step files): generate (or
import) the workload, simulate it under vLLM default (decode stride 32, real
vLLM scheduler on the CPU), train every predictor on the earlier steps and
report on the last one (:func:`predictors.pipeline.train_bundle`), then print the
checks: length Kendall tau over the group oracle's (>= 0.9 overall, >= 0.6 tau on
code), tool latency MAE below the per-tool median's, continuation AUC or log
loss better than the turn-count prior's, turns remaining and time to next use
below their baselines' MAE. ``--session-icc`` sets the tools' share of latency
variance common to a session (:class:`data.synth.ToolConfig`; the presets have
0: independent draws, which no model can rank beyond the per-tool median). About
5 minutes on 2 cores (the simulations; runs already in --out are reused).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
SEARCH_R1 = TRACES / "polytrace" / "search_r1"


def synth(preset: str, steps: int, session_icc: float):
    from data.synth import SynthConfig, generate

    cfg = SynthConfig.preset(preset)
    doms = {k: (dataclasses.replace(d, tool=dataclasses.replace(d.tool, session_icc=session_icc))
                if d.tool is not None and session_icc else d) for k, d in cfg.domains.items()}
    return generate(dataclasses.replace(cfg, steps=steps, domains=doms))


def simulate(table, out: Path) -> Path:
    """Simulate under vLLM default into ``out`` (telemetry) with the workload beside it; reuses a finished run."""
    from data.io import write_workload
    from simulator.simulation import run_simulation

    if not (out / "telemetry" / "requests").is_dir():
        run_simulation(table, "vllm-default", out_dir=out, progress=False, decode_stride=32)
    write_workload(table, out / "workload.parquet")
    return out


def checks(report: dict) -> list[str]:
    """The done-when lines of one report."""
    from predictors.pipeline import tau_ratios
    from predictors.session import session_ok

    L = report["length"]
    r = tau_ratios(L)
    out = [f"length tau {L['kendall_tau']:.3f} / group oracle {L['reference_group_oracle_tau']:.3f} = "
           f"{r['overall']:.2f} ({'MET' if r['overall'] >= 0.9 else 'NOT MET'}, >= 0.9)"]
    if "code" in L["kendall_tau_per_domain"]:
        c = L["kendall_tau_per_domain"]["code"]
        out.append(f"length tau on code {c:.3f} (oracle {L['reference_group_oracle_tau_per_domain']['code']:.3f}, "
                   f"ratio {r['code']:.2f}) ({'MET' if c >= 0.6 else 'NOT MET'}, >= 0.6)")
    S = report.get("session", {})
    if "skipped" in S or not S:
        out.append(f"session models: {S.get('skipped', 'not trained')}")
    else:
        for k, v in session_ok(S).items():
            out.append(f"{k}: {'beats' if v else 'does NOT beat'} its baseline")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/kvpilot-bench-quality"))
    ap.add_argument("--session-icc", type=float, default=0.0)
    ap.add_argument("--trees", type=int, default=100)
    args = ap.parse_args()

    from predictors.logs import load_logs
    from predictors.pipeline import render_report, train_bundle

    logs = [("default", 4), ("agentic", 3)]
    summary = []
    for preset, steps in logs:
        name = f"{preset}{steps}-icc{args.session_icc:g}"
        t = time.perf_counter()
        run = simulate(synth(preset, steps, args.session_icc), args.out / name)
        t_sim = time.perf_counter() - t
        t = time.perf_counter()
        b = train_bundle(load_logs([run]), test_steps=[steps - 1], num_trees=args.trees, num_threads=1)
        print(f"\n== {name}: simulated in {t_sim:.0f} s, trained in {time.perf_counter() - t:.1f} s ==")
        print(render_report(b.report))
        summary.append((name, checks(b.report)))
    files = sorted(SEARCH_R1.glob("*.jsonl")) if SEARCH_R1.is_dir() else []
    if len(files) >= 3:
        from data.importers import import_polytrace_multiturn

        run = simulate(import_polytrace_multiturn(files).table, args.out / "search_r1")
        b = train_bundle(load_logs([run]), test_steps=[2], num_trees=args.trees, num_threads=1)
        print("\n== Search-R1 (simulated under vLLM default): train steps 0-1, test step 2 ==")
        print(render_report(b.report))
        summary.append(("search_r1", checks(b.report)))
    else:
        print(f"\n(Search-R1 skipped: expected 3 step files *.jsonl in {SEARCH_R1}, found {len(files)})")
    print("\n== done-when checks (held-out last step) ==")
    for name, lines in summary:
        print(name)
        for line in lines:
            print(f"  {line}")


if __name__ == "__main__":
    main()
