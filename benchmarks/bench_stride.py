"""Benchmark: the decode stride's speed and fidelity against the exact path (k = 1).

Simulates the default synthetic workload (2 RL steps x 64 prompts x 8) on one
H200-7B replica for each policy x KV fraction x stride k, and prints, side by
side with k = 1: makespan (s per RL step), preemptions, prefix hit rate,
recomputed tokens, engine steps, wall and CPU time, and each policy's makespan ratio to
vllm-default at the same k and KV fraction; plus each k's largest deviation of a
policy's makespan ratio from k = 1's (the number that picks ``evaluate``'s default stride)
and of its hit-rate ratio.

Each run's summary is kept as ``<results>/<policy>-kv<f>-k<k>.json``; a rerun
only simulates what is missing there (k = 1 runs take ~3 CPU-minutes each), so
runs can be added a few at a time. ``--report`` prints without simulating.

Run from the repository root: ``nice -n 10 .venv/bin/python -m benchmarks.bench_stride
[--strides 1,8,16,32] [--kv-fractions 0.1,0.2] [--policies vllm-default,oracle,sjf-predicted]
[--results DIR] [--report]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

KEYS = ("makespan_s", "preemptions", "prefix_hit_rate", "recomputed_tokens", "engine_steps", "wall_s",
        "trajectory_p99_s", "simulated_s")


def _csv(text: str, kind: type) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def _path(results: Path, policy: str, kv: float, k: int) -> Path:
    return results / f"{policy}-kv{kv:g}-k{k}.json"


def _run(workload, policy: str, kv: float, k: int) -> dict:
    from simulator.simulation import Simulation

    t0, c0 = time.perf_counter(), time.process_time()
    sim = Simulation(workload, policy, kv_fraction=kv, decode_stride=k, progress=False)
    s = sim.run().summary.to_dict()
    row = {key: s[key] for key in KEYS}
    row["end_to_end_s"] = time.perf_counter() - t0
    row["cpu_s"] = time.process_time() - c0  # this process's CPU time: the cost without other load
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strides", default="1,8,16,32")
    parser.add_argument("--kv-fractions", default="0.1,0.2")
    parser.add_argument("--policies", default="vllm-default,oracle,sjf-predicted")
    parser.add_argument("--results", type=Path, default=None,
                        help="folder of per-run JSON (default: <kvpilot cache>/bench-stride)")
    parser.add_argument("--report", action="store_true", help="print what is there; simulate nothing")
    args = parser.parse_args()

    from simulator import engine

    strides, kvs, policies = _csv(args.strides, int), _csv(args.kv_fractions, float), _csv(args.policies, str)
    results = args.results or engine.cache_dir() / "bench-stride"
    results.mkdir(parents=True, exist_ok=True)
    if not args.report:
        from data.synth import SynthConfig, generate
        from simulator.workload import prepare_workload

        engine.make_vllm_config()  # imports and the first ModelConfig, outside the timings
        workload = prepare_workload(generate(dataclasses.replace(SynthConfig())))
        # Cheap runs first, so that a partial run already compares strides.
        for k in sorted(strides, reverse=True):
            for kv in kvs:
                for p in policies:
                    path = _path(results, p, kv, k)
                    if not path.exists():
                        row = _run(workload, p, kv, k)
                        path.write_text(json.dumps(row, indent=1))
                        print(f"ran {path.name}: {row['wall_s']:.1f} s wall", flush=True)
    report(results, sorted({1, *strides}), kvs, policies)


def report(results: Path, strides: list[int], kvs: list[float], policies: list[str]) -> None:
    rows = {}
    for p in policies:
        for kv in kvs:
            for k in strides:
                path = _path(results, p, kv, k)
                if path.exists():
                    rows[p, kv, k] = json.loads(path.read_text())
    head = (f"{'policy':<14} {'kv':>4} {'k':>3} {'makespan':>9} {'(k=1)':>8} {'ratio':>6} {'(k=1)':>6} "
            f"{'preempt':>7} {'(k=1)':>6} {'hit':>6} {'(k=1)':>6} {'recompute':>10} {'(k=1)':>10} "
            f"{'steps':>7} {'wall s':>7} {'(k=1)':>6} {'cpu s':>6}")
    print(head)
    worst: dict[int, float] = {}
    worst_hit: dict[int, float] = {}
    for kv in kvs:
        for p in policies:
            for k in strides:
                r, r1 = rows.get((p, kv, k)), rows.get((p, kv, 1))
                if r is None:
                    continue
                d, d1 = rows.get(("vllm-default", kv, k)), rows.get(("vllm-default", kv, 1))
                ratio = r["makespan_s"] / d["makespan_s"] if d else float("nan")
                ratio1 = r1["makespan_s"] / d1["makespan_s"] if r1 and d1 else float("nan")
                if k != 1 and p != "vllm-default" and ratio == ratio and ratio1 == ratio1:
                    worst[k] = max(worst.get(k, 0.0), abs(ratio / ratio1 - 1))
                    hit = r["prefix_hit_rate"] / d["prefix_hit_rate"] if d["prefix_hit_rate"] else float("nan")
                    hit1 = r1["prefix_hit_rate"] / d1["prefix_hit_rate"] if d1["prefix_hit_rate"] else float("nan")
                    if hit == hit and hit1 == hit1:
                        worst_hit[k] = max(worst_hit.get(k, 0.0), abs(hit / hit1 - 1))
                def g(key: str, fmt: str, r1=r1) -> str:
                    return format(r1[key], fmt) if r1 else "-"
                print(f"{p:<14} {kv:>4g} {k:>3} {r['makespan_s']:>9.1f} {g('makespan_s', '8.1f'):>8} "
                      f"{ratio:>6.3f} {ratio1:>6.3f} {r['preemptions']:>7} {g('preemptions', 'd'):>6} "
                      f"{r['prefix_hit_rate']:>6.3f} {g('prefix_hit_rate', '.3f'):>6} "
                      f"{r['recomputed_tokens']:>10,} {g('recomputed_tokens', ','):>10} "
                      f"{r['engine_steps']:>7,} {r['wall_s']:>7.1f} {g('wall_s', '.1f'):>6} "
                      f"{r['cpu_s'] if 'cpu_s' in r else float('nan'):>6.1f}")
    for k in sorted(worst):
        print(f"k={k}: largest |policy ratio / its k=1 ratio - 1| = {worst[k]:.2%} (makespan), "
              f"{worst_hit.get(k, float('nan')):.2%} (hit rate)")


if __name__ == "__main__":
    main()
