"""Non-blocking telemetry writer for the serving hook.

The hook calls :meth:`TelemetryWriter.put` from vLLM's scheduler loop. ``put`` only
appends to a bounded in-memory queue under a lock; when the queue is full (or the
writer is closed) the row is dropped and counted, never waited on. A daemon thread
drains the queue, converts rows to Arrow per table and writes rotating Parquet part
files ``<out_dir>/<table>/part-<seq:05d>.parquet`` through :mod:`data.io`: a file is
cut every ``rows_per_file`` rows and at least every ``flush_interval_s`` seconds,
so files stay bounded and a crash loses at most one interval. :meth:`TelemetryWriter.flush` asks for every
queued row to be written now without waiting for it; the hook calls it whenever its engine goes idle, so a
server killed while idle (vLLM's default ``--shutdown-timeout 0`` kills the engine process right after its
SIGTERM) has lost nothing, and one killed while busy at most the last interval's rows. Rows are converted
to Arrow as soon as they are drained, so few Python objects stay alive for the
garbage collector to scan. Rows that fail conversion, or
:mod:`data.validate`'s checks when their part is written, are found by bisection,
dropped, counted and logged once per kind and table; they never stop the thread.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa

from data.io import write_telemetry_part
from data.schemas import TELEMETRY_TABLES
from data.validate import validate_table

log = logging.getLogger("kvpilot.telemetry")

ENV_DIR = "KVPILOT_TELEMETRY_DIR"
_PART = re.compile(r"part-(\d+)\.parquet$")
# Rows converted per pyarrow call: conversion holds the GIL, so small chunks keep the
# engine thread's wait for it near the interpreter's switch interval (5 ms).
_CHUNK = 256
# Queued rows that wake the drain before its next poll: Python rows waiting in the queue
# are objects the garbage collector scans (in the engine's thread too), so keep them few.
_WAKE_ROWS = 4096


class _Drain:
    """State shared by the producers and the drain thread; holds no reference to the writer."""

    def __init__(
        self,
        out_dir: Path,
        capacity: int,
        rows_per_file: int,
        flush_interval_s: float,
        metadata: Mapping[str, Mapping[str, str]],
    ) -> None:
        self.out_dir = out_dir
        self.limit = capacity  # rows the queue accepts now: capacity, or 0 once closed
        self.wake_at = min(capacity // 2, _WAKE_ROWS)
        self.rows_per_file = rows_per_file
        self.flush_interval_s = flush_interval_s
        self.poll_s = min(0.1, flush_interval_s) if flush_interval_s > 0 else 0.01
        self.lock = threading.Lock()
        self.buf: list[tuple[str, Mapping[str, Any]]] = []
        self.dropped: dict[str, int] = {}
        self.written: dict[str, int] = {}
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.flush_asked = 0  # flush() calls so far; the drain writes everything when it has not seen them all
        self.flush_done = 0
        self.schemas = {
            name: spec.schema.with_metadata(dict(metadata[name])) if name in metadata else spec.schema
            for name, spec in TELEMETRY_TABLES.items()
        }
        self.pending: dict[str, list[pa.Table]] = {name: [] for name in TELEMETRY_TABLES}
        self.pending_rows = {name: 0 for name in TELEMETRY_TABLES}
        start = time.monotonic()
        self.last_write = {name: start for name in TELEMETRY_TABLES}
        self.next_part = {name: _next_part_index(out_dir / name) for name in TELEMETRY_TABLES}
        self.logged: set[tuple[str, str]] = set()
        for name, schema in self.schemas.items():
            # pyarrow imports pandas on its first conversion: pay that here, not in the drain thread
            validate_table(pa.Table.from_pylist([], schema=schema), TELEMETRY_TABLES[name], "warm-up")
        self.thread = threading.Thread(target=self.run, name="kvpilot-telemetry", daemon=True)
        self.thread.start()

    def run(self) -> None:
        """Drain loop: poll (or wake early once rows pile up), write due parts, finish on stop."""
        while not self.stop.is_set():
            self.wake.wait(self.poll_s)
            self.wake.clear()
            asked = self.flush_asked
            self.drain(final=asked != self.flush_done)
            self.flush_done = asked
        self.drain(final=True)

    def close(self) -> None:
        """Refuse new rows, then let the thread write everything queued and join it."""
        with self.lock:
            self.limit = 0
        self.stop.set()
        self.wake.set()
        self.thread.join()

    def drain(self, final: bool) -> None:
        """Convert queued rows to Arrow, then write every part that is due."""
        self.take_queue()
        now = time.monotonic()
        for table in self.pending:
            while self.pending_rows[table] >= self.rows_per_file:
                self.write(table, self.rows_per_file)
            due = final or now - self.last_write[table] >= self.flush_interval_s
            if self.pending_rows[table] and due:
                self.write(table, self.pending_rows[table])

    def take_queue(self) -> None:
        """Empty the queue into per-table pending Arrow data; the Python rows die on return."""
        with self.lock:
            batch, self.buf = self.buf, []
        by_table: dict[str, list[Mapping[str, Any]]] = {}
        for table, row in batch:
            by_table.setdefault(table, []).append(row)
        for table, rows in by_table.items():
            if table in self.pending:
                self.convert(table, rows)
            else:
                self.drop(table, len(rows), "unknown table", f"no telemetry table named {table!r}")

    def convert(self, table: str, rows: list[Mapping[str, Any]]) -> None:
        """Append rows to the table's pending Arrow data, dropping rows that do not fit its types."""
        schema = self.schemas[table]
        bad, error = 0, None
        for start in range(0, len(rows), _CHUNK):
            parts, chunk_bad, chunk_error = _bisect(
                rows[start : start + _CHUNK], lambda chunk: pa.Table.from_pylist(chunk, schema=schema)
            )
            bad, error = bad + chunk_bad, error or chunk_error
            self.pending[table] += parts
            self.pending_rows[table] += sum(part.num_rows for part in parts)
        if bad:
            self.drop(table, bad, "conversion", f"row does not fit the schema: {error!r}")

    def write(self, table: str, n: int) -> None:
        """Write the first n pending rows of a table, less the rows that fail validation, as its next part."""
        self.last_write[table] = time.monotonic()
        pending = pa.concat_tables(self.pending[table])
        data, rest = pending.slice(0, n), pending.slice(n)
        self.pending[table] = [rest] if rest.num_rows else []
        self.pending_rows[table] -= n
        spec = TELEMETRY_TABLES[table]
        source = f"{self.out_dir / table} (next part)"
        parts, invalid, error = _bisect(data, lambda rows: validate_table(rows, spec, source))
        if invalid:
            self.drop(table, invalid, "validation", str(error))
        if not parts:
            return
        data = pa.concat_tables(parts).combine_chunks()
        index = self.next_part[table]
        self.next_part[table] = index + 1
        try:
            write_telemetry_part(self.out_dir, table, data, index)
        except Exception as exc:  # noqa: BLE001 -- the engine must keep running whatever the disk says
            self.drop(table, data.num_rows, "write", f"writing part {index} failed: {exc!r}")
            return
        with self.lock:
            self.written[table] = self.written.get(table, 0) + data.num_rows

    def drop(self, table: str, n: int, kind: str, message: str) -> None:
        """Count n dropped rows of a table; log the first drop of each kind per table."""
        with self.lock:
            self.dropped[table] = self.dropped.get(table, 0) + n
        if (kind, table) not in self.logged:
            self.logged.add((kind, table))
            log.warning("telemetry %s: dropping %d row(s): %s (logged once)", table, n, message)


