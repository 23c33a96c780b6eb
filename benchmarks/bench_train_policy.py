"""Benchmark: wall and CPU time of ``kvpilot train policy`` on given logs (issue #7: under 10 minutes on 2 cores
for the logs of 10 simulated RL steps).

Runs the command as a child process (``python -m training.cli train policy``), so the times include the imports,
loading the logs, fitting and the held-out OPE, exactly as a user runs it; CPU time is the child's user + system
time. Also prints the size of the logs (decisions and candidate rows) and the command's own split
(``data.load_s``, ``train.total_s``).

Make 10-step logs (CPU-heavy; once): a TOML with ``steps = 10`` to ``workload synth --config``, then
``simulate --policy logging --decode-stride 8 --kv-fraction 0.2`` and ``train predictors --no-reuse``.

Run: ``python -m benchmarks.bench_train_policy --logs RUN_DIR --predictors MODEL_DIR [--config JSON]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 600.0  # issue #7's target: 10 minutes


def log_size(log_dir: Path) -> tuple[int, int]:
    """(decisions, candidate rows) in a run's decisions telemetry."""
    import pyarrow.compute as pc

    from data.io import read_telemetry
    from predictors.logs import telemetry_dir

    d = read_telemetry(telemetry_dir(log_dir), "decisions", columns=["candidate_ids"])
    return d.num_rows, int(pc.sum(pc.list_value_length(d.column("candidate_ids"))).as_py() or 0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--logs", type=Path, nargs="+", required=True)
    ap.add_argument("--predictors", type=Path, required=True)
    ap.add_argument("--config", default=None, help="JSON object of OfflineConfig fields")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    for p in a.logs:
        n, rows = log_size(p)
        print(f"log {p}: {n:,} decisions, {rows:,} candidate rows")
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-train-") as tmp:
        cmd = [sys.executable, "-m", "training.cli", "train", "policy", "--predictors", str(a.predictors),
               "-o", str(Path(tmp) / "policy"), "--json", "--no-progress"]
        for p in a.logs:
            cmd += ["--logs", str(p)]
        if a.config:
            cmd += ["--config", a.config]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=os.environ.copy())
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        sys.exit(f"train policy failed ({out.returncode}):\n{out.stderr[-3000:]}")
    m = json.loads(out.stdout)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"train policy: wall {wall:.1f} s, CPU {cpu:.1f} s (user+sys); inside: load {m['data.load_s']:.1f} s, "
          f"total {m['train.total_s']:.1f} s; decisions train {m['data.decisions_train']:.0f}, "
          f"held out {m['data.decisions_test']:.0f}")
    print(f"target (issue #7): under {LIMIT_S / 60:.0f} minutes on 2 cores: {'met' if wall < LIMIT_S else 'NOT met'}")


if __name__ == "__main__":
    main()
