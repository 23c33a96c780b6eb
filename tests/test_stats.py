"""Workload statistics: counts, per-domain percentiles, and the unlimited-cache prefix hit fraction."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from data.schemas import WORKLOAD
from data.stats import render_stats, workload_stats


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    """A WORKLOAD table from partial rows: one-turn sessions with defaults for what a test leaves out."""
    full = []
    for i, r in enumerate(rows):
        sid = r.get("session_id", f"s{i}")
        full.append(
            {
                "request_id": f"r{i}", "kind": "rollout", "step": 0, "prompt_id": sid, "group_id": sid,
                "group_size": 1, "sample_index": 0, "session_id": sid, "turn": 0, "domain": "math",
                "paradigm": "math_verifier", "prompt_tokens": 4 * len(r["block_hashes"]), "output_tokens": 1,
                "max_tokens": 100, "finish_reason": "stop", "block_size": 4, **r,
            }
        )
    return pa.Table.from_pylist(full, schema=WORKLOAD.schema)


def test_hand_worked_hit_fraction() -> None:
    # In arrival order (table order is shuffled):
    #   A [1,2,3]    0 hits (nothing seen)
    #   B [1,2,9]    2 hits (1, 2), 9 misses
    #   C [5,2,3]    0 hits: 5 misses, so 2 and 3 do not count although seen
    #   D [1,2,9,7]  3 hits (1, 2, 9), 7 misses
    #   E [8,8]      0 hits: 8 is registered only after E is counted
    # 5 hits of 15 references; B and D hit their first block.
    table = _table(
        [
            {"block_hashes": [1, 2, 9, 7], "arrival_s": 4.0, "domain": "code"},
            {"block_hashes": [1, 2, 3], "arrival_s": 0.0},
            {"block_hashes": [5, 2, 3], "arrival_s": 2.0},
            {"block_hashes": [8, 8], "arrival_s": 4.0},  # same time as D: table order puts D first
            {"block_hashes": [1, 2, 9], "arrival_s": 1.0},
        ]
    )
    stats = workload_stats(table)
    assert stats["block_references"] == 15
    assert stats["unlimited_cache_hit_fraction"] == pytest.approx(5 / 15)
    assert stats["first_block_shared_fraction"] == pytest.approx(2 / 5)
    assert stats["unique_blocks"] == 7  # 1, 2, 3, 5, 7, 8, 9
    assert (stats["requests"], stats["steps"], stats["groups"], stats["sessions"]) == (5, 1, 5, 5)
    assert stats["domains"]["code"]["requests"] == 1 and stats["domains"]["math"]["requests"] == 4


def test_replay_order_without_arrivals() -> None:
    # [2] hits only if [1, 2] registered block 2 first: step, then turn, order the replay, not the table.
    by_step = _table(
        [
            {"block_hashes": [2], "step": 1, "session_id": "late"},
            {"block_hashes": [1, 2], "step": 0, "session_id": "early"},
        ]
    )
    assert workload_stats(by_step)["unlimited_cache_hit_fraction"] == pytest.approx(1 / 3)
    by_turn = _table(
        [
            {"block_hashes": [2], "turn": 1, "session_id": "s"},
            {"block_hashes": [1, 2], "turn": 0, "session_id": "s"},
        ]
    )
    assert workload_stats(by_turn)["unlimited_cache_hit_fraction"] == pytest.approx(1 / 3)
    by_arrival = _table([{"block_hashes": [2], "arrival_s": 5.0}, {"block_hashes": [1, 2], "arrival_s": 1.0}])
    assert workload_stats(by_arrival)["unlimited_cache_hit_fraction"] == pytest.approx(1 / 3)


def test_counts_percentiles_and_render() -> None:
    rows = [
        {"block_hashes": [10 + i], "prompt_tokens": 4, "output_tokens": o, "session_id": f"g{i // 2}:{i}",
         "group_id": f"g{i // 2}", "group_size": 2, "sample_index": i % 2, "step": i // 4}
        for i, o in enumerate([1, 2, 3, 4, 5, 6, 7, 8])
    ]
    rows.append({"block_hashes": [10, 99], "prompt_tokens": 8, "output_tokens": 9, "session_id": "g0:0",
                 "group_id": "g0", "group_size": 2, "turn": 1})
    rows.append({"block_hashes": [500], "prompt_tokens": 8, "output_tokens": 2, "session_id": "a",
                 "domain": "agentic", "paradigm": "search_tool"})
    stats = workload_stats(_table(rows))
    assert (stats["requests"], stats["steps"], stats["groups"], stats["sessions"]) == (10, 2, 5, 9)
    assert stats["turns"] == pytest.approx(10 / 9) and stats["max_turns"] == 2
    math_out = stats["domains"]["math"]["output_tokens"]  # 1..9, linear interpolation
    assert math_out == {"p50": pytest.approx(5), "p90": pytest.approx(8.2), "p99": pytest.approx(8.92)}
    assert stats["domains"]["agentic"]["prompt_tokens"]["p50"] == 8
    assert stats["unlimited_cache_hit_fraction"] == pytest.approx(1 / 11)  # turn 1 hits block 10 of turn 0
    json.dumps(stats)  # plain JSON types only
    text = render_stats(stats)
    assert "agentic" in text and "math" in text and "0.091" in text


def test_empty_table() -> None:
    stats = workload_stats(WORKLOAD.schema.empty_table())
    assert stats["requests"] == 0 and stats["unlimited_cache_hit_fraction"] == 0.0 and stats["domains"] == {}
    render_stats(stats)


def test_million_block_references_is_fast() -> None:
    rng = np.random.default_rng(0)
    n, per = 10_000, 100
    prefixes = rng.integers(0, 50, n)  # requests sharing one of 50 prefixes of 60 blocks, then their own 40
    shared = prefixes[:, None] * 1000 + np.arange(per)
    own = (np.arange(n)[:, None] + 1) * 10**6 + np.arange(per)
    values = np.where(np.arange(per) < 60, shared, own)
    offsets = pa.array(np.arange(0, n * per + 1, per, dtype=np.int32))
    hashes = pa.ListArray.from_arrays(offsets, pa.array(values.ravel()))
    base = _table([{"block_hashes": [0]}]).to_pylist()[0]
    columns = {name: [base[name]] * n for name in WORKLOAD.schema.names}
    columns.update(request_id=[f"r{i}" for i in range(n)], session_id=[f"s{i}" for i in range(n)],
                   group_id=[f"s{i}" for i in range(n)], prompt_tokens=[4 * per] * n)
    table = pa.table(columns, schema=WORKLOAD.schema).set_column(
        WORKLOAD.schema.get_field_index("block_hashes"), "block_hashes", hashes
    )
    start = time.perf_counter()
    stats = workload_stats(table)
    elapsed = time.perf_counter() - start
    assert stats["block_references"] == n * per
    distinct = len(np.unique(prefixes)) * 60 + n * 40
    assert stats["unlimited_cache_hit_fraction"] == pytest.approx(1 - distinct / (n * per))
    assert elapsed < 10, f"stats took {elapsed:.1f}s on 1M block references"


def test_hand_worked_hit_fraction_with_outputs() -> None:
    # Block size 16. Session s: turn 0 (40 prompt, 30 out) [1,2,3], turn 1 (80 prompt) [1,2,10,11,12];
    # sibling t (40 prompt, 20 out) [1,2,3]. Replay order: s/t0, t, s/t1.
    # Prompt chains only: t hits 3 (1, 2 and the shared partial block 3), s/t1 hits 2 (1, 2): 5 of 11.
    # With outputs: s/t0 computed 40 + 30 - 1 = 69 tokens, so it also registers its stream's blocks 2 and 3
    # (hashes 10, 11 of the longest prompt's chain, tokens [32, 64)); t's output lies past every prompt of its
    # stream. s/t1 now hits 1, 2, 10, 11: 7 of 11.
    base = {"block_size": 16, "prompt_id": "p", "group_id": "g"}
    table = _table(
        [
            {**base, "session_id": "s", "block_hashes": [1, 2, 3], "prompt_tokens": 40, "output_tokens": 30,
             "tool": "search", "tool_latency_s": 0.1, "tool_tokens": 10, "finish_reason": "tool_call"},
            {**base, "session_id": "t", "block_hashes": [1, 2, 3], "prompt_tokens": 40, "output_tokens": 20},
            {**base, "session_id": "s", "turn": 1, "block_hashes": [1, 2, 10, 11, 12], "prompt_tokens": 80,
             "output_tokens": 5},
        ]
    )
    stats = workload_stats(table)
    assert stats["unlimited_cache_hit_fraction"] == pytest.approx(5 / 11)
    assert stats["unlimited_cache_hit_fraction_with_outputs"] == pytest.approx(7 / 11)
    # With 24 output tokens s/t0 computes 40 + 24 - 1 = 63 tokens: block 3 ([48, 64)) is not whole, so s/t1
    # hits 1, 2, 10 only (vLLM never computes the last sampled token).
    rows = table.to_pylist()
    rows[0]["output_tokens"] = 24
    short = workload_stats(pa.Table.from_pylist(rows, schema=WORKLOAD.schema))
    assert short["unlimited_cache_hit_fraction_with_outputs"] == pytest.approx(6 / 11)


def test_with_outputs_equals_plain_on_single_turn_workloads() -> None:
    table = _table([{"block_hashes": [1, 2, 3], "output_tokens": 50}, {"block_hashes": [1, 2, 4]},
                    {"block_hashes": [1, 5]}])
    stats = workload_stats(table)
    assert stats["unlimited_cache_hit_fraction_with_outputs"] == stats["unlimited_cache_hit_fraction"] == 3 / 8
