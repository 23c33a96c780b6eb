"""Run summary metrics on a hand-built run: every value worked out by hand."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from data.schemas import REQUESTS, STEPS, WORKLOAD
from simulator.metrics import StepRecord, TrajectoryRecord, summarize
from simulator.summary import render_metrics
from simulator.workload import PreparedWorkload, prepare_workload

REQUESTS_SCHEMA = REQUESTS.schema if "computed_tokens" in REQUESTS.schema.names else REQUESTS.schema.append(
    pa.field("computed_tokens", pa.int32(), nullable=False))


def _workload() -> PreparedWorkload:
    """Group g (step 0): session s, turns (40 prompt, 30 out, 10 tool) and (80, 5); session t (40, 20).
    Group h (step 1): session u (20, 4)."""
    base = {"kind": "rollout", "prompt_id": "p", "group_size": 2, "sample_index": 0, "domain": "math",
            "paradigm": "math_verifier", "max_tokens": 100, "finish_reason": "stop", "block_size": 16}
    names = ("request_id", "step", "group_id", "session_id", "turn", "prompt_tokens", "output_tokens", "block_hashes")
    rows = [
        ("r0", 0, "g", "s", 0, 40, 30, [1, 2, 3]),
        ("r1", 0, "g", "t", 0, 40, 20, [1, 2, 3]),
        ("r2", 0, "g", "s", 1, 80, 5, [1, 2, 10, 11, 12]),
        ("r3", 1, "h", "u", 0, 20, 4, [7, 8]),
    ]
    tool = {"finish_reason": "tool_call", "tool": "python", "tool_latency_s": 0.5, "tool_tokens": 10}
    return prepare_workload(pa.Table.from_pylist(
        [{**base, **dict(zip(names, r)), **(tool if r[0] == "r0" else {})} for r in rows], schema=WORKLOAD.schema))


def _requests() -> pa.Table:
    # r1: 8 uncached prompt + 19 decode = 27 computed without preemption; it computed 43 (16 recomputed).
    # r2: the unlimited cache would hit 64 (turn 0's 4 computed full blocks); it hit 32 (32 lost to eviction).
    names = ("request_id", "replica", "prompt_tokens", "cached_tokens", "output_tokens", "computed_tokens",
             "preemptions")
    rows = [
        ("r0", 0, 40, 0, 30, 69, 0),
        ("r1", 0, 40, 32, 20, 43, 1),
        ("r2", 0, 80, 32, 5, 52, 0),
        ("r3", 1, 20, 0, 4, 23, 0),
    ]
    base = {"arrival_s": 0.0, "max_tokens": 100, "finish_reason": "stop", "block_hashes": []}
    return pa.Table.from_pylist([{**base, **dict(zip(names, r))} for r in rows], schema=REQUESTS_SCHEMA)


def _steps() -> pa.Table:
    rows = [  # (replica, time_s, duration_s, running, waiting)
        (0, 0.0, 2.0, 2, 1),
        (0, 2.0, 4.0, 2, 0),
        (0, 6.0, 2.0, 1, 0),
        (0, 9.5, 1.0, 1, 0),  # straddles the two RL steps: 0.5 s in each
        (1, 10.0, 3.0, 1, 0),
        (1, 13.0, 1.0, 1, 0),
    ]
    zeros = ("free_blocks", "pinned_blocks", "prefill_tokens", "decode_tokens", "prefix_queries", "prefix_hits",
             "preemptions", "evictions", "dropped_rows")
    base: dict[str, Any] = {**dict.fromkeys(zeros, 0), "kv_usage": 0.0, "hook_fallback": False}
    return pa.Table.from_pylist(
        [dict(base, engine_step=i, replica=r, time_s=t, duration_s=d, running=n, waiting=w)
         for i, (r, t, d, n, w) in enumerate(rows)], schema=STEPS.schema)


TRAJECTORIES = [TrajectoryRecord("s", 0, 0.0, 9.0), TrajectoryRecord("t", 0, 0.0, 4.0),
                TrajectoryRecord("u", 1, 10.0, 16.0)]
RL_STEPS = [StepRecord(1, 10.0, 16.0), StepRecord(0, 0.0, 10.0)]


def test_hand_worked_summary() -> None:
    s = summarize(_workload(), _requests(), _steps(), TRAJECTORIES, RL_STEPS)
    assert s.requests == 4 and s.turns == 4 and s.trajectories == 3
    assert s.makespan_per_step_s == [10.0, 6.0] and s.makespan_s == 8.0
    assert s.simulated_s == 16.0 and s.output_tokens == 59
    assert s.tokens_per_s == pytest.approx(59 / 16)
    assert s.prefix_hit_rate == pytest.approx(64 / 180)
    assert s.preemptions == 1
    assert s.recomputed_tokens_preemption == 16
    assert s.recomputed_tokens_eviction == 32
    assert s.recomputed_tokens == 48
    # trajectory durations 9, 4, 6: p50 6; p99 at rank 1.98 of [4, 6, 9] = 6 + 0.98 * 3
    assert s.trajectory_p50_s == 6.0 and s.trajectory_p99_s == pytest.approx(8.94)
    # group g: max(9, 4) - 0; group h: 16 - 10
    assert s.group_completion_s == {"g": 9.0, "h": 6.0}
    assert s.group_completion_p50_s == 7.5 and s.group_completion_mean_s == 7.5
    assert s.group_completion_p99_s == pytest.approx(8.97)
    # Step 0 [0, 10], replica 0 (peak 2): busy 2*1 (queue) + 4*2/2 + 2*1/2 + 0.5*1/2 = 7.25 -> 2.75 idle;
    #   replica 1 ran nothing -> 10; mean 6.375.
    # Step 1 [10, 16], replica 0 (peak 1): 0.5 busy -> 5.5; replica 1 (peak 1): 3 + 1 busy -> 2; mean 3.75.
    assert s.tail_bubble_per_step_s == pytest.approx([6.375, 3.75])
    assert s.tail_bubble_s == pytest.approx(5.0625)


def test_tail_bubble_with_fixed_capacity() -> None:
    # Capacity 4. Step 0: replica 0 busy 2 + 4*0.5 + 2*0.25 + 0.5*0.25 = 4.625 -> 5.375; replica 1 -> 10.
    # Step 1: replica 0 busy 0.125 -> 5.875; replica 1 busy 4*0.25 = 1 -> 5.
    s = summarize(_workload(), _requests(), _steps(), TRAJECTORIES, RL_STEPS, batch_capacity=4)
    assert s.tail_bubble_per_step_s == pytest.approx([7.6875, 5.4375])
    assert s.tail_bubble_s == pytest.approx(6.5625)


def test_unlimited_cache_is_per_replica() -> None:
    # With r1 on replica 1, an unlimited cache there holds nothing for it: r1's 32 cached tokens exceed it (clip 0).
    req = _requests()
    req = req.set_column(req.schema.get_field_index("replica"), "replica", pa.array([0, 1, 0, 1], pa.int32()))
    assert summarize(_workload(), req, _steps(), TRAJECTORIES, RL_STEPS).recomputed_tokens_eviction == 32


def test_render_summary_mentions_every_headline() -> None:
    text = render_metrics(summarize(_workload(), _requests(), _steps(), TRAJECTORIES, RL_STEPS))
    for word in ("makespan 8.00 s/step", "prefix hit rate 0.356", "recomputed tokens 48", "tail bubble 5.06",
                 "trajectory p50 6.00", "2 groups", "3.7 tok/s"):
        assert word in text


def test_critical_trajectory_split() -> None:
    # Step 0's last trajectory is s (0-9): r0 queued 0-1, served 1-3; its tool call; r2 queued 3.5-4, served 4-8;
    # its verifier to 9: queue 1 + 0.5, service 2 + 4, the rest 9 - 7.5. Step 1's is u (10-16): r3 queued 10-12,
    # served 12-15: queue 2, service 3, the rest 1. t (ended at 4) is not critical, so its 5 s queue is not counted.
    times = {"r0": ("s", 0.0, 1.0, 3.0), "r1": ("t", 0.0, 5.0, 6.0), "r2": ("s", 3.5, 4.0, 8.0),
             "r3": ("u", 10.0, 12.0, 15.0)}
    req = _requests()
    cols = list(zip(*(times[r] for r in req.column("request_id").to_pylist())))
    for name, values in zip(("session_id", "arrival_s", "first_scheduled_s", "finish_s"), cols):
        i = req.schema.get_field_index(name)
        req = req.set_column(i, req.schema.field(i), pa.array(values, req.schema.field(i).type))
    s = summarize(_workload(), req, _steps(), TRAJECTORIES, RL_STEPS)
    assert s.critical_queue_s == pytest.approx((1.5 + 2.0) / 2)
    assert s.critical_service_s == pytest.approx((6.0 + 3.0) / 2)
    assert s.critical_other_s == pytest.approx((1.5 + 1.0) / 2)
    assert "critical trajectory (the step's last): queued 1.8 s, served 4.5 s" in render_metrics(s)


def test_siblings_run_in_another_order_are_no_recompute() -> None:
    # r1 ran before its sibling r0 (a policy's reordering): r1 paid the shared 32 prompt tokens the reference order
    # gives r0 to pay, and r0 hit them. That is no eviction; r2's 32 lost tokens still are.
    req = _requests()
    req = req.set_column(req.schema.get_field_index("cached_tokens"), "cached_tokens",
                         pa.array([32, 0, 32, 0], pa.int32()))
    assert summarize(_workload(), req, _steps(), TRAJECTORIES, RL_STEPS).recomputed_tokens_eviction == 32
