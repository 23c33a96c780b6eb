"""Measure TelemetryWriter: cost of one put on the hot path, and rows/s the drain thread writes.

Run ``python benchmarks/bench_telemetry.py`` (kvpilot installed) or ``python -m
benchmarks.bench_telemetry`` from the repository root. The single-put line floods
requests rows faster than the drain converts them, so the queue fills with Python
rows: with gc on, its max is a gen-2 collection scanning them; with gc off, it is
the longest wait for the GIL the drain thread holds.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable

from serving_hook.telemetry import TelemetryWriter

BATCH = 1_000


def step_row(i: int) -> dict:
    """A typical steps row."""
    return {
        "engine_step": i, "replica": 0, "time_s": i * 0.01, "duration_s": 0.01, "running": 8,
        "waiting": 3, "free_blocks": 900, "pinned_blocks": 4, "kv_usage": 0.55, "prefill_tokens": 512,
        "decode_tokens": 8, "prefix_queries": 4, "prefix_hits": 2, "preemptions": 0, "evictions": 1,
        "hook_fallback": False, "dropped_rows": 0, "model_failures": None,
    }  # fmt: skip


def request_row(i: int) -> dict:
    """A typical requests row with a 64-block hash chain."""
    return {
        "request_id": f"req-{i}", "session_id": f"s-{i // 4}", "group_id": f"g-{i // 16}", "prompt_id": "p",
        "step": 1, "turn": i % 4, "domain": "code", "paradigm": "unit_test_sandbox", "replica": 0,
        "arrival_s": float(i), "first_scheduled_s": i + 0.1, "first_token_s": i + 0.2, "finish_s": i + 3.0,
        "prompt_tokens": 1024, "cached_tokens": 512, "output_tokens": 256, "max_tokens": 2048,
        "finish_reason": "stop", "preemptions": 0, "block_hashes": list(range(i, i + 64)),
    }  # fmt: skip


def put_cost_us(writer: TelemetryWriter, table: str, make: Callable[[int], dict], n: int) -> float:
    """Median over batches of BATCH puts of the per-put wall time, in microseconds."""
    per_put = []
    for start in range(0, n, BATCH):
        batch = [make(i) for i in range(start, start + BATCH)]
        t0 = time.perf_counter_ns()
        for row in batch:
            writer.put(table, row)
        per_put.append((time.perf_counter_ns() - t0) / BATCH / 1e3)
    return statistics.median(per_put)


def put_latency_us(table: str, make: Callable[[int], dict], n: int) -> tuple[float, float, float]:
    """(median, p99, max) of single puts, timed one by one while the drain thread converts and writes."""
    latencies = []
    with tempfile.TemporaryDirectory() as out:
        writer = TelemetryWriter(out, capacity=n, rows_per_file=10_000, flush_interval_s=60.0)
        for i in range(n):
            row = make(i)
            t0 = time.perf_counter_ns()
            writer.put(table, row)
            latencies.append((time.perf_counter_ns() - t0) / 1e3)
        writer.close()
    latencies.sort()
    return statistics.median(latencies), latencies[int(0.99 * n)], latencies[-1]


def drain_rate(table: str, make: Callable[[int], dict], n: int) -> float:
    """Rows/s the drain writes: n rows queued up front (none dropped), timed until close() returns."""
    rows = [make(i) for i in range(n)]
    gc.freeze()  # the prebuilt rows are this benchmark's, not the drain's: keep them out of collections
    with tempfile.TemporaryDirectory() as out:
        writer = TelemetryWriter(out, capacity=n, flush_interval_s=60.0)
        t0 = time.perf_counter()
        for row in rows:
            writer.put(table, row)
        del rows
        writer.close()
        elapsed = time.perf_counter() - t0
        assert writer.dropped == 0 and writer.rows_written[table] == n
    gc.unfreeze()
    return n / elapsed


def main() -> None:
    """Print put cost (accepted, dropped, under a running drain) and drain throughput."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=200_000)
    n = parser.parse_args().rows // BATCH * BATCH

    with tempfile.TemporaryDirectory() as out:
        writer = TelemetryWriter(out, capacity=n, flush_interval_s=60.0)
        accepted = put_cost_us(writer, "steps", step_row, n)
        writer.close()
        dropped = put_cost_us(writer, "steps", step_row, n)  # closed: every put takes the drop path
    print(f"put, accepted: {accepted:.2f} us (median of {n // BATCH} batches of {BATCH})")
    print(f"put, dropped:  {dropped:.2f} us")
    for label in ("gc on", "gc off"):
        if label == "gc off":
            gc.disable()
        median, p99, worst = put_latency_us("requests", request_row, n)
        gc.enable()
        print(
            f"single put, flood of requests rows, {label}: "
            f"median {median:.2f} us, p99 {p99:.2f} us, max {worst / 1e3:.1f} ms"
        )
    for table, make in (("steps", step_row), ("requests", request_row)):
        print(f"drain {table}: {drain_rate(table, make, n):,.0f} rows/s ({n} rows)")


if __name__ == "__main__":
    main()
