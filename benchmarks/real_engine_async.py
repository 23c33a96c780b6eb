"""Asynchronous RL on a real engine: ``kvpilot replay --driver async`` against vLLM's CPU server with the hook.

A held-out agentic mix of several RL steps (the ``agentic`` preset, contexts of at most 4,096 tokens) on
``models/small-llama`` with KV that binds (``--num-gpu-blocks-override``). The server serves ``learned-prior``
of ``--bundle`` (a POLICY_DIR, e.g. ``kvpilot train``'s or the demo's) twice: with the hook's width
(``{"width": true}``) and without. For ``--runs`` rounds it replays the mix synchronously with the trainer
(``--trainer``), and asynchronously (AReaL's capacity rule in the client, ``--staleness``, ``--weight-sync``),
tool waits and the trainer's priced time (H200-7B) scaled by ``--time-scale``. Then ``kvpilot calibrate`` fits
a preset to the server's own steps, and the simulator predicts each arm on it with the same trainer.

Printed side by side: trained trajectories per second (median and spread), the ratio to the synchronous replay,
max staleness, failed requests, held requests, and the simulator's prediction with its ratio to the measurement.

    python -m benchmarks.real_engine_async -o /tmp/rea --bundle DIR [--runs 3] [--time-scale 1]
    python -m benchmarks.real_engine_async -o /tmp/rea --bundle DIR --analyse-only   # calibrate and predict again

Needs ``.venv-engine`` (``make install-engine``). Times are two CPU cores' and a random-weight model's: compare
ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.real_engine import MODEL, SERVER_ARGS, agentic_steps
from tests.engine_server import start_server

#: The arms: (name, server, driver): the synchronous replay and the async one on the width's server, and the async
#: one on the server without it.
ARMS = (("sync", "width", "sync"), ("async + width", "width", "async"), ("async", "no-width", "async"))


def replay_arms(args: argparse.Namespace, workload, longest: int) -> dict[str, list[dict]]:
    """Each arm replayed ``args.runs`` times, one server per setting (its telemetry under ``-o``)."""
    from simulator.config import Trainer
    from training.replay import ReplayConfig, replay
    from training.replay_async import AsyncReplay, trained_replayer

    runs: dict[str, list[dict]] = {name: [] for name, _, _ in ARMS}
    for server_kind in ("width", "no-width"):
        options = {"model": str(args.bundle), "width": server_kind == "width"}
        env = {"KVPILOT_POLICY": "learned-prior", "KVPILOT_POLICY_OPTIONS": json.dumps(options),
               "KVPILOT_TELEMETRY_DIR": str(args.out / server_kind / "telemetry")}
        server_args = (*SERVER_ARGS, "--num-gpu-blocks-override", str(args.kv_blocks), "--max-model-len",
                       str(longest))
        with start_server(args.out / server_kind, env=env, args=server_args, model=args.model) as server:
            for r in range(args.runs):
                for name, kind, driver in ARMS:
                    if kind != server_kind:
                        continue
                    cfg = ReplayConfig(server.url, concurrency=1024, time_scale=args.time_scale, progress=False)
                    spec = AsyncReplay(driver, Trainer(), args.staleness, args.weight_sync)
                    s = replay(workload, cfg, replayer=trained_replayer(spec))
                    runs[name].append(s)
                    print(f"round {r + 1} {name:>14}: {s['trajectories_per_s']:.4f} trajectories/s, "
                          f"{s['replay_s']:.1f} s, {s['failed']} failed, max staleness {s['max_staleness']}",
                          flush=True)
    return runs


def predict(args: argparse.Namespace, workload, preset: Path) -> dict[str, float]:
    """The simulator's trained trajectories per second for each arm, on the calibrated preset."""
    from simulator.config import AsyncRL, Trainer
    from simulator.simulation import run_simulation

    out = {}
    for name, kind, driver in ARMS:
        options = {"model": str(args.bundle), "width": kind == "width"}
        extra = {"async_rl": AsyncRL(args.staleness, args.weight_sync, "staleness")} if driver == "async" else {}
        result = run_simulation(workload, "learned-prior", policy_options=options, preset=str(preset), driver=driver,
                                trainer=Trainer(preset="H200-7B"), time_scale=args.time_scale, progress=False,
                                **extra)
        out[name] = result.summary.to_dict()["trajectories_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--bundle", type=Path, required=True, help="a POLICY_DIR (kvpilot train's policy/)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", type=Path, default=MODEL, help="a config-only model folder")
    ap.add_argument("--kv-blocks", type=int, default=200, help="vLLM blocks of 32 tokens (binds)")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=901)
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--weight-sync", default="keep")
    ap.add_argument("--analyse-only", action="store_true",
                    help="serve nothing: calibrate and simulate again on the runs measured.json in -o holds")
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    from data.io import read_telemetry, write_workload
    from simulator.fitted_cost import write_preset_file
    from simulator.workload import load_workload
    from training.calibrate import CalibrateConfig, calibrate

    wl_path = args.out / "heldout.parquet"
    if not args.analyse_only:  # (the runs analysed again are of the workload they replayed)
        write_workload(agentic_steps(args.seed, args.prompts, args.group_size, args.max_tokens, args.steps), wl_path)
    workload = load_workload(wl_path)
    longest = max(p + o for p, o in zip(workload.prompt_tokens, workload.output_tokens)) + 64
    print(f"held-out mix: {args.steps} steps, {len(workload.sessions)} sessions, {workload.num_rows} requests; KV "
          f"{args.kv_blocks} blocks of 32; time scale {args.time_scale:g}; {args.runs} run(s) per arm", flush=True)
    measured = args.out / "measured.json"
    if args.analyse_only:
        runs = json.loads(measured.read_text())
    else:
        runs = replay_arms(args, workload, longest)
        measured.write_text(json.dumps(runs, indent=1))

    cal = calibrate([args.out / "no-width" / "telemetry"],
                    CalibrateConfig(name=f"cpu-{args.model.name}", workload=wl_path, time_scale=args.time_scale))
    preset = args.out / f"cpu-{args.model.name}.toml"
    write_preset_file(cal.cost, preset, cal.fit_record())
    print(cal.render(), flush=True)
    predicted = predict(args, workload, preset)
    held = [s for s in read_telemetry(args.out / "width" / "telemetry", "requests", ["held_s"]).column(
        "held_s").to_pylist() if s]

    sync = statistics.median(s["trajectories_per_s"] for s in runs["sync"])
    print(f"\n{'arm':>14} {'traj/s':>8} {'spread':>17} {'x sync':>7} {'max stal.':>9} {'failed':>6} "
          f"{'simulated':>9} {'x sync':>7} {'sim/meas':>8}")
    rows = []
    for name, _, _ in ARMS:
        tps = [s["trajectories_per_s"] for s in runs[name]]
        med = statistics.median(tps)
        row = {"arm": name, "median": med, "min": min(tps), "max": max(tps), "x_sync": med / sync,
               "max_staleness": max(s["max_staleness"] for s in runs[name]),
               "failed": sum(s["failed"] for s in runs[name]), "simulated": predicted[name],
               "sim_x_sync": predicted[name] / predicted["sync"], "sim_over_measured": predicted[name] / med}
        rows.append(row)
        print(f"{name:>14} {med:8.4f} {row['min']:8.4f}-{row['max']:<8.4f} {row['x_sync']:7.3f} "
              f"{row['max_staleness']:9d} {row['failed']:6d} {row['simulated']:9.4f} {row['sim_x_sync']:7.3f} "
              f"{row['sim_over_measured']:8.3f}")
    print(f"the width's server held {len(held)} requests, {sum(held):.0f} s in all "
          f"(median {statistics.median(held or [0]):.2f} s)")
    (args.out / "real_engine_async.json").write_text(json.dumps({"rows": rows, "calibration": cal.to_dict()},
                                                                indent=2))


if __name__ == "__main__":
    main()
