"""Benchmark: the simulator's own cost beside vLLM's scheduler on the same run.

Simulates the default synthetic workload (2 RL steps x 64 prompts x 8 samples)
with ``vllm-default`` on one H200-7B replica at ``--kv-fraction`` (0.3: small
enough to preempt and evict) and prints:

* the run's wall time (the event loop; set-up and the summary's Parquet reads
  are shown apart), the end-to-end time, engine steps and simulated seconds;
* the time spent inside the scheduler's ``schedule()`` + ``update_from_output()``
  (``add_request`` and ``finish_requests`` are counted there too), of which the
  kvpilot hook's own share (telemetry rows, KV events);
* the **overhead**: (wall - scheduler time) / scheduler time. Target: <= 25 %.

Everything outside the scheduler is the simulator: the event heap, token ids of
each prompt and output (numpy), building vLLM requests (vLLM hashes their
blocks in the constructor), the fake runner's outputs and the cost model.

Run from the repository root: ``.venv/bin/python -m benchmarks.bench_sim
[--kv-fraction 0.3] [--prompts 64] [--steps 2]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-fraction", type=float, default=0.3)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per RL step")
    parser.add_argument("--steps", type=int, default=2, help="RL steps")
    parser.add_argument("--policy", default="vllm-default")
    args = parser.parse_args()

    from data.synth import SynthConfig, generate
    from simulator import engine
    from simulator.simulation import Simulation

    engine.make_vllm_config()  # imports and the first ModelConfig, outside the timings
    workload = generate(dataclasses.replace(SynthConfig(), prompts_per_step=args.prompts, steps=args.steps))
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-sim-") as out:
        t0 = time.perf_counter()
        sim = Simulation(workload, args.policy, kv_fraction=args.kv_fraction, out_dir=out, progress=False)
        result = sim.run()
        total = time.perf_counter() - t0
    s = result.summary
    m = s.metrics
    outside = result.wall_s - result.scheduler_s
    print(f"workload: {workload.num_rows:,} requests, {args.steps} steps x {args.prompts} prompts x 8; "
          f"policy {s.policy}; KV {s.kv_blocks:,} blocks (fraction {args.kv_fraction:g})")
    print(f"run: {s.engine_steps:,} engine steps, {m.simulated_s:.1f} simulated s, "
          f"{m.preemptions} preemptions, prefix hit rate {m.prefix_hit_rate:.3f}")
    print(f"end to end {total:7.2f} s  (set-up {sim.setup_s:.2f} s, event loop {result.wall_s:.2f} s, "
          f"summary and telemetry reads {total - sim.setup_s - result.wall_s:.2f} s)")
    print(f"inside schedule() + update_from_output() {result.scheduler_s:7.2f} s "
          f"({result.scheduler_s / s.engine_steps * 1e3:.2f} ms/step), of which the hook's schedule()-side work "
          f"{result.hook_s:.2f} s")
    print(f"simulator outside the scheduler        {outside:7.2f} s "
          f"({outside / s.engine_steps * 1e6:.0f} us/step)")
    print(f"overhead = (wall - scheduler) / scheduler = {result.overhead:.1%}  (target <= 25%)")


if __name__ == "__main__":
    main()
