"""Validation: each kind of bad input is rejected with its file, column and first bad row."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from data.errors import DataValidationError
from data.io import read_table
from data.schemas import DECISIONS, KV_EVENTS, REQUESTS, STEPS, WORKLOAD, TableSpec
from data.validate import validate_table

Rows = list[dict]


def session_rows(
    session: str,
    *,
    group: str = "g0",
    group_size: int = 2,
    sample: int = 0,
    turns: int = 3,
    kind: str = "rollout",
    scores: str | None = None,
    prompt: int = 10,
    output: int = 5,
    tool_tokens: int = 3,
    block_size: int = 4,
) -> Rows:
    """A valid session: each turn's context is the previous one plus its output and the tool's tokens."""
    base = 1000 * (sum(map(ord, session)) + 1)
    hashes = [base + i for i in range(1000)]  # one chain per session: every prefix carries over
    rows = []
    for turn in range(turns):
        last = turn == turns - 1
        rows.append(
            {
                "request_id": f"{session}-{turn}",
                "kind": kind,
                "step": 0,
                "prompt_id": f"p-{group}",
                "group_id": group,
                "group_size": group_size,
                "sample_index": sample,
                "session_id": session,
                "turn": turn,
                "domain": "math",
                "paradigm": "math_verifier",
                "prompt_tokens": prompt,
                "output_tokens": output,
                "max_tokens": 64,
                "finish_reason": "stop" if last else "tool_call",
                "block_size": block_size,
                "block_hashes": hashes[: math.ceil(prompt / block_size)],
                "tool": None if last else "python",
                "tool_latency_s": None if last else 0.5,
                "tool_tokens": None if last else tool_tokens,
                "verify_latency_s": 1.0 if last else None,
                "scores_session_id": scores,
                "arrival_s": None,
            }
        )
        prompt += output + tool_tokens
    return rows


def workload_rows() -> Rows:
    """Rows 0-5: sessions s0, s1 (group g0) interleaved turn by turn; 6: r0 scores s0; 7: s2 alone in g1."""
    s0, s1 = session_rows("s0"), session_rows("s1", sample=1)
    interleaved = [row for pair in zip(s0, s1, strict=True) for row in pair]
    scoring = session_rows("r0", kind="scoring", scores="s0", turns=1)
    return interleaved + scoring + session_rows("s2", group="g1", group_size=1, turns=1)


def request_row(i: int) -> dict:
    return {
        "request_id": f"req-{i}",
        "session_id": f"s{i}",
        "group_id": "g0",
        "prompt_id": "p0",
        "step": 1,
        "turn": 0,
        "domain": "code",
        "paradigm": "unit_test_sandbox",
        "replica": 0,
        "arrival_s": float(i),
        "first_scheduled_s": i + 0.1,
        "first_token_s": i + 0.2,
        "finish_s": i + 1.0,
        "prompt_tokens": 40,
        "cached_tokens": 16,
        "output_tokens": 12,
        "max_tokens": 64,
        "finish_reason": "stop",
        "computed_tokens": 40,
        "preemptions": 0,
        "held_s": 0.0,
        "block_hashes": [i, i + 1, -i - 2],
    }


def decision_row(i: int) -> dict:
    return {
        "decision_id": i,
        "time_s": float(i),
        "replica": 0,
        "engine_step": 10 + i,
        "kind": "preempt",
        "candidate_ids": ["a", "b"],
        "features": [[0.5, 1.0], [2.0, -0.25]],
        "chosen": 1,
        "action": None,
        "ttl_s": None,
        "propensity": 0.5,
        "policy": "lru",
        "policy_version": "v1",
    }


def step_row(i: int) -> dict:
    return {
        "engine_step": i,
        "replica": 0,
        "time_s": i * 0.1,
        "duration_s": 0.1,
        "running": 3,
        "waiting": 1,
        "free_blocks": 100,
        "pinned_blocks": 2,
        "kv_usage": 0.4,
        "prefill_tokens": 512,
        "decode_tokens": 3,
        "prefix_queries": 512,
        "prefix_hits": 256,
        "preemptions": 0,
        "evictions": 0,
        "held": i,
        "offload_loaded_blocks": 0,
        "offload_stored_blocks": 2 * i,
        "offload_loaded_bytes": 0,
        "offload_stored_bytes": 2 * i * 917504,
        "hook_fallback": False,
        "dropped_rows": 0,
        "model_failures": i % 3 if i % 2 else None,
        "prefill_context_tokens": 512 * 300,
        "decode_context_tokens": 3 * 700,
        "num_gpu_blocks": 301,
        "block_size": 16,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "hook_s": 2e-4,
    }


def kv_event_row(i: int) -> dict:
    return {
        "time_s": float(i),
        "replica": 0,
        "engine_step": i,
        "event": "stored",
        "block_hashes": [i, i + 1],
        "parent_block_hash": None,
        "num_tokens": 32,
        "medium": "GPU",
    }


TELEMETRY_ROWS: dict[str, Callable[[int], dict]] = {
    "requests": request_row,
    "decisions": decision_row,
    "steps": step_row,
    "kv_events": kv_event_row,
}


def edit(rows: Rows, row: int, **changes: object) -> Rows:
    rows[row] = {**rows[row], **changes}
    return rows


def swap(rows: Rows, a: int, b: int) -> Rows:
    rows[a], rows[b] = rows[b], rows[a]
    return rows


def shrink_second_turn(rows: Rows) -> Rows:
    """Row 3 (s1 turn 1) gets turn 0's prompt: the context lost the output and tool tokens."""
    return edit(rows, 3, prompt_tokens=10, block_hashes=rows[3]["block_hashes"][:3])


