"""Measured vs simulated: one agentic RL step replayed on a real GPU vLLM server, beside the simulator's makespan.

For each case the script starts ``vllm serve`` on a real architecture (Qwen2.5-7B's ``config.json``, written
here; ``--load-format dummy``: random weights, no download; ``--skip-tokenizer-init``: prompts as token ids)
with the kvpilot hook, replays the workload with ``kvpilot replay`` (:mod:`training.replay`), stops the
server, and simulates the same workload with the same policy on the cost-model preset (``--preset``). It
prints the measured and simulated makespans and their ratio: the cost model's calibration on that GPU. Then
``kvpilot calibrate`` fits a preset to the ``vllm-default`` case's own steps and client round trips (its
telemetry and the workload replayed), and the cases without the tier are simulated on that preset too (a fitted
preset has no host tier).

Cases: ``vllm-default`` (the hook, zero-cost), ``vllm-offload`` (vLLM's native CPU offload,
``--kv-offloading-size``) and ``champion`` (policy ``registry`` serving ``models:/kvpilot@champion`` over the
offload tier; skipped when the registry, ``MLFLOW_TRACKING_URI``, has none).

    python benchmarks/gpu_replay.py                      # on a GPU machine, the project's venv (vLLM 0.33)
    python benchmarks/gpu_replay.py --dry-run --prompts 2   # anywhere: workload, commands, simulations only

Not run on a GPU in the session that wrote it (no device was lent); the dry path was run on a CPU, and the
calibration step on the CPU server's telemetry (benchmarks/real_engine.py's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Qwen2.5-7B's architecture (its Hugging Face config.json), the simulator's ``*-7B`` presets' model; the
#: position limit is the 128k the model card reaches with YaRN, since agentic sessions outgrow 32k.
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "bos_token_id": 151643, "eos_token_id": 151643,
}
CASES = {
    # case: (KVPILOT_POLICY, uses the offload tier)
    "vllm-default": ("vllm-default", False),
    "vllm-offload": ("vllm-offload", True),
    "champion": ("registry", True),
}


def workload_file(out: Path, prompts: int, seed: int) -> Path:
    """One agentic RL step (the ``agentic`` preset: long-horizon sessions with tool calls)."""
    from data.io import write_workload
    from data.synth import SynthConfig, generate

    cfg = dataclasses.replace(SynthConfig.preset("agentic"), steps=1, prompts_per_step=prompts, seed=seed)
    path = out / "workload.parquet"
    write_workload(generate(cfg), path)
    return path


def model_dir(out: Path) -> Path:
    d = out / "qwen2.5-7b-config"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(QWEN25_7B, indent=1))
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model: Path, port: int, max_len: int, offload_gib: float, offload: bool) -> list[str]:
    cmd = ["vllm", "serve", str(model), "--load-format", "dummy", "--skip-tokenizer-init", "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(max_len), "--enable-prompt-tokens-details",
           "--served-model-name", "qwen2.5-7b-dummy", "--scheduler-cls", "serving_hook.KVPilotAsyncScheduler"]
    if offload:
        cmd += ["--kv-offloading-size", f"{offload_gib:g}"]
    return cmd


def run_server_case(cmd: list[str], env: dict[str, str], log: Path, workload: Any, time_scale: float,
                    start_timeout_s: float) -> dict[str, Any]:
    """Start the server, wait for /health, replay, stop it (SIGTERM); the replay's summary."""
    import httpx

    from training.replay import ReplayConfig, replay

    url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start in {start_timeout_s:.0f} s; see {log}")
            time.sleep(2)
        return replay(workload, ReplayConfig(url, concurrency=512, time_scale=time_scale, progress=False))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def simulate(workload: Any, policy: str, preset: str, offload_gib: float, offload: bool,
             time_scale: float = 1.0) -> Optional[float]:
    """The simulator's mean step makespan for the same workload, policy and time scale (None: it cannot run, e.g.
    no champion in the registry)."""
    from simulator.config import SimulationError
    from simulator.simulation import run_simulation

    try:
        result = run_simulation(workload, policy, preset=preset, offload_gib=offload_gib if offload else 0.0,
                                progress=False, time_scale=time_scale)
    except (SimulationError, ValueError) as e:
        print(f"  simulation of {policy} skipped: {e}", file=sys.stderr)
        return None
    return float(result.summary.metrics.makespan_s)


def champion_missing() -> Optional[str]:
    """Why the ``champion`` case cannot run (no registry, no champion in it), or None."""
    from serving_hook import model_registry

    if not os.environ.get("MLFLOW_TRACKING_URI") and not Path(model_registry.DB_FILE).exists():
        return f"no MLflow registry (MLFLOW_TRACKING_URI unset and no ./{model_registry.DB_FILE})"
    uri = os.environ.get("KVPILOT_MODEL_URI", model_registry.DEFAULT_MODEL_URI)
    try:
        model_registry.resolve_version(uri)
    except model_registry.RegistryError as e:
        return str(e)
    return None


