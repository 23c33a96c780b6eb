"""Validation of workload and telemetry tables against their :class:`~data.schemas.TableSpec`.

Two stages. :func:`conform_table` checks one input's columns, types and nulls and casts
it to the spec's exact schema. :func:`check_rows` checks what the types cannot say
(token counts, enumerations, turn chains, group and session references) on a table
that may be the concatenation of several files, so cross-file structure is checked
too while each error still names the file and the row within it. Checks are
vectorised (pyarrow.compute and numpy): a million-row workload takes a few seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.errors import DataValidationError
from data.schemas import (
    DECISION_KINDS,
    FINISH_REASONS,
    KV_EVENT_KINDS,
    PARADIGMS,
    REQUEST_KINDS,
    TableSpec,
)

#: One input of a (possibly concatenated) table: its name in errors and its row count.
Part = tuple[str, int]

# Pairs of list elements compared per batch by the hash-prefix check, to bound memory.
_PREFIX_BATCH = 1 << 22


def validate_table(
    table: pa.Table, spec: TableSpec, source: str, *, columns: Sequence[str] | None = None
) -> pa.Table:
    """Validate ``table`` against ``spec`` and return it cast to the spec's schema, in spec order.

    ``source`` names the input in errors. ``columns`` restricts validation to a projection:
    only those columns are expected, and checks needing others are skipped.
    """
    conformed = conform_table(table, spec, source, columns=columns)
    check_rows(conformed, spec, [(source, conformed.num_rows)])
    return conformed


def conform_table(
    table: pa.Table, spec: TableSpec, source: str, *, columns: Sequence[str] | None = None
) -> pa.Table:
    """Check columns, types and nulls of one input; return it cast to the spec, in spec order."""
    fields = _projected_fields(spec, columns)
    wanted = {f.name for f in fields}
    seen: set[str] = set()
    for name in table.column_names:
        if name in seen:
            raise DataValidationError("column appears twice", file=source, column=name)
        seen.add(name)
        if name not in wanted:
            where = "the requested columns" if name in spec.schema.names else f"the {spec.name} schema"
            raise DataValidationError(
                f"unexpected column (not in {where}); drop it explicitly rather than lose it silently",
                file=source,
                column=name,
            )
    arrays = []
    for field in fields:
        if field.name not in seen:
            if not field.nullable:
                raise DataValidationError(
                    f"missing required column of the {spec.name} table", file=source, column=field.name
                )
            arrays.append(pa.chunked_array([pa.nulls(table.num_rows, field.type)], field.type))
            continue
        column = _cast(table.column(field.name), field, source)
        _check_nulls(column, field, source)
        arrays.append(column)
    metadata = {k: v for k, v in (table.schema.metadata or {}).items() if k != b"pandas"}
    schema = pa.schema(fields, metadata=metadata or None)
    return pa.Table.from_arrays(arrays, schema=schema)


def check_rows(table: pa.Table, spec: TableSpec, parts: Sequence[Part]) -> None:
    """Run the semantic checks of ``spec`` on a conformed table made of ``parts`` in order.

    Checks needing a column the table lacks (a projection) are skipped.
    """
    if table.num_rows == 0:
        return
    rows = _Rows(table.combine_chunks(), parts)
    present = set(table.column_names)
    for needed, check in _CHECKS.get(spec.name, []):
        if present.issuperset(needed):
            check(rows)


def _projected_fields(spec: TableSpec, columns: Sequence[str] | None) -> list[pa.Field]:
    """Fields of the spec kept by a projection, in spec order."""
    if columns is None:
        return list(spec.schema)
    unknown = [c for c in columns if c not in spec.schema.names]
    if unknown:
        raise ValueError(f"no column(s) {unknown} in the {spec.name} schema; it has {spec.schema.names}")
    return [f for f in spec.schema if f.name in columns]


# -- types and nulls ---------------------------------------------------------------------


def _family(t: pa.DataType) -> object:
    """What a type holds, ignoring width: only types of one family cast into each other."""
    if pa.types.is_dictionary(t):
        return _family(t.value_type)
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return "list"
    return str(t)


def _castable(source: pa.DataType, target: pa.DataType) -> bool:
    """Whether a column of ``source`` type may be cast (checked value by value) to ``target``."""
    if pa.types.is_null(source):
        return True
    a, b = _family(source), _family(target)
    if a == b == "list":
        return _castable(source.value_type, target.value_type)
    return a == b or (a, b) == ("integer", "float")


def _cast(column: pa.ChunkedArray, field: pa.Field, source: str) -> pa.ChunkedArray:
    """The column as the field's type; integer widths and float widths convert if values fit."""
    if column.type == field.type:
        return column
    if not _castable(column.type, field.type):
        raise DataValidationError(
            f"wrong type: expected {field.type}, got {column.type}",
            file=source,
            column=field.name,
            row=_first_true(column.is_valid()) or 0,
        )
    try:
        return column.cast(field.type, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        array = _combined(column)
        row = _first_uncastable(array, field.type)
        raise DataValidationError(
            f"value {array[row].as_py()!r} does not fit {field.type}", file=source, column=field.name, row=row
        ) from None


def _first_uncastable(array: pa.Array, target: pa.DataType) -> int:
    """Row of the first value that does not cast to ``target``, by bisection (linear total work)."""
    lo, hi = 0, len(array)  # array[lo:hi] holds a value that fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            array.slice(lo, mid - lo).cast(target, safe=True)
            lo = mid
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            hi = mid
    return lo


def _check_nulls(column: pa.ChunkedArray, field: pa.Field, source: str) -> None:
    """Reject nulls in a non-nullable column, and nulls inside any list."""
    if not field.nullable and column.null_count:
        raise DataValidationError(
            "null in a required column", file=source, column=field.name, row=_first_true(column.is_null())
        )
    if pa.types.is_list(field.type):
        row = _first_nested_null(_combined(column))
        if row is not None:
            raise DataValidationError("null inside a list", file=source, column=field.name, row=row)


def _first_nested_null(array: pa.ListArray) -> int | None:
    """Index of the first list in ``array`` holding a null at any depth."""
    offsets = array.offsets.to_numpy()
    start, end = int(offsets[0]), int(offsets[-1])
    child = array.values.slice(start, end - start)
    found = [_first_true(child.is_null())]
    if pa.types.is_list(child.type):
        found.append(_first_nested_null(child))
    found = [i for i in found if i is not None]
    if not found:
        return None
    return int(np.searchsorted(offsets, min(found) + start, side="right") - 1)


def _combined(column: pa.ChunkedArray) -> pa.Array:
    """A chunked column as one array."""
    if column.num_chunks == 1:
        return column.chunk(0)
    return pa.concat_arrays(column.chunks) if column.num_chunks else pa.array([], column.type)


def _first_true(mask: pa.Array | pa.ChunkedArray) -> int | None:
    """Index of the first true value of a boolean array, or None."""
    index = pc.index(mask, True).as_py()
    return None if index < 0 else index


# -- rows ----------------------------------------------------------------------------------


class _Rows:
    """A conformed table's columns as numpy arrays, and errors located in the right part."""

    def __init__(self, table: pa.Table, parts: Sequence[Part]) -> None:
        self.table = table
        self.n = table.num_rows
        self.sources = [name for name, _ in parts]
        self.ends = np.cumsum([count for _, count in parts])
        if not self.ends.size or self.ends[-1] != self.n:
            covered = int(self.ends[-1]) if self.ends.size else 0
            raise ValueError(f"parts cover {covered} rows, the table has {self.n}")
        self._cache: dict[tuple[str, str], Any] = {}

    def array(self, name: str) -> pa.Array:
        """The column as one Arrow array."""
        return _combined(self.table.column(name))

    def value(self, name: str, row: int) -> object:
        """One cell as a Python value."""
        return self.table.column(name)[row].as_py()

    def num(self, name: str) -> np.ndarray:
        """A numeric column as numpy; nulls read as 0 (mask them with :meth:`valid`)."""
        return self._cached("num", name, lambda: pc.fill_null(self.array(name), 0).to_numpy())

    def valid(self, name: str) -> np.ndarray:
        """Which rows of a column are not null."""
        return self._cached("valid", name, lambda: self.array(name).is_valid().to_numpy(zero_copy_only=False))

    def codes(self, name: str) -> np.ndarray:
        """A string column as integer codes in order of first appearance; null reads as -1."""

        def encode() -> np.ndarray:
            indices = pc.dictionary_encode(self.array(name)).indices
            return pc.fill_null(indices, -1).to_numpy().astype(np.int64)

        return self._cached("codes", name, encode)

    def key(self, name: str) -> np.ndarray:
        """Values of a column comparable with ``!=``: codes for strings, numbers otherwise."""
        return self.codes(name) if pa.types.is_string(self.table.schema.field(name).type) else self.num(name)

    def grouping(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows grouped by a string column's value (see :func:`_group`)."""
        return self._cached("grouping", name, lambda: _group(self.codes(name)))

    def fail(self, column: str, row: int, message: str) -> NoReturn:
        """Raise the error for a row of the concatenated table, named by its part and local row."""
        source, local = self.locate(row)
        raise DataValidationError(message, file=source, column=column, row=local)

    def locate(self, row: int) -> tuple[str, int]:
        """The part holding a row of the concatenated table, and the row within that part."""
        part = int(np.searchsorted(self.ends, row, side="right"))
        return self.sources[part], row - (int(self.ends[part - 1]) if part else 0)

    def _cached(self, kind: str, name: str, compute: Callable[[], Any]) -> Any:
        if (kind, name) not in self._cache:
            self._cache[(kind, name)] = compute()
        return self._cache[(kind, name)]


def _group(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions grouped by key, keeping their order within a group.

    Returns ``order`` (position of each sorted slot), ``start`` (sorted slot where each slot's
    group starts) and ``new`` (whether a sorted slot starts a group).
    """
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    new = np.ones(keys.size, dtype=bool)
    new[1:] = ordered[1:] != ordered[:-1]
    start = np.maximum.accumulate(np.where(new, np.arange(keys.size), 0))
    return order, start, new


def _first(mask: np.ndarray, rows: np.ndarray | None = None) -> int | None:
    """First table row where ``mask`` holds; ``rows`` maps mask positions to rows when not identity."""
    if rows is None:
        hits = np.flatnonzero(mask)
        return int(hits[0]) if hits.size else None
    hits = rows[mask]
    return int(hits.min()) if hits.size else None


def _show(value: object) -> str:
    """A value as it should read in an error message."""
    if isinstance(value, (np.floating, float)):
        return repr(float(value))
    if isinstance(value, np.integer):
        return str(int(value))
    return repr(value) if isinstance(value, str) else str(value)


# -- check registry ---------------------------------------------------------------------------

_Check = Callable[[_Rows], None]
_CHECKS: dict[str, list[tuple[tuple[str, ...], _Check]]] = {}


def _register(table: str, *columns: str, check: _Check) -> None:
    """Run ``check`` on ``table`` whenever all of ``columns`` are present."""
    _CHECKS.setdefault(table, []).append((columns, check))


def _check(table: str, *columns: str) -> Callable[[_Check], _Check]:
    """Decorator form of :func:`_register`."""

    def decorate(check: _Check) -> _Check:
        _register(table, *columns, check=check)
        return check

    return decorate


def _at_least(table: str, column: str, low: float, what: str, finite: bool = False) -> None:
    """Non-null values of ``column`` must be >= ``low`` (and, with ``finite``, not infinite)."""

    def check(rows: _Rows) -> None:
        x = rows.num(column)
        ok = (x >= low) & np.isfinite(x) if finite else x >= low
        bad = ~ok & rows.valid(column)
        row = _first(bad)
        if row is not None:
            v = x[row]
            if v != v:
                rows.fail(column, row, f"{what} is not a number")
            if v == math.inf:
                rows.fail(column, row, f"{what} is infinite")
            if v < 0 <= low:
                rows.fail(column, row, f"negative {what} ({_show(v)})")
            rows.fail(column, row, f"{what} must be at least {_show(low)}, got {_show(v)}")

    _register(table, column, check=check)


def _at_most(table: str, column: str, high: str | float, what: str) -> None:
    """Non-null values of ``column`` must be <= a number or another column ``high``."""

    def check(rows: _Rows) -> None:
        x = rows.num(column)
        limit = rows.num(high) if isinstance(high, str) else high
        bad = ~(x <= limit) & rows.valid(column)
        if isinstance(high, str):
            bad &= rows.valid(high)
        row = _first(bad)
        if row is not None:
            bound = f"{high} ({_show(limit[row])})" if isinstance(high, str) else _show(high)
            rows.fail(column, row, f"{what} ({_show(x[row])}) exceeds {bound}")

    _register(table, column, *([high] if isinstance(high, str) else []), check=check)


def _one_of(table: str, column: str, allowed: Sequence[str]) -> None:
    """Non-null values of ``column`` must be among ``allowed``."""

    def check(rows: _Rows) -> None:
        array = rows.array(column)
        bad = pc.and_(array.is_valid(), pc.invert(pc.is_in(array, value_set=pa.array(allowed))))
        row = _first_true(bad)
        if row is not None:
            value = rows.value(column, row)
            rows.fail(column, row, f"unknown {column} {value!r} (expected one of {', '.join(allowed)})")

    _register(table, column, check=check)


def _non_empty(table: str, column: str) -> None:
    """Values of a string column must hold more than blanks."""

    def check(rows: _Rows) -> None:
        blank = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(rows.array(column))), 0)
        row = _first_true(blank)
        if row is not None:
            rows.fail(column, row, f"empty {column}")

    _register(table, column, check=check)


def _unique(table: str, column: str) -> None:
    """Values of ``column`` must not repeat."""

    def check(rows: _Rows) -> None:
        codes = rows.codes(column)
        _, first = np.unique(codes, return_index=True)  # codes are 0..k-1, so first[c] is code c's row
        repeated = np.ones(rows.n, dtype=bool)
        repeated[first] = False
        row = _first(repeated)
        if row is not None:
            earlier = int(first[codes[row]])
            source, local = rows.locate(earlier)
            value = rows.value(column, row)
            rows.fail(column, row, f"duplicate {column} {value!r} (first at {source}, row {local})")

    _register(table, column, check=check)


def _constant_within(table: str, key: str, column: str, what: str) -> None:
    """All rows sharing a value of ``key`` must share the value of ``column``."""

    def check(rows: _Rows) -> None:
        order, start, _ = rows.grouping(key)
        values = rows.key(column)[order]
        row = _first(values != values[start], order)
        if row is not None:
            first = int(order[start[np.flatnonzero(order == row)[0]]])
            rows.fail(
                column,
                row,
                f"{what} {rows.value(key, row)!r} has {column} {rows.value(column, row)!r} here "
                f"but {rows.value(column, first)!r} on its first row",
            )

    _register(table, key, column, check=check)


# -- workload ---------------------------------------------------------------------------------

for _column, _low, _what in [
    ("step", 0, "step"),
    ("group_size", 1, "group size"),
    ("sample_index", 0, "sample index"),
    ("turn", 0, "turn"),
    ("prompt_tokens", 1, "token count"),
    ("output_tokens", 0, "token count"),
    ("max_tokens", 0, "token count"),
    ("block_size", 1, "block size"),
    ("tool_latency_s", 0, "latency"),
    ("tool_tokens", 0, "token count"),
    ("verify_latency_s", 0, "latency"),
    ("arrival_s", 0, "arrival time"),
]:
    _at_least("workload", _column, _low, _what, finite=True)
_at_most("workload", "output_tokens", "max_tokens", "output token count")
_one_of("workload", "kind", REQUEST_KINDS)
_one_of("workload", "finish_reason", FINISH_REASONS)
_one_of("workload", "paradigm", PARADIGMS)
_non_empty("workload", "domain")
_unique("workload", "request_id")


@_check("workload", "block_size")
def _block_size_constant(rows: _Rows) -> None:
    sizes = rows.num("block_size")
    row = _first(sizes != sizes[0])
    if row is not None:
        rows.fail("block_size", row, f"block size {sizes[row]} differs from {sizes[0]} on the first row")


@_check("workload", "block_hashes", "prompt_tokens", "block_size")
def _hash_chain_length(rows: _Rows) -> None:
    prompt, size = rows.num("prompt_tokens").astype(np.int64), rows.num("block_size").astype(np.int64)
    expected = -(-prompt // size)
    got = pc.list_value_length(rows.array("block_hashes")).to_numpy()
    row = _first(got != expected)
    if row is not None:
        rows.fail(
            "block_hashes",
            row,
            f"{got[row]} block hashes, but {prompt[row]} prompt tokens in blocks of {size[row]} "
            f"make {expected[row]}",
        )


@_check("workload", "sample_index", "group_size")
def _sample_in_group(rows: _Rows) -> None:
    index, size = rows.num("sample_index"), rows.num("group_size")
    row = _first(index >= size)
    if row is not None:
        rows.fail("sample_index", row, f"sample index {index[row]} is not below the group size {size[row]}")


@_check("workload", "session_id", "turn")
def _turns_in_order(rows: _Rows) -> None:
    order, start, _ = rows.grouping("session_id")
    expected = np.arange(rows.n) - start
    turns = rows.num("turn")[order]
    row = _first(turns != expected, order)
    if row is not None:
        position = np.flatnonzero(order == row)[0]
        rows.fail(
            "turn",
            row,
            f"session {rows.value('session_id', row)!r} has turn {turns[position]} where turn "
            f"{expected[position]} belongs: a session's turns must be 0..n-1, in table order",
        )


for _column in ("kind", "step", "group_id", "domain"):
    _constant_within("workload", "session_id", _column, "session")
for _column in ("step", "group_size"):
    _constant_within("workload", "group_id", _column, "group")


def _turn_pairs(rows: _Rows) -> tuple[np.ndarray, np.ndarray]:
    """Rows of each turn that has a next turn, and the rows of those next turns."""
    order, _, new = rows.grouping("session_id")
    follows = ~new[1:]
    return order[:-1][follows], order[1:][follows]


@_check("workload", "session_id", "turn", "prompt_tokens", "output_tokens", "tool_tokens")
def _context_grows(rows: _Rows) -> None:
    before, after = _turn_pairs(rows)
    prompt = rows.num("prompt_tokens").astype(np.int64)
    output = rows.num("output_tokens").astype(np.int64)
    tool = rows.num("tool_tokens").astype(np.int64)
    context = prompt[before] + output[before] + tool[before]
    bad = prompt[after] < context
    row = _first(bad, after)
    if row is not None:
        prev = int(before[np.flatnonzero(after == row)[0]])
        rows.fail(
            "prompt_tokens",
            row,
            f"turn {rows.value('turn', row)} of session {rows.value('session_id', row)!r} has {prompt[row]} "
            f"prompt tokens, fewer than the previous turn's context ({prompt[prev]} prompt + "
            f"{output[prev]} output + {tool[prev]} tool tokens)",
        )


@_check("workload", "session_id", "turn", "finish_reason", "tool", "tool_latency_s", "tool_tokens")
def _tool_between_turns(rows: _Rows) -> None:
    before, _ = _turn_pairs(rows)
    reasons = rows.array("finish_reason").take(pa.array(before))
    not_tool_call = pc.not_equal(reasons, "tool_call").to_numpy(zero_copy_only=False)
    problems = [
        ("finish_reason", not_tool_call, "must be 'tool_call'"),
        ("tool", ~rows.valid("tool")[before], "must name the tool called"),
        ("tool_latency_s", ~rows.valid("tool_latency_s")[before], "must give the tool's latency"),
        ("tool_tokens", ~rows.valid("tool_tokens")[before], "must give the tokens the tool appends"),
    ]
    found = [(row, col, need) for col, bad, need in problems if (row := _first(bad, before)) is not None]
    if found:
        row, column, need = min(found)
        rows.fail(
            column,
            row,
            f"turn {rows.value('turn', row)} of session {rows.value('session_id', row)!r} is followed by "
            f"another turn, so its {column} {need}",
        )


@_check("workload", "session_id", "turn", "prompt_tokens", "block_size", "block_hashes")
def _prefix_carries_over(rows: _Rows) -> None:
    before, after = _turn_pairs(rows)
    if not before.size:
        return
    hashes = rows.array("block_hashes")
    offsets = hashes.offsets.to_numpy().astype(np.int64)
    values = hashes.values.to_numpy()
    prompt, size = rows.num("prompt_tokens").astype(np.int64), rows.num("block_size").astype(np.int64)
    full = prompt[before] // size[before]
    full = np.minimum(full, offsets[after + 1] - offsets[after])  # a short chain fails the length check
    bad = np.zeros(before.size, dtype=bool)
    ends = np.cumsum(full)
    lo = 0
    while lo < before.size:
        budget = (ends[lo - 1] if lo else 0) + _PREFIX_BATCH
        hi = max(int(np.searchsorted(ends, budget, side="right")), lo + 1)
        counts = full[lo:hi]
        pair = np.repeat(np.arange(lo, hi), counts)
        within = np.arange(pair.size) - np.repeat(np.cumsum(counts) - counts, counts)
        differs = values[offsets[before[pair]] + within] != values[offsets[after[pair]] + within]
        bad[np.unique(pair[differs])] = True
        lo = hi
    row = _first(bad, after)
    if row is not None:
        pair = np.flatnonzero(after == row)[0]
        rows.fail(
            "block_hashes",
            row,
            f"turn {rows.value('turn', row)} of session {rows.value('session_id', row)!r} does not start "
            f"with the {full[pair]} full blocks of the previous turn's prompt",
        )


@_check("workload", "group_id", "session_id", "kind", "group_size")
def _group_not_overfull(rows: _Rows) -> None:
    sessions = rows.codes("session_id")
    _, first = np.unique(sessions, return_index=True)
    rollout = pc.equal(rows.array("kind"), "rollout").to_numpy(zero_copy_only=False)
    heads = np.sort(first[rollout[first]])  # first row of each rollout session, in table order
    order, start, _ = _group(rows.codes("group_id")[heads])
    rank = np.empty(heads.size, dtype=np.int64)  # how many of its group's sessions came before
    rank[order] = np.arange(heads.size) - start
    size = rows.num("group_size")[heads]
    row = _first(rank >= size, heads)
    if row is not None:
        rows.fail(
            "group_id",
            row,
            f"group {rows.value('group_id', row)!r} has more rollout sessions than its group size "
            f"{rows.value('group_size', row)}",
        )


@_check("workload", "kind", "session_id", "scores_session_id")
def _scoring_references(rows: _Rows) -> None:
    kind, scored = rows.array("kind"), rows.array("scores_session_id")
    rollout = pc.equal(kind, "rollout")
    row = _first_true(pc.and_(rollout, scored.is_valid()))
    if row is not None:
        rows.fail("scores_session_id", row, "a rollout request scores no session; this must be null")
    scoring = pc.equal(kind, "scoring")
    row = _first_true(pc.and_(scoring, scored.is_null()))
    if row is not None:
        rows.fail("scores_session_id", row, "a scoring request must name the rollout session it scores")
    targets = pc.unique(rows.array("session_id").filter(rollout))
    dangling = pc.and_(scoring, pc.invert(pc.is_in(scored, value_set=targets)))
    row = _first_true(dangling)
    if row is not None:
        rows.fail(
            "scores_session_id",
            row,
            f"dangling reference: no rollout session {rows.value('scores_session_id', row)!r} in this workload",
        )


# -- telemetry --------------------------------------------------------------------------------

for _column, _what in [
    ("step", "step"),
    ("turn", "turn"),
    ("replica", "replica"),
    ("prompt_tokens", "token count"),
    ("cached_tokens", "token count"),
    ("output_tokens", "token count"),
    ("computed_tokens", "token count"),
    ("max_tokens", "token count"),
    ("preemptions", "preemption count"),
]:
    _at_least("requests", _column, 0, _what)
_at_most("requests", "cached_tokens", "prompt_tokens", "cached token count")
_at_most("requests", "output_tokens", "max_tokens", "output token count")
_one_of("requests", "finish_reason", FINISH_REASONS)


@_check("requests", "arrival_s", "finish_s")
def _finish_after_arrival(rows: _Rows) -> None:
    arrival, finish = rows.num("arrival_s"), rows.num("finish_s")
    row = _first(rows.valid("finish_s") & ~(finish >= arrival))
    if row is not None:
        message = f"finish time {_show(finish[row])} is before arrival {_show(arrival[row])}"
        rows.fail("finish_s", row, message)


for _column, _what in [("replica", "replica"), ("engine_step", "engine step"), ("ttl_s", "TTL")]:
    _at_least("decisions", _column, 0, _what)
_at_least("decisions", "chosen", -1, "chosen index")
_one_of("decisions", "kind", DECISION_KINDS)


@_check("decisions", "features", "candidate_ids")
def _one_feature_vector_per_candidate(rows: _Rows) -> None:
    vectors = pc.list_value_length(rows.array("features")).to_numpy()
    candidates = pc.list_value_length(rows.array("candidate_ids")).to_numpy()
    row = _first(vectors != candidates)
    if row is not None:
        rows.fail("features", row, f"{vectors[row]} feature vectors for {candidates[row]} candidates")


@_check("decisions", "chosen", "candidate_ids")
def _chosen_is_a_candidate(rows: _Rows) -> None:
    chosen = rows.num("chosen")
    candidates = pc.list_value_length(rows.array("candidate_ids")).to_numpy()
    row = _first(chosen >= candidates)
    if row is not None:
        rows.fail("chosen", row, f"chosen index {chosen[row]} but only {candidates[row]} candidates")


@_check("decisions", "propensity")
def _propensity_is_a_probability(rows: _Rows) -> None:
    p = rows.num("propensity")
    row = _first(~((p > 0) & (p <= 1)))
    if row is not None:
        rows.fail("propensity", row, f"propensity {_show(p[row])} is not in (0, 1]")


for _column, _what in [
    ("engine_step", "engine step"),
    ("replica", "replica"),
    ("duration_s", "duration"),
    ("running", "count"),
    ("waiting", "count"),
    ("free_blocks", "count"),
    ("pinned_blocks", "count"),
    ("kv_usage", "KV usage"),
    ("prefill_tokens", "token count"),
    ("decode_tokens", "token count"),
    ("prefix_queries", "count"),
    ("prefix_hits", "count"),
    ("preemptions", "count"),
    ("evictions", "count"),
    ("held", "count"),
    ("offload_loaded_blocks", "count"),
    ("offload_stored_blocks", "count"),
    ("offload_loaded_bytes", "byte count"),
    ("offload_stored_bytes", "byte count"),
    ("dropped_rows", "count"),
    ("model_failures", "count"),
    ("prefill_context_tokens", "token count"),
    ("decode_context_tokens", "token count"),
    ("hook_s", "seconds"),
]:
    _at_least("steps", _column, 0, _what)
for _column, _what in [("num_gpu_blocks", "block count"), ("block_size", "block size"),
                       ("max_num_seqs", "count"), ("max_num_batched_tokens", "token count")]:
    _at_least("steps", _column, 1, _what)
_at_most("steps", "kv_usage", 1.0, "KV usage")
_at_most("steps", "prefix_hits", "prefix_queries", "prefix hit count")

for _column, _what in [("replica", "replica"), ("engine_step", "engine step"), ("num_tokens", "token count")]:
    _at_least("kv_events", _column, 0, _what)
_one_of("kv_events", "event", KV_EVENT_KINDS)
