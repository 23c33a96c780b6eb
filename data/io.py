"""Validating Parquet readers and writers for workloads and telemetry.

Writers validate before writing and write atomically (a temporary file renamed into
place), so a reader never sees half a file. Readers take one file or a directory of
part files (recursively, hive partitions included), check each file's columns and
types on its own and the rows of all of them together, and name the offending file
in every error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq

from data.errors import DataValidationError
from data.schemas import TELEMETRY_TABLES, WORKLOAD, TableSpec
from data.validate import check_rows, conform_table, validate_table

PathLike = str | os.PathLike[str]

# Schema metadata that must agree across the part files of one table (but for SOURCE_KEY).
_METADATA_PREFIX = b"kvpilot."
#: Schema metadata key of a workload's provenance, a JSON object: what made it (``generator``) and from what
#: (``kvpilot workload synth``: the whole generator ``config``; ``kvpilot workload import``: ``format``, ``files``).
#: Parts of one directory with different sources read as ``{"parts": [their sources]}``.
SOURCE_KEY = b"kvpilot.source"
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"


def write_table(table: pa.Table, path: PathLike, spec: TableSpec) -> Path:
    """Validate ``table`` against ``spec`` and write it as one Parquet file; returns the path.

    Columns outside the spec are an error, never dropped. Schema metadata (such as
    ``kvpilot.feature_names``) is kept.
    """
    path = Path(path)
    checked = validate_table(table, spec, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(checked, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_table(path: PathLike, spec: TableSpec, columns: Sequence[str] | None = None) -> pa.Table:
    """Read and validate one Parquet file, or every ``*.parquet`` under a directory in path order.

    ``columns`` reads only those columns (in that order) and skips checks that need others.
    """
    root = Path(path)
    tables = []
    parts = []
    for file in _parquet_files(root):
        table = conform_table(_read_file(file, root, spec, columns), spec, str(file), columns=columns)
        tables.append(table)
        parts.append((str(file), table.num_rows))
    table = _concat(tables, parts)
    check_rows(table, spec, parts)
    return table.select(list(columns)) if columns is not None else table


def read_workload(path: PathLike) -> pa.Table:
    """Read and validate a workload file or directory."""
    return read_table(path, WORKLOAD)


def write_workload(table: pa.Table, path: PathLike) -> Path:
    """Validate and write a workload to one Parquet file."""
    return write_table(table, path, WORKLOAD)


def with_source(table: pa.Table, source: Mapping) -> pa.Table:
    """``table`` with ``source`` as its provenance (:data:`SOURCE_KEY`), which Parquet files keep."""
    meta = dict(table.schema.metadata or {})
    meta[SOURCE_KEY] = json.dumps(source, sort_keys=True).encode()
    return table.replace_schema_metadata(meta)


def source_of(table: pa.Table) -> dict | None:
    """A workload table's provenance (:data:`SOURCE_KEY`), or None when it carries none (or none readable)."""
    raw = (table.schema.metadata or {}).get(SOURCE_KEY)
    if raw is None:
        return None
    try:
        out = json.loads(raw)
    except ValueError:
        return None
    return out if isinstance(out, dict) else None


def read_telemetry(directory: PathLike, name: str, columns: Sequence[str] | None = None) -> pa.Table:
    """Read and validate all part files of one telemetry table (``directory/name/``)."""
    return read_table(Path(directory) / name, _telemetry_spec(name), columns)


def write_telemetry_part(directory: PathLike, name: str, table: pa.Table, part_index: int) -> Path:
    """Validate and write part ``part_index`` of a telemetry table; an existing part is never overwritten."""
    path = Path(directory) / name / f"part-{part_index:05d}.parquet"
    if path.exists():
        raise FileExistsError(f"{path}: telemetry part {part_index} of {name!r} already exists")
    return write_table(table, path, _telemetry_spec(name))


def _telemetry_spec(name: str) -> TableSpec:
    if name not in TELEMETRY_TABLES:
        raise ValueError(f"unknown telemetry table {name!r}; expected one of {', '.join(TELEMETRY_TABLES)}")
    return TELEMETRY_TABLES[name]


def _parquet_files(root: Path) -> list[Path]:
    """The file itself, or the visible ``*.parquet`` files under a directory, sorted by path."""
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such file or directory")
    if root.is_file():
        return [root]
    files = sorted(
        (
            p
            for p in root.rglob("*.parquet")
            if p.is_file() and not any(part.startswith((".", "_")) for part in p.relative_to(root).parts)
        ),
        key=str,
    )
    if not files:
        raise FileNotFoundError(f"{root}: no Parquet files in this directory")
    return files


def _read_file(file: Path, root: Path, spec: TableSpec, columns: Sequence[str] | None) -> pa.Table:
    """One Parquet file, with hive partition values (``key=value`` folders) added as columns."""
    try:
        with pq.ParquetFile(file) as parquet:
            names = parquet.schema_arrow.names
            wanted = None if columns is None else [c for c in columns if c in names]
            table = parquet.read(columns=wanted)
    except (pa.ArrowException, OSError) as err:
        raise DataValidationError(f"not a readable Parquet file ({err})", file=str(file)) from None
    for key, value in _partitions(file, root):
        if key in spec.schema.names and key not in names and (columns is None or key in columns):
            column = _partition_column(file, spec.schema.field(key), value, table.num_rows)
            table = table.append_column(key, column)
    return table


def _partitions(file: Path, root: Path) -> list[tuple[str, str]]:
    """The ``key=value`` folders between ``root`` and ``file``."""
    if file == root:
        return []
    folders = file.relative_to(root).parts[:-1]
    return [(k, unquote(v)) for k, _, v in (f.partition("=") for f in folders if "=" in f)]


def _partition_column(file: Path, field: pa.Field, value: str, length: int) -> pa.Array:
    """A hive partition value repeated for every row of its file, as the field's type."""
    if value == _HIVE_NULL:
        return pa.nulls(length, field.type)
    try:
        scalar = pa.scalar(value).cast(field.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise DataValidationError(
            f"partition folder value {value!r} is not a {field.type}", file=str(file), column=field.name
        ) from None
    return pa.repeat(scalar, length)


def _concat(tables: list[pa.Table], parts: list[tuple[str, int]]) -> pa.Table:
    """Concatenate conformed parts; their ``kvpilot.*`` metadata must agree and is kept (their sources, when they
    differ, as ``{"parts": [...]}``)."""
    metadata = dict(tables[0].schema.metadata or {})
    ours = {k: v for k, v in metadata.items() if k.startswith(_METADATA_PREFIX) and k != SOURCE_KEY}
    for table, (source, _) in zip(tables[1:], parts[1:], strict=True):
        theirs = {k: v for k, v in (table.schema.metadata or {}).items()
                  if k.startswith(_METADATA_PREFIX) and k != SOURCE_KEY}
        if theirs != ours:
            raise DataValidationError(
                f"kvpilot schema metadata differs from that of {parts[0][0]}",
                file=source,
            )
    if len(tables) == 1:
        return tables[0]
    sources = [source_of(t) for t in tables]
    if any(x != sources[0] for x in sources):
        metadata[SOURCE_KEY] = json.dumps({"parts": sources}, sort_keys=True).encode()
    return pa.concat_tables([t.replace_schema_metadata(metadata) for t in tables])
