"""Parquet readers and writers: lossless round trips, part directories, and errors that name the file."""

from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data.errors import DataValidationError
from data.io import read_table, read_telemetry, read_workload, write_table, write_telemetry_part, write_workload
from data.schemas import (
    DECISION_KINDS,
    DOMAINS,
    FINISH_REASONS,
    KV_EVENT_KINDS,
    PARADIGMS,
    STEPS,
    TELEMETRY_TABLES,
    WORKLOAD,
)

INT32 = 2**31 - 1
INT64 = 2**63 - 1
names = st.text(st.characters(categories=["L", "N"]), min_size=1, max_size=8)
times = st.floats(0, 1e9, allow_nan=False)
PROPERTY = settings(max_examples=50, deadline=None)


@st.composite
def session_rows(draw: st.DrawFn, session: str, group: dict, sample: int, block_size: int) -> list[dict]:
    """A rollout trajectory: each turn's context extends the previous one, its full blocks carried over."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    domain = draw(st.sampled_from(DOMAINS) | names)
    paradigm = draw(st.sampled_from(PARADIGMS))
    turns = draw(st.integers(1, 4))
    prompt = draw(st.integers(1, 120))
    hashes: list[int] = []
    rows = []
    for turn in range(turns):
        last = turn == turns - 1
        kept = hashes[: (rows[-1]["prompt_tokens"] // block_size) if rows else 0]
        hashes = kept + [
            rng.randint(-INT64 - 1, INT64) for _ in range(math.ceil(prompt / block_size) - len(kept))
        ]
        output = draw(st.integers(0, 60))
        tool_tokens = None if last else draw(st.integers(0, 40))
        rows.append(
            {
                "request_id": f"{session}/{turn}",
                "kind": "rollout",
                "session_id": session,
                "turn": turn,
                "sample_index": sample,
                "domain": domain,
                "paradigm": paradigm,
                "prompt_tokens": prompt,
                "output_tokens": output,
                "max_tokens": output + draw(st.integers(0, 100)),
                "finish_reason": "tool_call" if not last else draw(st.sampled_from(FINISH_REASONS)),
                "block_size": block_size,
                "block_hashes": hashes,
                "tool": None if last else draw(names),
                "tool_latency_s": None if last else draw(st.floats(0, 600, allow_nan=False)),
                "tool_tokens": tool_tokens,
                "verify_latency_s": draw(st.none() | st.floats(0, 60, allow_nan=False)) if last else None,
                "scores_session_id": None,
                "arrival_s": draw(st.none() | times),
                **group,
            }
        )
        prompt += output + (tool_tokens or 0) + draw(st.integers(0, 10))
    return rows


@st.composite
def workloads(draw: st.DrawFn) -> pa.Table:
    """Random valid workloads: GRPO groups of multi-turn sessions, some scored, interleaved at random."""
    block_size = draw(st.sampled_from([1, 4, 16, 512]))
    sessions: list[list[dict]] = []
    for g in range(draw(st.integers(1, 3))):
        size = draw(st.integers(1, 4))
        group = {
            "group_id": f"g{g}",
            "group_size": size,
            "step": draw(st.integers(0, 5)),
            "prompt_id": draw(names),
        }
        for k in range(draw(st.integers(1, size))):
            rollout = draw(session_rows(f"g{g}s{k}", group, k, block_size))
            sessions.append(rollout)
            if draw(st.booleans()):
                scored = rollout[-1]
                score = {
                    **scored,
                    "request_id": f"g{g}s{k}/score",
                    "kind": "scoring",
                    "session_id": f"g{g}s{k}/score",
                }
                score.update(turn=0, finish_reason="stop", tool=None, tool_latency_s=None, tool_tokens=None)
                sessions.append([{**score, "scores_session_id": scored["session_id"]}])
    # Interleave sessions at random while each keeps its turn order.
    picks = draw(st.permutations([i for i, rows in enumerate(sessions) for _ in rows]))
    cursor = [0] * len(sessions)
    ordered = []
    for i in picks:
        ordered.append(sessions[i][cursor[i]])
        cursor[i] += 1
    return pa.Table.from_pylist(ordered, schema=WORKLOAD.schema)


def optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | strategy


@st.composite
def request_rows(draw: st.DrawFn) -> dict:
    prompt, output = draw(st.integers(0, INT32)), draw(st.integers(0, INT32))
    arrival = draw(times)
    return {
        "request_id": draw(names),
        "session_id": draw(optional(names)),
        "group_id": draw(optional(names)),
        "prompt_id": draw(optional(names)),
        "step": draw(optional(st.integers(0, INT32))),
        "turn": draw(optional(st.integers(0, INT32))),
        "domain": draw(optional(names)),
        "paradigm": draw(optional(names)),
        "replica": draw(st.integers(0, INT32)),
        "arrival_s": arrival,
        "first_scheduled_s": draw(optional(times)),
        "first_token_s": draw(optional(times)),
        "finish_s": draw(optional(st.floats(arrival, 2e9, allow_nan=False))),
        "prompt_tokens": prompt,
        "cached_tokens": draw(st.integers(0, prompt)),
        "output_tokens": output,
        "max_tokens": draw(st.integers(output, INT32)),
        "finish_reason": draw(st.sampled_from(FINISH_REASONS)),
        "computed_tokens": draw(st.integers(0, INT32)),
        "preemptions": draw(st.integers(0, INT32)),
        "block_hashes": draw(st.lists(st.integers(-INT64 - 1, INT64), max_size=6)),
    }


@st.composite
def decision_rows(draw: st.DrawFn) -> dict:
    candidates = draw(st.lists(names, max_size=4))
    width = draw(st.integers(0, 3))
    vector = st.lists(st.floats(width=32, allow_nan=False), min_size=width, max_size=width)
    return {
        "decision_id": draw(st.integers(-INT64 - 1, INT64)),
        "time_s": draw(times),
        "replica": draw(st.integers(0, INT32)),
        "engine_step": draw(st.integers(0, INT64)),
        "kind": draw(st.sampled_from(DECISION_KINDS)),
        "candidate_ids": candidates,
        "features": draw(st.lists(vector, min_size=len(candidates), max_size=len(candidates))),
        "chosen": draw(st.integers(-1, len(candidates) - 1)),
        "action": draw(optional(st.sampled_from(["protect", "demote", "keep"]))),
        "ttl_s": draw(optional(st.floats(0, 1e6, allow_nan=False))),
        "propensity": draw(st.floats(0, 1, exclude_min=True)),
        "policy": draw(names),
        "policy_version": draw(names),
    }


@st.composite
def step_rows(draw: st.DrawFn) -> dict:
    count = st.integers(0, INT32)
    queries = draw(st.integers(0, INT64))
    return {
        "engine_step": draw(st.integers(0, INT64)),
        "replica": draw(count),
        "time_s": draw(times),
        "duration_s": draw(st.floats(0, 1e3, allow_nan=False)),
        **{name: draw(count) for name in ("running", "waiting", "free_blocks", "pinned_blocks")},
        "kv_usage": draw(st.floats(0, 1)),
        "prefill_tokens": draw(count),
        "decode_tokens": draw(count),
        "prefix_queries": queries,
        "prefix_hits": draw(st.integers(0, queries)),
        "preemptions": draw(count),
        "evictions": draw(count),
        "hook_fallback": draw(st.booleans()),
        "dropped_rows": draw(st.integers(0, INT64)),
        "model_failures": draw(st.none() | st.integers(0, INT64)),
    }


@st.composite
def kv_event_rows(draw: st.DrawFn) -> dict:
    return {
        "time_s": draw(times),
        "replica": draw(st.integers(0, INT32)),
        "engine_step": draw(st.integers(0, INT64)),
        "event": draw(st.sampled_from(KV_EVENT_KINDS)),
        "block_hashes": draw(st.lists(st.integers(-INT64 - 1, INT64), max_size=6)),
        "parent_block_hash": draw(optional(st.integers(-INT64 - 1, INT64))),
        "num_tokens": draw(optional(st.integers(0, INT32))),
        "medium": draw(optional(st.sampled_from(["GPU", "CPU"]))),
    }


TELEMETRY_ROWS = {
    "requests": request_rows(),
    "decisions": decision_rows(),
    "steps": step_rows(),
    "kv_events": kv_event_rows(),
}


@st.composite
def telemetry(draw: st.DrawFn) -> tuple[str, pa.Table]:
    name = draw(st.sampled_from(sorted(TELEMETRY_ROWS)))
    rows = draw(st.lists(TELEMETRY_ROWS[name], max_size=12))
    return name, pa.Table.from_pylist(rows, schema=TELEMETRY_TABLES[name].schema)


@PROPERTY
@given(workloads())
def test_workload_round_trip_is_lossless(table: pa.Table) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_workload(table, Path(tmp) / "nested" / "w.parquet")
        read = read_workload(path)
    assert read.schema.equals(WORKLOAD.schema)
    assert read.equals(table)


@PROPERTY
@given(telemetry(), st.integers(1, 4))
def test_telemetry_round_trip_is_lossless(named: tuple[str, pa.Table], parts: int) -> None:
    name, table = named
    with tempfile.TemporaryDirectory() as tmp:
        write_table(table, Path(tmp) / "one.parquet", TELEMETRY_TABLES[name])
        whole = read_table(Path(tmp) / "one.parquet", TELEMETRY_TABLES[name])
        size = math.ceil(table.num_rows / parts) or 1
        for i, start in enumerate(range(0, max(table.num_rows, 1), size)):
            write_telemetry_part(tmp, name, table.slice(start, size), i)
        parted = read_telemetry(tmp, name)
    assert whole.equals(table)
    assert parted.equals(table)


def step_table(n: int, replica: int = 0) -> pa.Table:
    row = {name: 0 for name in STEPS.schema.names} | {
        "kv_usage": 0.5,
        "hook_fallback": False,
        "replica": replica,
        "num_gpu_blocks": 101,
        "block_size": 16,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
    }
    return pa.Table.from_pylist(
        [{**row, "engine_step": i, "time_s": i * 0.01} for i in range(n)], schema=STEPS.schema
    )


def test_single_file_and_part_directory_read_the_same(tmp_path: Path) -> None:
    table = step_table(100)
    write_table(table, tmp_path / "all.parquet", STEPS)
    for i, start in enumerate(range(0, 100, 15)):
        write_telemetry_part(tmp_path / "run", "steps", table.slice(start, 15), i)
    single = read_table(tmp_path / "all.parquet", STEPS)
    parted = read_telemetry(tmp_path / "run", "steps")
    assert sorted(p.name for p in (tmp_path / "run" / "steps").iterdir())[:2] == [
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    assert single.equals(parted)
    assert parted.equals(table)


def test_hive_partitioned_directory(tmp_path: Path) -> None:
    table = pa.concat_tables([step_table(5, replica=1), step_table(4, replica=0)])
    pq.write_to_dataset(table, tmp_path / "steps", partition_cols=["replica"])
    read = read_table(tmp_path / "steps", STEPS)
    assert read.equals(table.sort_by("replica"))
    assert read.schema.equals(STEPS.schema)


def test_bad_row_in_a_later_part_names_that_part(tmp_path: Path) -> None:
    good, bad = step_table(3), step_table(3).to_pylist()
    bad[2]["kv_usage"] = -0.25
    write_telemetry_part(tmp_path, "steps", good, 0)
    pq.write_table(pa.Table.from_pylist(bad, schema=STEPS.schema), tmp_path / "steps" / "part-00001.parquet")
    with pytest.raises(DataValidationError) as info:
        read_telemetry(tmp_path, "steps")
    part = tmp_path / "steps" / "part-00001.parquet"
    assert (info.value.file, info.value.column, info.value.row) == (str(part), "kv_usage", 2)
    assert str(info.value) == f"{part}: column 'kv_usage', row 2: negative KV usage (-0.25)"


def session(name: str, turns: int) -> list[dict]:
    """A small valid rollout session of group ``g``."""
    rows = []
    for turn in range(turns):
        last = turn == turns - 1
        prompt = 4 + 6 * turn
        rows.append(
            {
                "request_id": f"{name}/{turn}",
                "kind": "rollout",
                "step": 0,
                "prompt_id": "p",
                "group_id": "g",
                "group_size": 2,
                "sample_index": 0,
                "session_id": name,
                "turn": turn,
                "domain": "code",
                "paradigm": "unit_test_sandbox",
                "prompt_tokens": prompt,
                "output_tokens": 4,
                "max_tokens": 8,
                "finish_reason": "stop" if last else "tool_call",
                "block_size": 4,
                "block_hashes": list(range(math.ceil(prompt / 4))),
                "tool": None if last else "pytest",
                "tool_latency_s": None if last else 1.0,
                "tool_tokens": None if last else 2,
            }
        )
    return rows


def test_workload_structure_is_checked_across_files(tmp_path: Path) -> None:
    rows = session("a", 4)
    (tmp_path / "w").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "w" / "0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[2:]), tmp_path / "w" / "1.parquet")
    assert read_workload(tmp_path / "w").column("turn").to_pylist() == [0, 1, 2, 3]
    pq.write_table(pa.Table.from_pylist([rows[1], rows[3]]), tmp_path / "w" / "1.parquet")
    with pytest.raises(DataValidationError) as info:
        read_workload(tmp_path / "w")
    assert (info.value.file, info.value.column, info.value.row) == (
        str(tmp_path / "w" / "1.parquet"),
        "request_id",
        0,
    )
    assert f"first at {tmp_path / 'w' / '0.parquet'}, row 1" in str(info.value)


def test_projection_reads_requested_columns_in_order(tmp_path: Path) -> None:
    path = write_workload(pa.Table.from_pylist(session("a", 3)), tmp_path / "w.parquet")
    read = read_table(path, WORKLOAD, columns=["turn", "session_id"])
    assert read.column_names == ["turn", "session_id"]
    assert read.column("turn").to_pylist() == [0, 1, 2]
    with pytest.raises(ValueError, match="nope"):
        read_table(path, WORKLOAD, columns=["nope"])


def test_unreadable_parquet_names_the_file(tmp_path: Path) -> None:
    write_telemetry_part(tmp_path, "steps", step_table(2), 0)
    broken = tmp_path / "steps" / "part-00001.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataValidationError, match="not a readable Parquet file") as info:
        read_telemetry(tmp_path, "steps")
    assert info.value.file == str(broken)
    assert str(info.value).startswith(f"{broken}: ")


def test_missing_path_and_empty_directory_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_workload(tmp_path / "absent.parquet")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no Parquet files"):
        read_workload(tmp_path / "empty")
    with pytest.raises(ValueError, match="unknown telemetry table"):
        read_telemetry(tmp_path, "nope")


def test_hidden_and_temporary_files_are_ignored(tmp_path: Path) -> None:
    write_telemetry_part(tmp_path, "steps", step_table(2), 0)
    (tmp_path / "steps" / ".part-00001.parquet.123.tmp").write_bytes(b"half written")
    (tmp_path / "steps" / "_SUCCESS").write_bytes(b"")
    (tmp_path / "steps" / ".hidden.parquet").write_bytes(b"junk")
    assert read_telemetry(tmp_path, "steps").num_rows == 2


def test_write_refuses_extra_columns_and_invalid_rows(tmp_path: Path) -> None:
    extra = step_table(2).append_column("note", pa.array(["a", "b"]))
    with pytest.raises(DataValidationError, match="unexpected column") as info:
        write_table(extra, tmp_path / "x.parquet", STEPS)
    assert (info.value.file, info.value.column) == (str(tmp_path / "x.parquet"), "note")
    rows = session("a", 2)
    rows[1]["turn"] = 5
    with pytest.raises(DataValidationError) as info:
        write_workload(pa.Table.from_pylist(rows), tmp_path / "w.parquet")
    assert (info.value.column, info.value.row) == ("turn", 1)
    assert list(tmp_path.iterdir()) == []


def test_parts_are_never_overwritten(tmp_path: Path) -> None:
    path = write_telemetry_part(tmp_path, "steps", step_table(2), 7)
    assert path == tmp_path / "steps" / "part-00007.parquet"
    with pytest.raises(FileExistsError):
        write_telemetry_part(tmp_path, "steps", step_table(1), 7)
    assert read_telemetry(tmp_path, "steps").num_rows == 2


def test_feature_names_metadata_survives_and_must_agree(tmp_path: Path) -> None:
    row = {
        "decision_id": 1,
        "time_s": 0.0,
        "replica": 0,
        "engine_step": 3,
        "kind": "admit",
        "candidate_ids": ["r1"],
        "features": [[1.0, 2.0]],
        "chosen": 0,
        "propensity": 1.0,
        "policy": "fcfs",
        "policy_version": "v1",
    }
    names_a = {"kvpilot.feature_names": '{"admit": ["age", "len"]}'}
    table = pa.Table.from_pylist([row], schema=TELEMETRY_TABLES["decisions"].schema.with_metadata(names_a))
    write_telemetry_part(tmp_path, "decisions", table, 0)
    write_telemetry_part(tmp_path, "decisions", table, 1)
    read = read_telemetry(tmp_path, "decisions")
    assert read.schema.metadata[b"kvpilot.feature_names"] == names_a["kvpilot.feature_names"].encode()
    other = table.replace_schema_metadata({"kvpilot.feature_names": '{"admit": ["x"]}'})
    write_telemetry_part(tmp_path, "decisions", other, 2)
    with pytest.raises(DataValidationError, match="metadata differs") as info:
        read_telemetry(tmp_path, "decisions")
    assert info.value.file == str(tmp_path / "decisions" / "part-00002.parquet")
