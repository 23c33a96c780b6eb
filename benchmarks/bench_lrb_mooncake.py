"""Learned eviction on the Mooncake trace: ``lrb-online`` beside LRU (vLLM default) and block-level Belady.

Replays ``../shared/traces/mooncake/synthetic_trace.jsonl`` on one replica with a
KV cache of ``--kv-share`` (default 5%) of the trace's unique blocks: the
distinct ``hash_ids`` (512-token blocks, as ``data.stats`` counts them; 43,924
for the whole trace), times 512/16 in vLLM's 16-token blocks, plus vLLM's null
block (whole trace: 0.05 x 43,924 x 32 = 70,278 + 1 = 70,279 blocks). When the
largest request needs more, the KV is raised to that (smallest feasible) size
and the table says so. Prints each policy's prefix hit rate, the fraction of
the LRU -> Belady hit-rate gap that ``lrb-online`` closes (target >= 0.5),
wall and CPU times, and ``lrb-online``'s retraining count and times and
scoring time per eviction call. Belady is the hindsight oracle's eviction in
block mode (``eviction="block"``, ``admission="fcfs"``: vLLM's order), so the
three differ only in what they evict. ``--start S --requests N`` replays a
window of N requests from the S-th (arrival times shifted to start at 0).

With ``--out DIR`` (keep it outside the repository, e.g. ``/work/i-out``),
each policy's row is saved as ``DIR/mooncake-<start>-<requests>-<share>-<policy>.json``
and a row already there is reused instead of replayed (``--rerun`` replays
anyway), so the policies can be replayed one at a time and tabled together.

    python -m benchmarks.bench_lrb_mooncake [--start S] [--requests N] [--kv-share 0.05] [--policies a,b] \
        [--lrb-options JSON] [--out DIR [--rerun]] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    from simulator.workload import PreparedWorkload

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "mooncake" / "synthetic_trace.jsonl"
POLICIES = ("vllm-default", "oracle", "lrb-online")


def kv_blocks_for(workload: PreparedWorkload, share: float) -> dict:
    """The KV size: ``share`` of the unique workload blocks in vLLM blocks + null, or the largest request's need."""
    from data.stats import workload_stats
    from simulator.sizing import NULL_BLOCKS, min_blocks_for
    from simulator.tokens import VLLM_BLOCK_SIZE

    unique = workload_stats(workload.table)["unique_blocks"]
    bs = workload.tokens.block_size
    target = int(share * unique * bs / VLLM_BLOCK_SIZE) + NULL_BLOCKS
    need = min_blocks_for(workload)
    return {"kv_blocks": max(target, need), "kv_target_blocks": target, "unique_blocks": unique,
            "trace_block_tokens": bs, "largest_request_blocks": need, "raised_to_fit": need > target}


def make_policy(name: str, workload: pa.Table, lrb_options: dict | None = None):
    """A fresh policy instance (kept, to read lrb-online's counters after the run)."""
    from policy.baselines.lrb_online import OnlineLrbEvictionPolicy
    from policy.baselines.oracle import HindsightOraclePolicy
    from policy.vllm_default import VllmDefaultPolicy

    if name == "oracle":
        p = HindsightOraclePolicy(admission="fcfs", eviction="block", workload=workload)
        p.decision_budget_s = None  # the simulator's budget, as for the others (its own 0.1 s would fall back to LRU)
        p.uses_retention = False  # eviction only: its pins need tool pauses, which Mooncake has none of
        return p
    if name == "lrb-online":
        return OnlineLrbEvictionPolicy(**(lrb_options or {}))
    return VllmDefaultPolicy()


def window(workload: pa.Table, start: int, requests: int | None) -> pa.Table:
    """Requests ``start .. start + requests`` (in arrival order), their arrival times shifted to start at 0."""
    import pyarrow.compute as pc

    w = workload.slice(start, requests)
    if start:
        arrival = w.column("arrival_s")
        w = w.set_column(w.schema.get_field_index("arrival_s"), "arrival_s",
                         pc.subtract(arrival, pc.min(arrival)))
    return w


def row_path(out_dir: Path, start: int, requests: int | None, share: float, policy: str) -> Path:
    return out_dir / f"mooncake-{start}-{requests or 'all'}-{share:g}-{policy}.json"


def replay(workload: PreparedWorkload, name: str, kv: int, lrb_options: dict | None) -> dict:
    """One policy's replay: hit rate, times and (lrb-online) the learner's counters."""
    from simulator.simulation import run_simulation

    policy = make_policy(name, workload.table, lrb_options)
    t0, c0 = time.perf_counter(), time.process_time()
    res = run_simulation(workload, policy, kv_blocks=kv, progress=False)
    m = res.summary.metrics
    row = {"policy": name, "prefix_hit_rate": m.prefix_hit_rate, "wall_s": time.perf_counter() - t0,
           "cpu_s": time.process_time() - c0, "makespan_s": m.makespan_s, "recomputed_tokens": m.recomputed_tokens}
    if name == "lrb-online":
        row["learner"] = policy.summary()
        row["lrb_options"] = lrb_options or {}
    return row