def break_prefix(rows: Rows) -> Rows:
    """Row 4 (s0 turn 2) changes its first block hash."""
    return edit(rows, 4, block_hashes=[-1] + rows[4]["block_hashes"][1:])


def join_full_group(rows: Rows) -> Rows:
    """s2 (row 7) joins g0, which already holds its two sessions."""
    return edit(rows, 7, group_id="g0", group_size=2, prompt_id="p-g0")


def change_block_size(rows: Rows) -> Rows:
    return edit(rows, 7, block_size=8, block_hashes=rows[7]["block_hashes"][:2])


def null_inside_hashes(rows: Rows) -> Rows:
    return edit(rows, 5, block_hashes=[rows[5]["block_hashes"][0], None, *rows[5]["block_hashes"][2:]])


# (case, good rows -> bad rows, column named, first bad row, words the message must hold)
BAD_WORKLOADS: list[tuple[str, Callable[[Rows], Rows], str, int, str]] = [
    (
        "string_tokens",
        lambda r: [{**x, "prompt_tokens": str(x["prompt_tokens"])} for x in r],
        "prompt_tokens",
        0,
        "wrong type: expected int32, got string",
    ),
    ("int32_overflow", lambda r: edit(r, 3, max_tokens=2**40), "max_tokens", 3, "does not fit int32"),
    ("null_request_id", lambda r: edit(r, 2, request_id=None), "request_id", 2, "null"),
    (
        "negative_prompt",
        lambda r: edit(r, 4, prompt_tokens=-3),
        "prompt_tokens",
        4,
        "negative token count (-3)",
    ),
    ("empty_prompt", lambda r: edit(r, 7, prompt_tokens=0, block_hashes=[]), "prompt_tokens", 7, "at least 1"),
    ("output_over_max", lambda r: edit(r, 5, output_tokens=100), "output_tokens", 5, "exceeds max_tokens"),
    ("short_hash_chain", lambda r: edit(r, 1, block_hashes=r[1]["block_hashes"][:2]), "block_hashes", 1, "3"),
    ("null_in_hash_chain", null_inside_hashes, "block_hashes", 5, "null inside a list"),
    ("turns_swapped", lambda r: swap(r, 2, 4), "turn", 2, "0..n-1"),
    ("turn_zero_missing", lambda r: r[1:], "turn", 1, "turn 1 where turn 0"),
    ("duplicate_request", lambda r: edit(r, 5, request_id="s1-1"), "request_id", 5, "duplicate"),
    ("dangling_scoring", lambda r: edit(r, 6, scores_session_id="nope"), "scores_session_id", 6, "dangling"),
    ("rollout_scores", lambda r: edit(r, 3, scores_session_id="s0"), "scores_session_id", 3, "rollout"),
    ("scores_nothing", lambda r: edit(r, 6, scores_session_id=None), "scores_session_id", 6, "must name"),
    ("group_overfull", join_full_group, "group_id", 7, "more rollout sessions"),
    ("session_switches_group", lambda r: edit(r, 4, group_id="g1"), "group_id", 4, "session 's0'"),
    (
        "group_mixes_steps",
        lambda r: [{**x, "step": int(x["session_id"] == "s1")} for x in r],
        "step",
        1,
        "group 'g0'",
    ),
    ("unknown_kind", lambda r: edit(r, 7, kind="rolout"), "kind", 7, "'rolout'"),
    ("unknown_finish", lambda r: edit(r, 7, finish_reason="done"), "finish_reason", 7, "'done'"),
    ("unknown_paradigm", lambda r: edit(r, 1, paradigm="vibes"), "paradigm", 1, "'vibes'"),
    ("blank_domain", lambda r: edit(r, 6, domain="  "), "domain", 6, "empty domain"),
    ("no_tool_mid_session", lambda r: edit(r, 3, tool=None), "tool", 3, "followed by another turn"),
    ("stop_mid_session", lambda r: edit(r, 0, finish_reason="stop"), "finish_reason", 0, "'tool_call'"),
    ("context_shrinks", shrink_second_turn, "prompt_tokens", 3, "fewer than the previous turn"),
    ("prefix_broken", break_prefix, "block_hashes", 4, "full blocks"),
    ("sample_outside_group", lambda r: edit(r, 7, sample_index=1), "sample_index", 7, "group size 1"),
    ("block_size_changes", change_block_size, "block_size", 7, "differs"),
    (
        "negative_tool_latency",
        lambda r: edit(r, 2, tool_latency_s=-0.5),
        "tool_latency_s",
        2,
        "negative latency",
    ),
    ("negative_arrival", lambda r: edit(r, 5, arrival_s=-1.0), "arrival_s", 5, "negative arrival time"),
    ("infinite_verifier", lambda r: edit(r, 3, verify_latency_s=math.inf), "verify_latency_s", 3,
     "latency is infinite"),
]

