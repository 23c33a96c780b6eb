"""Benchmark: does the hook keep the GIL? Its time per step alone and beside a thread that wants the GIL.

Inside vLLM's engine core the API server's socket threads wait for the GIL. A hook that releases it (numpy's sorts
and ``arange`` do, whatever the array's size) hands it to them for up to a switch interval (5 ms) before the
scheduler gets it back; on vLLM's CPU server such a release cost the learned policy up to 3 ms in one step in twenty.
Here each policy simulates one agentic step twice on vLLM's real scheduler: alone, and with a Python thread that
always wants the GIL. Code that keeps the GIL runs about twice as long beside it (the two threads alternate every
switch interval); every release adds up to a whole interval, so a hook that releases it shows a ratio well above 2
and a long tail.

    python -m benchmarks.bench_gil --model POLICY_DIR [--policies vllm-default,sjf-predicted,learned-prior]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
from pathlib import Path


def hook_times(workload, policy: str, options: dict | None, engine: dict, out: Path) -> list[float]:
    """The hook's time in each step of one simulation (the steps telemetry)."""
    from data.io import read_telemetry
    from simulator.simulation import run_simulation

    run_simulation(workload, policy, policy_options=options, progress=False, out_dir=out, **engine)
    return read_telemetry(out / "telemetry", "steps", ["hook_s"]).column("hook_s").to_pylist()


def contended(fn, *args):
    """``fn(*args)``, run while another thread spins in Python (it always wants the GIL)."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        return fn(*args)
    finally:
        stop.set()
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a trained POLICY_DIR: the learned rows, and the rules' lengths")
    ap.add_argument("--policies", default="vllm-default,sjf-predicted,learned-prior,learned")
    ap.add_argument("--preset", default="H200-7B", help="a preset name, or a file (`kvpilot calibrate`'s: its KV)")
    ap.add_argument("--kv-fraction", type=float, default=0.05, help="a named preset's KV share (memory binds)")
    ap.add_argument("--seed", type=int, default=811)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from benchmarks.real_engine import agentic_steps, rule
    from simulator.workload import prepare_workload

    workload = prepare_workload(agentic_steps(args.seed, 8, 4, 256))
    print(f"{'policy':>16} {'alone ms/step':>13} {'p99':>6} {'contended':>9} {'p99':>6} {'ratio':>6} "
          f"{'steps > 4 ms':>12}")
    with tempfile.TemporaryDirectory(prefix="kvpilot-gil-") as tmp:
        for name in [p.strip() for p in args.policies.split(",") if p.strip()]:
            if name.startswith("learned"):
                if args.model is None:
                    print(f"{name:>16}  (needs --model)")
                    continue
                policy, options = name, {"model": str(args.model)}
            else:
                how = rule(name, str(args.model / "predictors") if args.model else "domain-mean")
                policy, options = how.policy, how.sim_options
            named = {} if Path(args.preset).is_file() else {"kv_fraction": args.kv_fraction}
            engine = {"preset": args.preset, **named}
            run = (workload, policy, options, engine)
            alone = hook_times(*run, Path(tmp) / f"{name}-alone")
            busy = contended(hook_times, *run, Path(tmp) / f"{name}-busy")
            a, b = statistics.fmean(alone), statistics.fmean(busy)
            q = statistics.quantiles
            print(f"{name:>16} {a * 1e3:13.3f} {q(alone, n=100)[98] * 1e3:6.2f} {b * 1e3:9.3f} "
                  f"{q(busy, n=100)[98] * 1e3:6.2f} {b / a:6.2f} {sum(t > 4e-3 for t in busy) / len(busy):12.1%}",
                  flush=True)


if __name__ == "__main__":
    main()