def run(requests: int | None, share: float, policies: tuple[str, ...] = POLICIES, lrb_options: dict | None = None,
        start: int = 0, out_dir: Path | None = None, rerun: bool = False) -> dict:
    from data.importers import import_mooncake
    from simulator.workload import prepare_workload

    workload = prepare_workload(window(import_mooncake(TRACE).table, start, requests))
    kv = kv_blocks_for(workload, share)
    out: dict = {"start": start, "requests": workload.num_rows, "kv_share": share, **kv, "rows": []}
    for name in POLICIES:
        path = row_path(out_dir, start, requests, share, name) if out_dir is not None else None
        if name in policies and (rerun or path is None or not path.exists()):
            row = replay(workload, name, kv["kv_blocks"], lrb_options)
            print(f"{name}: hit rate {row['prefix_hit_rate']:.4f} in {row['wall_s']:.0f} s "
                  f"({row['cpu_s']:.0f} s CPU)", file=sys.stderr, flush=True)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(row, indent=2))
        elif path is not None and path.exists():
            row = json.loads(path.read_text())
        else:
            continue
        out["rows"].append(row)
    hit = {r["policy"]: r["prefix_hit_rate"] for r in out["rows"]}
    gap = hit["oracle"] - hit["vllm-default"] if {"oracle", "vllm-default"} <= set(hit) else None
    out["gap"] = gap
    out["gap_closed"] = ((hit["lrb-online"] - hit["vllm-default"]) / gap
                         if gap and gap > 0 and "lrb-online" in hit else None)
    return out


def render(out: dict) -> str:
    fit = " (raised: the largest request did not fit)" if out["raised_to_fit"] else ""
    lines = [f"Mooncake trace, {out['requests']} requests from #{out['start']}: KV {out['kv_blocks']:,} vLLM blocks"
             f"{fit} = {out['kv_share']:.0%} of {out['unique_blocks']:,} unique {out['trace_block_tokens']}-token "
             f"blocks ({out['kv_target_blocks']:,} incl. the null block); largest request "
             f"{out['largest_request_blocks']:,} blocks",
             f"{'policy':<14}{'hit rate':>10}{'wall s':>9}{'CPU s':>8}{'makespan s':>12}{'recomputed':>14}"]
    for r in out["rows"]:
        name = {"vllm-default": "LRU (vLLM)", "oracle": "Belady"}.get(r["policy"], r["policy"])
        lines.append(f"{name:<14}{r['prefix_hit_rate']:>10.4f}{r['wall_s']:>9.0f}{r.get('cpu_s', float('nan')):>8.0f}"
                     f"{r['makespan_s']:>12.1f}{r['recomputed_tokens']:>14,}")
    if out["gap"] is not None:
        closed = f"{out['gap_closed']:.2f}" if out["gap_closed"] is not None else "n/a"
        lines.append(f"gap LRU -> Belady: {out['gap']:+.4f}; closed by lrb-online: {closed} (target >= 0.5)")
    lr = next((r["learner"] for r in out["rows"] if r["policy"] == "lrb-online"), None)
    if lr is None:
        return "\n".join(lines)
    lines.append(f"lrb-online: {lr['retrains']} retrains ({lr['train_failures']} failed), retrain mean "
                 f"{lr['retrain_mean_s'] * 1e3:.1f} ms, max {lr['retrain_max_s'] * 1e3:.1f} ms, total "
                 f"{lr['retrain_total_s']:.1f} s; scoring {lr['score_mean_s'] * 1e3:.2f} ms per eviction call "
                 f"({lr['score_calls']} calls); bookkeeping {lr['observe_mean_s'] * 1e3:.2f} ms per call; "
                 f"{lr['labels']} labels ({lr['positives']} positive); {lr['lru_calls']} LRU calls during warm-up")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=None, help="replay only N requests (default: all)")
    ap.add_argument("--start", type=int, default=0, help="first request replayed (arrival times shifted to 0)")
    ap.add_argument("--kv-share", type=float, default=0.05, help="KV size as a share of the unique blocks")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma list, a subset of the three")
    ap.add_argument("--lrb-options", default="{}", help="JSON keyword options for lrb-online")
    ap.add_argument("--out", type=Path, default=None, help="save (and reuse) each policy's row here (outside the repo)")
    ap.add_argument("--rerun", action="store_true", help="replay the policies asked even when --out has their row")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    if not TRACE.exists():
        print(f"skipped: the Mooncake trace is not at {TRACE.resolve()} (../shared/traces is absent)")
        return 0
    names = tuple(n for n in args.policies.split(",") if n)
    if not set(names) <= set(POLICIES):
        ap.error(f"--policies: choose among {', '.join(POLICIES)}")
    out = run(args.requests, args.kv_share, names, json.loads(args.lrb_options), args.start, args.out, args.rerun)
    print(json.dumps(out, indent=2) if args.json else render(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
