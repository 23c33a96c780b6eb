"""Benchmark: simulator speed at 1, 4, 8 and 16 replicas on the same work, and where the time goes.

One synthetic workload (``--preset-workload``, default ``agentic``, ``--prompts`` prompts x 8 samples,
``--steps`` RL steps) is simulated with ``vllm-default`` behind the ``round-robin`` router at decode stride
32 (:data:`training.grid.DEFAULT_DECODE_STRIDE`) on each replica count of ``--replicas``. The fleet's KV
is the same at every count: ``--kv-total`` of the largest step's need in all, so ``kv_fraction`` =
kv_total / replicas per replica (raised to the largest request's blocks where that is smaller, marked ``*``:
vLLM cannot run a request larger than its cache). The default 1.5 is what 16 replicas of a 4-prompt agentic
step need to hold its longest swe session each.

Per replica count it prints engine steps, simulated tokens (prompt + output tokens of every request, the
``requests`` telemetry), the event loop's wall and CPU time (``time.process_time``), simulated tokens per
CPU-second and its ratio to the first count, and the loop's wall time split into

* ``vllm``: vLLM's scheduler (``schedule()`` + ``update_from_output()``, ``scheduler_s - hook_s``);
* ``hook``: the kvpilot hook's own share of that (``hook_s``);
* ``router``: routing requests to replicas (``router_s``, ``Fleet._route``);
* ``sim``: the rest, the simulator's own (event clock, fake runner, drivers, building vLLM requests).

``--profile R`` then runs R replicas once more under cProfile and prints the top ``--top`` functions of the
project's own code (simulator/, serving_hook/, policy/, data/) by cumulative and by own time.

Run from the repository root: ``python -m benchmarks.bench_fleet [--replicas 1,4,8,16] [--prompts 4]
[--steps 1] [--kv-total 1.5] [--preset-workload agentic|short] [--profile 16|0]``.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

OURS = ("simulator/", "serving_hook/", "policy/", "data/")


def run_once(workload, replicas: int, kv_total: float, stride: int):
    """One run; returns (result, kv_fraction used, clamped, loop CPU seconds)."""
    from simulator.simulation import Simulation
    from simulator.sizing import min_blocks_for

    frac = kv_total / replicas
    floor = (min_blocks_for(workload) - 1) / workload.kv_need  # the largest request must fit one replica
    clamped = frac < floor
    frac = max(frac, floor * 1.0001)
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-fleet-") as out:
        sim = Simulation(workload, "vllm-default", replicas=replicas, router="round-robin", kv_fraction=frac,
                         decode_stride=stride, out_dir=out, progress=False)
        # CPU time of the event loop alone: Simulation._loop is what SimResult.wall_s times
        loop, cpu = sim._loop, [0.0]

        def timed(reps, _loop=loop):
            c0 = time.process_time()
            try:
                return _loop(reps)
            finally:
                cpu[0] = time.process_time() - c0

        sim._loop = timed
        result = sim.run()
    return result, frac, clamped, cpu[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="1,4,8,16", help="replica counts, comma-separated")
    parser.add_argument("--preset-workload", default="agentic", help="synth preset (agentic, short, default)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per RL step (x 8 samples)")
    parser.add_argument("--steps", type=int, default=1, help="RL steps")
    parser.add_argument("--kv-total", type=float, default=1.5,
                        help="the fleet's KV as a fraction of the largest step's need, all replicas together")
    parser.add_argument("--profile", type=int, default=16, help="replicas of the profiled run (0: none)")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    counts = [int(x) for x in args.replicas.split(",") if x]

    from data.synth import SynthConfig, generate
    from simulator import engine
    from simulator.workload import prepare_workload
    from training.grid import DEFAULT_DECODE_STRIDE

    engine.make_vllm_config()  # imports and the first ModelConfig, outside the timings
    cfg = dataclasses.replace(SynthConfig.preset(args.preset_workload), prompts_per_step=args.prompts,
                              steps=args.steps)
    workload = prepare_workload(generate(cfg))
    print(f"workload: preset {args.preset_workload}, {args.steps} step(s) x {args.prompts} prompts x "
          f"{cfg.group_size}, {workload.num_rows:,} requests, step need {workload.kv_need:,} blocks; "
          f"vllm-default, round-robin, decode stride {DEFAULT_DECODE_STRIDE}, fleet KV {args.kv_total:g} of need")
    head = (f"{'replicas':>8} {'kv/rep':>7} {'steps':>7} {'sim tokens':>11} {'wall s':>7} {'CPU s':>7} "
            f"{'tok/CPU-s':>10} {'ratio':>6} {'vllm':>6} {'hook':>6} {'router':>7} {'sim':>6} {'preempt':>7}")
    print(head)
    base = None
    for r in counts:
        res, frac, clamped, cpu = run_once(workload, r, args.kv_total, DEFAULT_DECODE_STRIDE)
        s = res.summary
        req = res.requests
        tokens = int(sum(req.column("prompt_tokens").to_pylist()) + sum(req.column("output_tokens").to_pylist()))
        rate = tokens / cpu if cpu > 0 else 0.0
        base = base or rate
        wall = res.wall_s
        vllm = res.scheduler_s - res.hook_s
        rest = wall - res.scheduler_s - res.router_s
        sh = [x / wall if wall > 0 else 0.0 for x in (vllm, res.hook_s, res.router_s, rest)]
        print(f"{r:>8} {frac:>6.3f}{'*' if clamped else ' '} {s.engine_steps:>7,} {tokens:>11,} {wall:>7.2f} "
              f"{cpu:>7.2f} {rate:>10,.0f} {rate / base:>6.2f} {sh[0]:>6.1%} {sh[1]:>6.1%} {sh[2]:>7.1%} "
              f"{sh[3]:>6.1%} {s.metrics.preemptions:>7}", flush=True)
    print("shares are of the event loop's wall time; ratio: tokens per CPU-second over the first row's")

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run_once(workload, args.profile, args.kv_total, DEFAULT_DECODE_STRIDE)
        prof.disable()
        root = str(Path(__file__).resolve().parents[1]) + os.sep
        stats = pstats.Stats(prof)
        rows = [(fn, st) for fn, st in stats.stats.items() if fn[0].startswith(root)
                and fn[0][len(root):].startswith(OURS)]
        total = sum(st[2] for st in stats.stats.values())
        for key, idx in (("cumulative", 3), ("own time", 2)):
            print(f"\nprofile, {args.profile} replicas (cProfile, its own overhead included; all functions' own time "
                  f"{total:.2f} s): top {args.top} of the project's code by {key}")
            print(f"{'calls':>10} {'own s':>8} {'cum s':>8}  function")
            for fn, st in sorted(rows, key=lambda x: x[1][idx], reverse=True)[:args.top]:
                print(f"{st[1]:>10,} {st[2]:>8.2f} {st[3]:>8.2f}  {fn[0][len(root):]}:{fn[1]} {fn[2]}")


if __name__ == "__main__":
    main()