def calibrate_on(out: Path, wl_path: Path, workload: Any, rows: list[dict], args: argparse.Namespace) -> None:
    """``kvpilot calibrate`` on the measured ``vllm-default`` case (its steps, and the client's round trips on the
    workload replayed); each case without the tier simulated again on that preset (``calibrated_makespan_s``)."""
    from simulator.fitted_cost import write_preset_file
    from training.calibrate import CalibrateConfig, calibrate

    base = next((r for r in rows if r["case"] == "vllm-default" and r["measured_makespan_s"]), None)
    if base is None:
        print("\ncalibration: needs a measured vllm-default case (not with --dry-run)", flush=True)
        return
    cal = calibrate([out / "telemetry-vllm-default"],
                    CalibrateConfig(name="gpu-calibrated", workload=wl_path, time_scale=args.time_scale))
    preset = out / "gpu-calibrated.toml"
    write_preset_file(cal.cost, preset, cal.fit_record())
    print(f"\ncalibrated on vllm-default's steps ({preset}):\n{cal.render()}", flush=True)
    for r in rows:
        if not r["offload"]:
            r["calibrated_makespan_s"] = simulate(workload, r["policy"], str(preset), 0.0, False, args.time_scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", type=Path, help="A workload file (default: one synthetic agentic step).")
    ap.add_argument("--prompts", type=int, default=16, help="Prompts of the synthetic step (x8 samples each).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="H200-7B", help="The simulator's cost-model preset for this GPU and model.")
    ap.add_argument("--offload-gib", type=float, default=64.0, help="Host memory of the CPU offload tier.")
    ap.add_argument("--cases", default=",".join(CASES), help="Comma-separated: " + ", ".join(CASES))
    ap.add_argument("--time-scale", type=float, default=1.0, help="Factor on tool and verifier latencies.")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="Seconds a server may take to start.")
    ap.add_argument("--out", type=Path, default=None, help="Working folder (default: a temporary one).")
    ap.add_argument("--dry-run", action="store_true", help="No server: the workload, the commands and the "
                    "simulations only (runs on a CPU).")
    args = ap.parse_args()
    from simulator.workload import load_workload

    out = args.out or Path(tempfile.mkdtemp(prefix="kvpilot-gpu-replay-"))
    out.mkdir(parents=True, exist_ok=True)
    wl_path = args.workload or workload_file(out, args.prompts, args.seed)
    workload = load_workload(wl_path)
    model = model_dir(out)
    max_len = min(QWEN25_7B["max_position_embeddings"], workload.largest_request + 64)
    if workload.largest_request > QWEN25_7B["max_position_embeddings"]:
        sys.exit(f"the workload's longest request ({workload.largest_request} tokens) exceeds the model's "
                 f"{QWEN25_7B['max_position_embeddings']}")
    print(f"workload {wl_path}: {workload.num_rows} requests, {len(workload.sessions)} trajectories; "
          f"preset {args.preset}; working folder {out}")
    rows = []
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for case in cases:
        if case not in CASES:
            sys.exit(f"unknown case {case!r}; known: {', '.join(CASES)}")
        policy, offload = CASES[case]
        if policy == "registry" and (why := champion_missing()) is not None:
            print(f"\n[{case}] skipped: {why}", flush=True)
            continue
        cmd = server_command(model, free_port(), max_len, args.offload_gib, offload)
        env = dict(os.environ, KVPILOT_POLICY=policy, PYTHONPATH=str(ROOT), VLLM_SERVER_DEV_MODE="1")
        if case == "vllm-default" and not args.dry_run:  # the calibration's steps; the other cases log nothing
            shutil.rmtree(out / "telemetry-vllm-default", ignore_errors=True)
            env["KVPILOT_TELEMETRY_DIR"] = str(out / "telemetry-vllm-default")
        if policy == "registry":
            env.setdefault("KVPILOT_MODEL_URI", "models:/kvpilot@champion")
        print(f"\n[{case}] KVPILOT_POLICY={policy} {' '.join(cmd)}", flush=True)
        measured = None
        if not args.dry_run:
            summary = run_server_case(cmd, env, out / f"server-{case}.log", workload, args.time_scale,
                                      args.start_timeout)
            measured = summary["makespan_s"]
            print(f"  measured: makespan {measured:.2f} s, {summary['requests']} requests "
                  f"({summary['failed']} failed), hit rate {summary['prefix_hit_rate']:.3f}, "
                  f"{summary['preemptions']} preemptions", flush=True)
        simulated = simulate(workload, policy, args.preset, args.offload_gib, offload, args.time_scale)
        rows.append({"case": case, "policy": policy, "offload": offload, "measured_makespan_s": measured,
                     "simulated_makespan_s": simulated,
                     "measured_over_simulated": measured / simulated if measured and simulated else None})
    (out / "gpu_replay.json").write_text(json.dumps(rows, indent=2))  # the measured runs, before anything can fail
    try:
        calibrate_on(out, wl_path, workload, rows, args)
    except (OSError, ValueError) as e:  # CalibrationError and PresetFileError are ValueErrors
        print(f"\ncalibration failed: {e}", flush=True)
    print("\ncase           measured_s  simulated_s  measured/simulated  calibrated_s  measured/calibrated")
    for r in rows:
        m, s, q = r["measured_makespan_s"], r["simulated_makespan_s"], r["measured_over_simulated"]
        c = r.get("calibrated_makespan_s")
        print(f"{r['case']:<14} {'-' if m is None else f'{m:.2f}':>10}  {'-' if s is None else f'{s:.2f}':>11}  "
              f"{'-' if q is None else f'{q:.3f}':>18}  {'-' if c is None else f'{c:.2f}':>12}  "
              f"{'-' if not (m and c) else f'{m / c:.3f}':>19}")
    (out / "gpu_replay.json").write_text(json.dumps(rows, indent=2))
    print(f"\n{out / 'gpu_replay.json'}")


if __name__ == "__main__":
    main()