def _next_part_index(table_dir: Path) -> int:
    """First part index not yet used in a table folder, so a restarted server never overwrites."""
    indices = [int(m.group(1)) for p in table_dir.glob("part-*.parquet") if (m := _PART.search(p.name))]
    return max(indices, default=-1) + 1


_Rows = TypeVar("_Rows", list[Mapping[str, Any]], pa.Table)


def _bisect(rows: _Rows, attempt: Callable[[_Rows], pa.Table]) -> tuple[list[pa.Table], int, Exception | None]:
    """Apply attempt to rows, splitting around the single rows it fails on; (results, failed rows, an error)."""
    try:
        return [attempt(rows)], 0, None
    except Exception as exc:  # noqa: BLE001 -- any malformed row (wrong type, overflow, null, range)
        if len(rows) == 1:
            return [], 1, exc
    mid = len(rows) // 2
    left, bad_left, error_left = _bisect(rows[:mid], attempt)
    right, bad_right, error_right = _bisect(rows[mid:], attempt)
    return left + right, bad_left + bad_right, error_left or error_right


class TelemetryWriter:
    """Bounded, drop-on-full queue of telemetry rows written to Parquet by a daemon thread."""

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        capacity: int = 20_000,
        rows_per_file: int = 50_000,
        flush_interval_s: float = 5.0,
        metadata: Mapping[str, Mapping[str, str]] | None = None,
        tables: Collection[str] | None = None,
    ) -> None:
        """Start the drain thread; ``metadata`` maps a table to key/values stored in each of its files.

        ``tables``: the tables written (default: all); rows put for another table are skipped, not counted as dropped.
        """
        if capacity < 1 or rows_per_file < 1 or flush_interval_s < 0:
            raise ValueError("capacity and rows_per_file must be >= 1 and flush_interval_s >= 0")
        unknown = (set(metadata or {}) | set(tables or ())) - set(TELEMETRY_TABLES)
        if unknown:
            raise ValueError(f"unknown telemetry tables: {sorted(unknown)} (known: {', '.join(TELEMETRY_TABLES)})")
        self.out_dir = Path(out_dir)
        self.tables = frozenset(TELEMETRY_TABLES if tables is None else tables)
        self._skipped = frozenset(TELEMETRY_TABLES) - self.tables
        self._drain = _Drain(self.out_dir, capacity, rows_per_file, flush_interval_s, metadata or {})
        self._finalizer = weakref.finalize(self, self._drain.close)

    def put(self, table: str, row: Mapping[str, Any]) -> bool:
        """Queue one row without blocking; False, and the row counted as dropped, if full or closed.

        The row is kept by reference until the drain thread converts it: do not mutate it afterwards.
        """
        if table in self._skipped:
            return True
        d = self._drain
        with d.lock:
            n = len(d.buf)
            if n < d.limit:
                d.buf.append((table, row))
            else:
                d.dropped[table] = d.dropped.get(table, 0) + 1
                return False
        if n == d.wake_at:
            d.wake.set()
        return True

    def flush(self) -> None:
        """Have the drain thread write every row queued so far, now; returns at once (safe on a hot path)."""
        d = self._drain
        d.flush_asked += 1
        d.wake.set()

    def close(self) -> None:
        """Write every queued row and stop the thread; later puts are dropped. Idempotent."""
        self._finalizer()

    @property
    def dropped(self) -> int:
        """Rows dropped so far, all tables together (full queue, closed writer, bad rows, failed writes)."""
        with self._drain.lock:
            return sum(self._drain.dropped.values())

    @property
    def dropped_by_table(self) -> dict[str, int]:
        """Rows dropped so far per table name (as given to put)."""
        with self._drain.lock:
            return dict(self._drain.dropped)

    @property
    def rows_written(self) -> dict[str, int]:
        """Rows written to Parquet so far per table."""
        with self._drain.lock:
            return dict(self._drain.written)


def from_env(**kwargs: Any) -> TelemetryWriter | None:
    """A writer into ``$KVPILOT_TELEMETRY_DIR``, or None when it is unset or empty."""
    out_dir = os.environ.get(ENV_DIR)
    return TelemetryWriter(out_dir, **kwargs) if out_dir else None