# (case, spec, table, change to row 1, column named, words the message must hold)
BAD_TELEMETRY: list[tuple[str, TableSpec, str, dict, str, str]] = [
    (
        "cached_over_prompt",
        REQUESTS,
        "requests",
        {"cached_tokens": 41},
        "cached_tokens",
        "exceeds prompt_tokens",
    ),
    ("finish_before_arrival", REQUESTS, "requests", {"finish_s": 0.5}, "finish_s", "before arrival"),
    ("negative_cached", REQUESTS, "requests", {"cached_tokens": -1}, "cached_tokens", "negative token count"),
    ("features_per_candidate", DECISIONS, "decisions", {"features": [[1.0]]}, "features", "2 candidates"),
    ("chosen_out_of_range", DECISIONS, "decisions", {"chosen": 2}, "chosen", "only 2 candidates"),
    ("zero_propensity", DECISIONS, "decisions", {"propensity": 0.0}, "propensity", "(0, 1]"),
    ("unknown_decision", DECISIONS, "decisions", {"kind": "evict"}, "kind", "'evict'"),
    ("kv_usage_over_one", STEPS, "steps", {"kv_usage": 1.5}, "kv_usage", "exceeds 1.0"),
    ("negative_duration", STEPS, "steps", {"duration_s": -0.1}, "duration_s", "negative duration"),
    ("negative_model_failures", STEPS, "steps", {"model_failures": -1}, "model_failures", "negative count"),
    ("negative_context", STEPS, "steps", {"decode_context_tokens": -3}, "decode_context_tokens", "negative token"),
    ("zero_block_size", STEPS, "steps", {"block_size": 0}, "block_size", "block size"),
    ("unknown_kv_event", KV_EVENTS, "kv_events", {"event": "evicted"}, "event", "'evicted'"),
]


