"""Learned eviction on the Mooncake trace: ``lrb-online`` beside LRU (vLLM default) and Belady (the oracle).

Replays ``../shared/traces/mooncake/synthetic_trace.jsonl`` on one replica with a
KV cache of ``--kv-share`` (default 5%) of the trace's unique blocks (the
workload's 512-token blocks, as ``data.stats`` counts them, in vLLM's 16-token
blocks, plus vLLM's null block), raised to the largest request's need when it
is smaller. Prints each policy's prefix hit rate, the fraction of the LRU ->
Belady hit-rate gap that ``lrb-online`` closes (target >= 0.5), wall times,
and ``lrb-online``'s retraining count and times and per-call scoring time.
The oracle runs eviction only (``admission="fcfs"``: vLLM's order), so the
three differ only in what they evict. ``--start S --requests N`` replays a
window of N requests from the S-th (arrival times shifted to start at 0): the
whole trace takes long on a shared machine, and the trace's reuse grows along
it (within its first 600 requests an unlimited cache would hit 11% of prompt
tokens, within its last 600, 67%).

    python -m benchmarks.bench_lrb_mooncake [--start S] [--requests N] [--kv-share 0.05] [--policies a,b] \
        [--lrb-options JSON] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pyarrow as pa

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "mooncake" / "synthetic_trace.jsonl"
POLICIES = ("vllm-default", "oracle", "lrb-online")


def kv_blocks_for(workload: pa.Table, share: float) -> tuple[int, int, int]:
    """(KV blocks used, ``share`` of the unique blocks in vLLM blocks + null, the largest request's need)."""
    from data.stats import workload_stats
    from simulator.sizing import NULL_BLOCKS, min_blocks_for
    from simulator.tokens import VLLM_BLOCK_SIZE

    unique = workload_stats(workload)["unique_blocks"]
    bs = int(workload.column("block_size")[0].as_py())
    target = int(share * unique * bs / VLLM_BLOCK_SIZE) + NULL_BLOCKS
    need = min_blocks_for(workload)
    return max(target, need), target, need


def make_policy(name: str, workload: pa.Table, lrb_options: dict | None = None):
    """A fresh policy instance (kept, to read lrb-online's counters after the run)."""
    from policy.baselines.lrb_online import OnlineLrbEvictionPolicy
    from policy.baselines.oracle import HindsightOraclePolicy
    from policy.vllm_default import VllmDefaultPolicy

    if name == "oracle":
        p = HindsightOraclePolicy(admission="fcfs", workload=workload)
        p.decision_budget_s = None  # the simulator's budget, as for the others (its own 0.1 s would fall back to LRU)
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


def run(requests: int | None, share: float, policies: tuple[str, ...] = POLICIES,
        lrb_options: dict | None = None, start: int = 0) -> dict:
    from data.importers import import_mooncake
    from simulator.simulation import run_simulation

    workload = window(import_mooncake(TRACE).table, start, requests)
    kv, target, need = kv_blocks_for(workload, share)
    out: dict = {"start": start, "requests": workload.num_rows, "kv_share": share, "kv_blocks": kv, "kv_target_blocks": target,
                 "largest_request_blocks": need, "rows": []}
    for name in policies:
        policy = make_policy(name, workload, lrb_options)
        t0 = time.perf_counter()
        res = run_simulation(workload, policy, kv_blocks=kv, progress=False)
        s = res.summary
        row = {"policy": name, "prefix_hit_rate": s["prefix_hit_rate"], "wall_s": time.perf_counter() - t0,
               "makespan_s": s["makespan_s"], "recomputed_tokens": s["recomputed_tokens"]}
        if name == "lrb-online":
            row["learner"] = policy.summary()
        out["rows"].append(row)
        print(f"{name}: hit rate {row['prefix_hit_rate']:.4f} in {row['wall_s']:.0f} s", file=sys.stderr, flush=True)
    hit = {r["policy"]: r["prefix_hit_rate"] for r in out["rows"]}
    gap = hit["oracle"] - hit["vllm-default"] if {"oracle", "vllm-default"} <= set(hit) else 0.0
    out["gap_closed"] = (hit["lrb-online"] - hit["vllm-default"]) / gap if gap > 0 and "lrb-online" in hit else None
    return out


def render(out: dict) -> str:
    lines = [f"Mooncake trace, {out['requests']} requests from #{out['start']}, KV {out['kv_blocks']} blocks "
             f"({out['kv_share']:.0%} of unique blocks = {out['kv_target_blocks']}; largest request "
             f"{out['largest_request_blocks']})",
             f"{'policy':<14}{'hit rate':>10}{'wall s':>9}{'makespan s':>12}{'recomputed':>13}"]
    for r in out["rows"]:
        lines.append(f"{r['policy']:<14}{r['prefix_hit_rate']:>10.4f}{r['wall_s']:>9.1f}{r['makespan_s']:>12.1f}"
                     f"{r['recomputed_tokens']:>13,}")
    if out["gap_closed"] is not None:
        lines.append(f"gap LRU -> Belady closed by lrb-online: {out['gap_closed']:.2f} (target >= 0.5)")
    lr = next((r["learner"] for r in out["rows"] if r["policy"] == "lrb-online"), None)
    if lr is None:
        return "\n".join(lines)
    lines.append(f"lrb-online: {lr['retrains']} retrains ({lr['train_failures']} failed), retrain mean "
                 f"{lr['retrain_mean_s'] * 1e3:.1f} ms, max {lr['retrain_max_s'] * 1e3:.1f} ms; scoring "
                 f"{lr['score_mean_s'] * 1e3:.2f} ms per call ({lr['score_calls']} calls); bookkeeping "
                 f"{lr['observe_mean_s'] * 1e3:.2f} ms per call; {lr['labels']} labels ({lr['positives']} positive); "
                 f"{lr['lru_calls']} LRU calls during warm-up")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=None, help="replay only N requests (default: all)")
    ap.add_argument("--start", type=int, default=0, help="first request replayed (arrival times shifted to 0)")
    ap.add_argument("--kv-share", type=float, default=0.05, help="KV size as a share of the unique blocks")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma list, a subset of the three")
    ap.add_argument("--lrb-options", default="{}", help="JSON keyword options for lrb-online")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    if not TRACE.exists():
        print(f"skipped: the Mooncake trace is not at {TRACE.resolve()} (../shared/traces is absent)")
        return 0
    names = tuple(n for n in args.policies.split(",") if n)
    if not set(names) <= set(POLICIES):
        ap.error(f"--policies: choose among {', '.join(POLICIES)}")
    out = run(args.requests, args.kv_share, names, json.loads(args.lrb_options), args.start)
    print(json.dumps(out, indent=2) if args.json else render(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
