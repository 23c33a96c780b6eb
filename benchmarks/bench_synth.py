"""Time the synthetic workload generator: the default workload (target < 10 s) and a 20-step one.

Run from the repository root: ``python -m benchmarks.bench_synth``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from data.synth import SynthConfig, generate


def best_time(cfg: SynthConfig, repeats: int) -> tuple[float, int]:
    """Best wall time of ``repeats`` generations, and the rows generated."""
    best, rows = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        rows = generate(cfg).num_rows
        best = min(best, time.perf_counter() - t0)
    return best, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    generate(SynthConfig())  # warm up imports
    for name, cfg in [
        ("default (2 steps x 64 prompts x 8)", SynthConfig()),
        ("20 steps x 64 prompts x 8", dataclasses.replace(SynthConfig(), steps=20)),
        ("20 steps x 512 prompts x 8", dataclasses.replace(SynthConfig(), steps=20, prompts_per_step=512)),
    ]:
        seconds, rows = best_time(cfg, args.repeats)
        print(f"{name:36s} {rows:8,d} rows  {seconds:7.3f} s  ({rows / seconds:,.0f} rows/s)")


if __name__ == "__main__":
    main()