def write_unchecked(rows: Rows, path: Path) -> Path:
    """Write rows as Parquet with inferred types, bypassing validation."""
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def assert_located(err: DataValidationError, file: Path, column: str, row: int | None, words: str) -> None:
    assert (err.file, err.column, err.row) == (str(file), column, row)
    text = str(err)
    assert text.startswith(f"{file}: column {column!r}")
    assert row is None or f"row {row}:" in text
    assert words in text


def test_good_workload_validates_to_the_exact_schema() -> None:
    table = validate_table(pa.Table.from_pylist(workload_rows()), WORKLOAD, "mem")
    assert table.schema.equals(WORKLOAD.schema)
    assert table.to_pylist() == workload_rows()


@pytest.mark.parametrize(
    ("make_bad", "column", "row", "words"), [c[1:] for c in BAD_WORKLOADS], ids=[c[0] for c in BAD_WORKLOADS]
)
def test_bad_workload_is_located(
    tmp_path: Path, make_bad: Callable[[Rows], Rows], column: str, row: int, words: str
) -> None:
    path = write_unchecked(make_bad(workload_rows()), tmp_path / "bad.parquet")
    with pytest.raises(DataValidationError) as info:
        read_table(path, WORKLOAD)
    assert_located(info.value, path, column, row, words)


@pytest.mark.parametrize(
    ("spec", "name", "change", "column", "words"),
    [c[1:] for c in BAD_TELEMETRY],
    ids=[c[0] for c in BAD_TELEMETRY],
)
def test_bad_telemetry_is_located(
    tmp_path: Path, spec: TableSpec, name: str, change: dict, column: str, words: str
) -> None:
    rows = [TELEMETRY_ROWS[name](i) for i in range(3)]
    path = write_unchecked(edit(rows, 1, **change), tmp_path / f"{name}.parquet")
    with pytest.raises(DataValidationError) as info:
        read_table(path, spec)
    assert_located(info.value, path, column, 1, words)


def test_wrong_telemetry_type_is_located(tmp_path: Path) -> None:
    path = write_unchecked(
        [{**step_row(i), "hook_fallback": "yes"} for i in range(3)], tmp_path / "steps.parquet"
    )
    with pytest.raises(DataValidationError) as info:
        read_table(path, STEPS)
    assert_located(info.value, path, "hook_fallback", 0, "wrong type: expected bool, got string")


def test_good_telemetry_validates() -> None:
    for name, spec in [
        ("requests", REQUESTS),
        ("decisions", DECISIONS),
        ("steps", STEPS),
        ("kv_events", KV_EVENTS),
    ]:
        rows = [TELEMETRY_ROWS[name](i) for i in range(3)]
        assert validate_table(pa.Table.from_pylist(rows), spec, name).to_pylist() == rows


def test_missing_required_column_is_named(tmp_path: Path) -> None:
    path = tmp_path / "w.parquet"
    pq.write_table(pa.Table.from_pylist(workload_rows()).drop_columns(["session_id"]), path)
    with pytest.raises(DataValidationError) as info:
        read_table(path, WORKLOAD)
    assert_located(info.value, path, "session_id", None, "missing required column")


def test_missing_nullable_column_reads_as_nulls() -> None:
    table = pa.Table.from_pylist(workload_rows()).drop_columns(["arrival_s"])
    assert validate_table(table, WORKLOAD, "mem").column("arrival_s").null_count == len(workload_rows())


def test_unknown_column_is_refused() -> None:
    table = pa.Table.from_pylist(workload_rows()).append_column("extra", pa.array([1] * 8))
    with pytest.raises(DataValidationError, match="unexpected column") as info:
        validate_table(table, WORKLOAD, "mem")
    assert info.value.column == "extra"


