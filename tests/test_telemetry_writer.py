"""TelemetryWriter: round trip through the validating readers, rotation, drop-on-full, bad rows."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data.io import read_telemetry
from serving_hook import telemetry
from serving_hook.telemetry import TelemetryWriter, from_env


def request_row(i: int) -> dict:
    return {
        "request_id": f"req-{i}",
        "session_id": f"sess-{i}",
        "group_id": "g0",
        "prompt_id": "p0",
        "step": 3,
        "turn": 0,
        "domain": "math",
        "paradigm": "math_verifier",
        "replica": 1,
        "arrival_s": float(i),
        "first_scheduled_s": i + 0.25,
        "first_token_s": i + 0.5,
        "finish_s": i + 2.0,
        "prompt_tokens": 40,
        "cached_tokens": 16,
        "output_tokens": 12,
        "max_tokens": 64,
        "finish_reason": "stop",
        "computed_tokens": 35,
        "preemptions": 0,
        "held_s": 0.5,
        "block_hashes": [i * 10 + 1, i * 10 + 2, -(i * 10 + 3)],
    }


def decision_row(i: int) -> dict:
    return {
        "decision_id": i,
        "time_s": i + 0.5,
        "replica": 1,
        "engine_step": 100 + i,
        "kind": "admit",
        "candidate_ids": [f"req-{i}", f"req-{i + 1}"],
        "features": [[0.5, 1.0], [2.0, -0.25]],
        "chosen": 0,
        "action": None,
        "ttl_s": None,
        "propensity": 1.0,
        "policy": "fcfs",
        "policy_version": "v1",
    }


def step_row(i: int) -> dict:
    return {
        "engine_step": i,
        "replica": 1,
        "time_s": i * 0.01,
        "duration_s": 0.01,
        "running": 4,
        "waiting": 2,
        "free_blocks": 1000 - i % 1000,
        "pinned_blocks": 0,
        "kv_usage": 0.5,
        "prefill_tokens": 128,
        "decode_tokens": 4,
        "prefix_queries": 3,
        "prefix_hits": 1,
        "preemptions": 0,
        "evictions": 0,
        "held": 0,
        "offload_loaded_blocks": 1,
        "offload_stored_blocks": 3,
        "offload_loaded_bytes": 917504,
        "offload_stored_bytes": 3 * 917504,
        "hook_fallback": False,
        "dropped_rows": 0,
        "model_failures": None,
        "prefill_context_tokens": 128 * 200,
        "decode_context_tokens": 4 * 900,
        "num_gpu_blocks": 1001,
        "block_size": 16,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "hook_s": 1e-4,
    }


def kv_event_row(i: int) -> dict:
    return {
        "time_s": i * 0.01,
        "replica": 1,
        "engine_step": i,
        "event": "stored",
        "block_hashes": [i, i + 1],
        "parent_block_hash": None if i == 0 else i - 1,
        "num_tokens": 32,
        "medium": "GPU",
    }


ROWS: dict[str, Callable[[int], dict]] = {
    "requests": request_row,
    "decisions": decision_row,
    "steps": step_row,
    "kv_events": kv_event_row,
}


def parts(out: Path, table: str) -> list[Path]:
    return sorted((out / table).glob("part-*.parquet"))


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_all_tables_round_trip(tmp_path: Path) -> None:
    writer = TelemetryWriter(tmp_path)
    expected = {table: [make(i) for i in range(25)] for table, make in ROWS.items()}
    for i in range(25):
        for table in ROWS:
            assert writer.put(table, expected[table][i])
    writer.close()
    assert writer.dropped == 0
    assert writer.rows_written == {table: 25 for table in ROWS}
    for table, rows in expected.items():
        assert len(parts(tmp_path, table)) == 1
        assert read_telemetry(tmp_path, table).to_pylist() == rows


def test_rotation_by_size_reads_back_as_one_table(tmp_path: Path) -> None:
    writer = TelemetryWriter(tmp_path, rows_per_file=100, flush_interval_s=60.0)
    rows = [step_row(i) for i in range(1050)]
    for row in rows:
        assert writer.put("steps", row)
    writer.close()
    files = parts(tmp_path, "steps")
    assert [f.name for f in files] == [f"part-{i:05d}.parquet" for i in range(11)]
    assert [pq.read_metadata(f).num_rows for f in files] == [100] * 10 + [50]
    assert read_telemetry(tmp_path, "steps").to_pylist() == rows


def test_rotation_by_interval(tmp_path: Path) -> None:
    writer = TelemetryWriter(tmp_path, flush_interval_s=0.05)
    writer.put("kv_events", kv_event_row(0))
    wait_until(lambda: writer.rows_written.get("kv_events") == 1)
    writer.put("kv_events", kv_event_row(1))
    writer.close()
    assert len(parts(tmp_path, "kv_events")) == 2
    assert read_telemetry(tmp_path, "kv_events").to_pylist() == [kv_event_row(0), kv_event_row(1)]


def test_flood_never_blocks_and_counts_drops_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, release = threading.Event(), threading.Event()
    real_write = telemetry.write_telemetry_part

    def stalled_write(*args: object) -> object:
        entered.set()
        assert release.wait(30), "test never released the stalled writer"
        return real_write(*args)

    monkeypatch.setattr(telemetry, "write_telemetry_part", stalled_write)
    writer = TelemetryWriter(tmp_path, capacity=100, flush_interval_s=0.0)
    assert writer.put("steps", step_row(0))
    assert entered.wait(10), "drain thread never started writing"

    try:
        start = time.perf_counter()
        accepted = [writer.put("steps", step_row(i)) for i in range(1, 10_001)]
        elapsed = time.perf_counter() - start

        assert elapsed < 0.5, f"10k puts took {elapsed:.3f}s while the drain was stalled"
        assert sum(accepted) == 100
        assert accepted[:100] == [True] * 100
        assert writer.dropped == 9_900
        assert writer.dropped_by_table == {"steps": 9_900}
    finally:
        release.set()
    writer.close()
    assert writer.rows_written == {"steps": 101}
    assert writer.rows_written["steps"] + writer.dropped == 10_001
    assert [r["engine_step"] for r in read_telemetry(tmp_path, "steps").to_pylist()] == list(range(101))


def test_bad_rows_are_dropped_logged_once_and_thread_keeps_writing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvpilot.telemetry")
    writer = TelemetryWriter(tmp_path, flush_interval_s=0.0)
    writer.put("steps", step_row(0))
    writer.put("steps", {**step_row(1), "replica": "one"})
    writer.put("steps", step_row(2))
    wait_until(lambda: writer.rows_written.get("steps") == 2)
    writer.put("steps", {**step_row(3), "running": 2**40})  # overflows int32
    writer.put("steps", step_row(4))
    writer.close()

    assert writer.dropped_by_table == {"steps": 2}
    assert writer.rows_written == {"steps": 3}
    read = read_telemetry(tmp_path, "steps").to_pylist()
    assert [r["engine_step"] for r in read] == [0, 2, 4]
    warnings = [r for r in caplog.records if r.name == "kvpilot.telemetry"]
    assert len(warnings) == 1
    assert "steps" in warnings[0].getMessage()


def test_rows_failing_validation_and_unknown_tables_are_dropped(tmp_path: Path) -> None:
    writer = TelemetryWriter(tmp_path)
    missing_replica = request_row(1)
    del missing_replica["replica"]
    writer.put("requests", request_row(0))
    writer.put("requests", missing_replica)
    writer.put("requests", {**request_row(2), "block_hashes": None})
    writer.put("requests", {**request_row(3), "session_id": None})  # nullable: kept
    writer.put("requests", {**request_row(4), "block_hashes": [1, None]})
    writer.put("requests", {**request_row(5), "cached_tokens": 41})  # more than prompt_tokens
    writer.put("requests", {**request_row(6), "finish_reason": "bored"})
    writer.put("requests", request_row(7))
    assert writer.put("no_such_table", {"x": 1})  # put does not validate; the drain counts it
    writer.close()

    assert writer.dropped_by_table == {"requests": 5, "no_such_table": 1}
    assert writer.dropped == 6
    assert writer.rows_written == {"requests": 3}
    ids = [r["request_id"] for r in read_telemetry(tmp_path, "requests").to_pylist()]
    assert ids == ["req-0", "req-3", "req-7"]


def test_failed_write_is_counted_and_later_writes_succeed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = telemetry.write_telemetry_part
    calls = []

    def flaky_write(*args: object) -> object:
        calls.append(args)
        if len(calls) == 1:
            raise OSError("disk full")
        return real_write(*args)

    monkeypatch.setattr(telemetry, "write_telemetry_part", flaky_write)
    writer = TelemetryWriter(tmp_path, flush_interval_s=0.0)
    for i in range(3):
        writer.put("steps", step_row(i))
    wait_until(lambda: len(calls) == 1)
    writer.put("steps", step_row(3))
    writer.close()
    assert writer.rows_written["steps"] + writer.dropped == 4
    assert writer.rows_written["steps"] >= 1
    assert len(read_telemetry(tmp_path, "steps")) == writer.rows_written["steps"]


def test_put_after_close_is_dropped_and_close_is_idempotent(tmp_path: Path) -> None:
    writer = TelemetryWriter(tmp_path)
    assert writer.put("steps", step_row(0))
    writer.close()
    writer.close()
    assert not writer.put("steps", step_row(1))
    assert writer.dropped_by_table == {"steps": 1}
    assert writer.rows_written == {"steps": 1}


def test_dropping_the_writer_flushes_it(tmp_path: Path) -> None:
    writer = TelemetryWriter(tmp_path, flush_interval_s=60.0)
    writer.put("steps", step_row(0))
    del writer  # the drain thread holds no reference to the writer, so its finalizer runs now
    assert read_telemetry(tmp_path, "steps").to_pylist() == [step_row(0)]


def test_restart_continues_part_numbering(tmp_path: Path) -> None:
    for i in range(2):
        writer = TelemetryWriter(tmp_path)
        writer.put("steps", step_row(i))
        writer.close()
    assert [f.name for f in parts(tmp_path, "steps")] == ["part-00000.parquet", "part-00001.parquet"]
    assert read_telemetry(tmp_path, "steps").to_pylist() == [step_row(0), step_row(1)]


def test_table_metadata_is_stored_in_each_file(tmp_path: Path) -> None:
    names = '{"admit": ["a", "b"]}'
    writer = TelemetryWriter(tmp_path, metadata={"decisions": {"kvpilot.feature_names": names}})
    writer.put("decisions", decision_row(0))
    writer.close()
    (part,) = parts(tmp_path, "decisions")
    assert pq.read_schema(part).metadata[b"kvpilot.feature_names"] == names.encode()
    with pytest.raises(ValueError):
        TelemetryWriter(tmp_path, metadata={"nope": {}})


def test_tables_not_kept_are_skipped_not_dropped(tmp_path: Path) -> None:
    writer = TelemetryWriter(tmp_path, tables=["requests", "steps"])
    for i in range(10):
        for table, make in ROWS.items():
            assert writer.put(table, make(i))
    writer.close()
    assert writer.dropped == 0
    assert writer.rows_written == {"requests": 10, "steps": 10}
    assert parts(tmp_path, "decisions") == [] and parts(tmp_path, "kv_events") == []
    with pytest.raises(ValueError, match="desicions"):
        TelemetryWriter(tmp_path, tables=["desicions"])


def test_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(telemetry.ENV_DIR, raising=False)
    assert from_env() is None
    monkeypatch.setenv(telemetry.ENV_DIR, "")
    assert from_env() is None
    monkeypatch.setenv(telemetry.ENV_DIR, str(tmp_path / "tele"))
    writer = from_env(capacity=10)
    assert isinstance(writer, TelemetryWriter)
    assert writer.out_dir == tmp_path / "tele"
    writer.put("steps", step_row(0))
    writer.close()
    assert writer.rows_written == {"steps": 1}
