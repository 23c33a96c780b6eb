"""KV pool sizing from a workload: hand-worked block counts."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from data.schemas import WORKLOAD
from simulator.sizing import blocks_for_fraction, min_blocks_for
from simulator.workload import PreparedWorkload, prepare_workload


def _table(rows: list[dict[str, Any]]) -> PreparedWorkload:
    base = {"kind": "rollout", "step": 0, "prompt_id": "p", "group_id": "g", "group_size": 2, "sample_index": 0,
            "turn": 0, "domain": "math", "paradigm": "math_verifier", "max_tokens": 100, "finish_reason": "stop",
            "block_size": 16}
    return prepare_workload(pa.Table.from_pylist([{**base, "request_id": f"r{i}", **r} for i, r in enumerate(rows)],
                                                 schema=WORKLOAD.schema))


STEP0 = [
    # session s: turn 0 (40 prompt + 30 out, 10 tool tokens), turn 1 (80 + 5): its stream is 85 tokens long,
    # 5 full blocks + 1 tail. Sibling t (40 + 20): 60 tokens, 3 full blocks + 1 tail; its first 2 blocks are
    # s's (shared prompt), its third mixes t's own output in. Distinct: 5 + 1 + (3 - 2) + 1 = 8.
    {"session_id": "s", "prompt_tokens": 40, "output_tokens": 30, "block_hashes": [1, 2, 3], "tool_tokens": 10,
     "finish_reason": "tool_call", "tool": "python", "tool_latency_s": 0.5},
    {"session_id": "t", "prompt_tokens": 40, "output_tokens": 20, "block_hashes": [1, 2, 3]},
    {"session_id": "s", "turn": 1, "prompt_tokens": 80, "output_tokens": 5, "block_hashes": [1, 2, 10, 11, 12]},
]
# step 1: one request of 16 + 16 tokens, 2 full blocks
STEP1 = [{"session_id": "v", "step": 1, "group_id": "h", "prompt_tokens": 16, "output_tokens": 16,
          "block_hashes": [20]}]


@pytest.mark.parametrize("fraction, expected", [(1.0, 8 + 1), (0.5, 4 + 1), (0.3, 3 + 1), (2.0, 16 + 1)])
def test_largest_step_times_fraction_plus_null_block(fraction: float, expected: int) -> None:
    assert blocks_for_fraction(_table(STEP0 + STEP1), fraction) == expected


def test_trace_replay_counts_the_whole_trace() -> None:
    rows = [dict(r, arrival_s=float(i)) for i, r in enumerate(STEP0 + STEP1)]
    assert blocks_for_fraction(_table(rows), 1.0) == 8 + 2 + 1


def test_scoring_request_shares_its_trajectory_stream() -> None:
    # A judge request over t's final context (60 tokens) + 8 template tokens, 2 output tokens: t's stream
    # grows to 70 tokens = 4 full blocks + tail; t's own 60-token tail block is now a full block of it.
    scoring = {"kind": "scoring", "session_id": "t-score", "scores_session_id": "t", "prompt_tokens": 68,
               "output_tokens": 2, "block_hashes": [1, 2, 30, 31, 32]}
    assert blocks_for_fraction(_table(STEP0 + [scoring]), 1.0) == 5 + 1 + (4 - 2) + 1 + 1


def test_min_blocks_for_largest_request() -> None:
    assert min_blocks_for(_table(STEP0 + STEP1)) == 6 + 1  # r2: 85 tokens -> 6 blocks
    assert min_blocks_for(_table(STEP1)) == 2 + 1


def test_bad_fraction() -> None:
    with pytest.raises(ValueError, match="> 0"):
        blocks_for_fraction(_table(STEP1), 0.0)
