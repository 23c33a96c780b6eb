"""Run one small ``kvpilot evaluate --policies all`` grid on two trees and check that every summary is identical.

For refactors that must not change behaviour: the working tree (or ``--tree DIR``) against a git revision
(``--base REV``, checked out into a temporary worktree), both with this interpreter's packages, on one
workload generated once by the base tree. Every summary key the base reports, but the wall-clock timings,
must be equal case by case; a difference prints the case, the key and both values, and the exit status is 1.
Keys only the new tree reports (new metrics) are listed, not compared.

    python -m benchmarks.compare_revisions --base 8f6f79e
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: Wall-clock measurements of the machine, not results of the simulation.
TIMING_KEYS = frozenset({"wall_s", "scheduler_s", "hook_s", "router_s", "simulator_overhead", "setup_s"})

#: Small enough for a few minutes on 2 cores, large enough that every lever acts (preemption at KV 0.2,
#: multi-turn tool pauses, scoring, two RL steps, two replicas).
WORKLOAD_CONFIG = """
seed = 7
steps = 2
prompts_per_step = 6
group_size = 4
"""


def _run(tree: Path, args: list[str], log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "training.cli", *args], cwd=tree, env=env, stdout=f,
                              stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: kvpilot {' '.join(args)} failed (exit {proc.returncode}); see {log}")


def _rows(path: Path) -> dict[str, dict[str, Any]]:
    rows = json.loads(path.read_text())
    return {f"{r['policy']}-kv{r['kv_fraction']}-r{r['replicas']}": r for r in rows}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare(base_rows: dict[str, dict[str, Any]], new_rows: dict[str, dict[str, Any]]
            ) -> tuple[list[str], set[str], list[str]]:
    """Every difference between two evaluations' rows, timings excluded, as readable lines; the keys only
    the new rows have (new metrics, not changed results); and the cases only the new tree runs (new policies
    in ``all``, not compared). A case only the base runs is a difference."""
    diffs = []
    added: set[str] = set()
    new_cases = []
    for case in sorted(set(base_rows) | set(new_rows)):
        a, b = base_rows.get(case), new_rows.get(case)
        if a is None:
            new_cases.append(case)
            continue
        if b is None:
            diffs.append(f"{case}: only in base")
            continue
        added |= set(b) - set(a)
        for key in sorted(set(a) - TIMING_KEYS):
            if not _same(a.get(key), b.get(key)):
                diffs.append(f"{case}: {key}: base {a.get(key)!r} != new {b.get(key)!r}")
    return diffs, added, new_cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the tree under test (default: this checkout)")
    ap.add_argument("--kv-fractions", default="0.2,0.6")
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--new-args", default="",
                    help="extra evaluate options for the new tree only, e.g. '--keep-cache-across-steps' to switch "
                         "off a behaviour the base did not have")
    ap.add_argument("--keep", type=Path,
                    help="keep both evaluations under this folder; a base evaluation already there is reused")
    a = ap.parse_args(argv)
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="kvpilot-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    base_tree = work / "base-tree"
    if not base_tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_tree), a.base], check=True,
                       stdout=subprocess.DEVNULL)
    try:
        cfg = work / "workload.toml"
        cfg.write_text(WORKLOAD_CONFIG)
        wl = work / "workload.parquet"
        if not wl.exists():
            _run(base_tree, ["workload", "synth", "--config", str(cfg), "-o", str(wl)], work / "synth.log")
        grid = ["evaluate", "-w", str(wl), "--policies", "all", "--kv-fractions", a.kv_fractions,
                "--replicas", a.replicas, "--router", "kv-aware", "--jobs", str(a.jobs)]
        results = {}
        for name, tree in (("base", base_tree), ("new", a.tree.resolve())):
            out = work / name
            if name == "base" and (out / "summary.json").exists():
                print(f"reusing the base evaluation in {out}", flush=True)
            else:
                print(f"evaluating {name} ({tree}) ...", flush=True)
                shutil.rmtree(out, ignore_errors=True)
                extra = a.new_args.split() if name == "new" else []
                _run(tree, [*grid, *extra, "-o", str(out)], work / f"{name}.log")
            results[name] = _rows(out / "summary.json")
    finally:
        if not a.keep:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], check=False)
    diffs, added, new_cases = compare(results["base"], results["new"])
    n = len(results["new"])
    errors = [c for c, r in results["new"].items() if r.get("error")]
    for line in diffs:
        print(line)
    if added:
        print(f"keys only the new tree reports (not compared): {', '.join(sorted(added))}")
    if new_cases:
        print(f"{len(new_cases)} cases only the new tree runs (not compared): {', '.join(new_cases)}")
    print(f"{n} cases ({n - len(new_cases)} compared), {len(errors)} failed, {len(diffs)} differences against "
          f"{a.base}")
    return 1 if diffs or errors or n == 0 else 0


if __name__ == "__main__":
    raise SystemExit(main())