def test_projection_checks_only_what_it_reads() -> None:
    rows = edit(workload_rows(), 4, prompt_tokens=-3)
    table = pa.Table.from_pylist(rows).select(["session_id", "turn"])
    checked = validate_table(table, WORKLOAD, "mem", columns=["session_id", "turn"])
    assert checked.schema.names == ["session_id", "turn"]
    with pytest.raises(DataValidationError, match="turn 1 where turn 0"):
        validate_table(
            pa.Table.from_pylist(workload_rows()[1:]).select(["session_id", "turn"]),
            WORKLOAD,
            "mem",
            columns=["session_id", "turn"],
        )


def test_error_text_and_pickling() -> None:
    err = DataValidationError("negative token count (-3)", file="x.parquet", column="prompt_tokens", row=17)
    assert str(err) == "x.parquet: column 'prompt_tokens', row 17: negative token count (-3)"
    line = DataValidationError("not JSON", file="trace.jsonl", column="hash_ids", line=5)
    assert str(line) == "trace.jsonl: column 'hash_ids', line 5: not JSON"
    assert isinstance(line, ValueError)
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.file, copy.column, copy.row, str(copy)) == (err.file, err.column, err.row, str(err))


def big_workload(sessions: int, turns: int = 4, block_size: int = 64) -> pa.Table:
    """A valid workload of ``sessions * turns`` rows, turn-major so sessions interleave."""
    n = sessions * turns
    turn = np.repeat(np.arange(turns), sessions)
    session = np.tile(np.arange(sessions), turns)
    output, tool = 20, 12
    prompt = 100 + turn * (output + tool)
    blocks = -(-prompt // block_size)
    offsets = np.concatenate([[0], np.cumsum(blocks)])
    within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], blocks)
    hashes = np.repeat(session * 16, blocks) + within
    last = turn == turns - 1

    def names(prefix: str, ids: np.ndarray) -> pa.Array:
        return pc.binary_join_element_wise(prefix, pc.cast(pa.array(ids), pa.string()), "")

    def const(value: object, typ: pa.DataType) -> pa.Array:
        return pa.repeat(pa.scalar(value, typ), n)

    def unless_last(value: object, typ: pa.DataType) -> pa.Array:
        return pc.if_else(pa.array(last), pa.nulls(n, typ), const(value, typ))

    columns = {
        "request_id": names("r", np.arange(n)),
        "kind": const("rollout", pa.string()),
        "step": const(0, pa.int32()),
        "prompt_id": names("p", session // 4),
        "group_id": names("g", session // 4),
        "group_size": const(4, pa.int32()),
        "sample_index": pa.array(session % 4, pa.int32()),
        "session_id": names("s", session),
        "turn": pa.array(turn, pa.int32()),
        "domain": const("agentic", pa.string()),
        "paradigm": const("search_tool", pa.string()),
        "prompt_tokens": pa.array(prompt, pa.int32()),
        "output_tokens": const(output, pa.int32()),
        "max_tokens": const(64, pa.int32()),
        "finish_reason": pc.if_else(pa.array(last), "stop", "tool_call"),
        "block_size": const(block_size, pa.int32()),
        "block_hashes": pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(hashes, pa.int64())),
        "tool": unless_last("search", pa.string()),
        "tool_latency_s": unless_last(0.25, pa.float64()),
        "tool_tokens": unless_last(tool, pa.int32()),
        "verify_latency_s": pa.nulls(n, pa.float64()),
        "scores_session_id": pa.nulls(n, pa.string()),
        "arrival_s": pa.nulls(n, pa.float64()),
    }
    return pa.table(columns, schema=WORKLOAD.schema)


def test_million_rows_validate_and_a_bad_last_row_is_named() -> None:
    """Vectorised checks hold at scale: a 1M-row table passes, and its last row's fault is located exactly."""
    table = big_workload(250_000)
    assert table.num_rows == 1_000_000
    assert validate_table(table, WORKLOAD, "big").num_rows == 1_000_000
    out = table["output_tokens"].to_numpy().copy()
    out[-1] = -1
    bad = table.set_column(table.schema.get_field_index("output_tokens"), "output_tokens", pa.array(out, pa.int32()))
    with pytest.raises(DataValidationError) as err:
        validate_table(bad, WORKLOAD, "big")
    assert (err.value.column, err.value.row) == ("output_tokens", 999_999)
