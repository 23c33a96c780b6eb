"""Importers of public trace formats into the WORKLOAD table (:data:`data.schemas.WORKLOAD`).

Every importer streams its JSONL files line by line. A malformed line raises
:class:`data.errors.DataValidationError` naming the file, the 1-based line and the
field; with ``skip_bad=True`` the line is left out and listed in
``ImportResult.skipped`` instead. Where a trace's numbers disagree with the
workload contract and the importer has to change them, the change is listed in
``ImportResult.repaired``. Nothing is dropped or changed silently.

Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``)
  One row per line: a one-turn, one-sample session (kind ``rollout``, step 0,
  group of size 1), ``arrival_s = timestamp / 1000``. The domain is the file's
  stem without a trailing ``_trace`` (``synthetic_trace.jsonl`` -> ``synthetic``)
  unless given. The paradigm is ``reward_model``: of the four, it is the closest
  profile (prefill-heavy, short outputs, heavy prefix sharing). ``hash_ids`` are
  kept as the block hashes, so prefix sharing is exact; ids of the i-th file are
  offset by ``i * 2**40`` so separate files never share blocks by accident.
  Block-count rule: ``len(hash_ids)`` must equal ``ceil(input_length / block_size)``
  (it does on every line of the FAST'25 synthetic trace). A trace that hashes
  only full blocks (``floor``) is accepted too: the partial tail block gets a
  fresh negative id that nothing else shares. Any other count is a bad line.
  ``max_tokens = output_length``; ``finish_reason`` is ``stop``, because the trace
  records the natural response length and the cap only bounds the replay.

PolyTrace Search-R1 multi-turn (``turns[]``, ``tool_calls[]``)
  One session per line, grouped by ``(step, prompt_group_id)`` across all files;
  ``group_size`` is the number of imported samples of the group and
  ``sample_index`` the rank of ``sample_id`` in it. Domain ``agentic``, paradigm
  ``search_tool``, ``arrival_s`` null (synchronous batch). The prompt is not the
  same across steps (its length differs), so ``prompt_id`` is per step.
  Token accounting found in the trace: ``prompt[k+1] = prompt[k] + completion[k]
  + sum(append_len) + 3`` on ~93% of transitions (``append_len`` is the tool
  response with its wrapper; ``response_token_len`` is ~14 tokens shorter; 3 is
  the chat template). Neither field alone fits, so ``tool_tokens`` is derived:
  ``prompt[k+1] - prompt[k] - completion[k]``. On ~0.5% of transitions that is
  negative: the rollout kept only the head of a long completion (its
  ``assistant_append_len``). There the output is cut to what the next prompt
  holds (``prompt[k+1] - prompt[k] - tool``, with ``tool = sum(append_len)``
  capped by the growth) and the change is listed in ``repaired``. Several tool
  calls in one turn count as one pause: the tool name (names joined by ``+``
  when they differ), the longest latency (calls run concurrently), the derived
  tokens. Finish reasons map ``tool_calls -> tool_call``; a last turn that ended
  on a tool call has no next turn, so it becomes ``stop`` and a tool call logged
  after it is dropped (listed in ``repaired``).

PolyTrace packed lengths (DAPO math, DeepCoder: ``input``, ``output[n]``)
  One group per line of ``n_sampling`` one-turn sessions sharing the prompt's
  blocks. Domain from the path (``dapo``/``math`` -> ``math``, ``deepcoder``/
  ``code`` -> ``code``) unless given; paradigm follows the domain. Lines do not
  line up across step files (prompt lengths differ line by line), so
  ``prompt_id`` is per step and line. ``max_tokens`` is the sampling cap:
  16000 for code (DeepCoder), 20480 for math (DAPO recipe; no output reaches
  it); an output equal to the cap finishes ``length``, others ``stop``.

Block hashes of the PolyTrace importers are chain hashes: block i's hash mixes
block i-1's hash with the key of its owner (the group's prompt, or the session
after it) and its fill, so equal hashes mean equal prefixes and a partial block
never equals the full block it grows into.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa

from data.errors import DataValidationError
from data.schemas import DOMAINS, PARADIGMS, WORKLOAD

PathsLike = str | Path | Iterable[str | Path]
Issue = tuple[str, int, str]  # (file, 1-based line, reason)

_MASK = (1 << 64) - 1
_FILE_ID_STRIDE = 1 << 40
_PARADIGM_OF_DOMAIN = dict(zip(DOMAINS, PARADIGMS))
_LENGTH_CAPS = {"code": 16000, "math": 20480}
_FINISH = {"tool_calls": "tool_call", "tool_call": "tool_call", "stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class ImportResult:
    """An imported workload table and the lines that were skipped or repaired."""

    table: pa.Table
    skipped: list[Issue] = field(default_factory=list)
    repaired: list[Issue] = field(default_factory=list)


class _BadLine(Exception):
    """A malformed line: the offending field and why."""

    def __init__(self, column: str, reason: str) -> None:
        super().__init__(f"{column}: {reason}")
        self.column = column
        self.reason = reason


# ---------------------------------------------------------------- line reading


def _paths(paths: PathsLike) -> list[Path]:
    """Normalise one path or an iterable of paths; any that is not a file raises :class:`FileNotFoundError`."""
    files = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"no such file: {', '.join(missing)}")
    return files


def _records(path: Path, skip_bad: bool, skipped: list[Issue]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, JSON object) for each non-blank line; bad JSON raises or is skipped."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                _reject(path, lineno, _BadLine("<line>", "not UTF-8 text (a JSONL trace is one JSON object per line)"),
                        skip_bad, skipped)
                continue
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
                if not isinstance(obj, dict):
                    raise _BadLine("<line>", f"expected a JSON object, got {type(obj).__name__}")
            except json.JSONDecodeError as exc:
                _reject(path, lineno, _BadLine("<line>", f"invalid JSON ({exc.msg})"), skip_bad, skipped)
                continue
            except _BadLine as exc:
                _reject(path, lineno, exc, skip_bad, skipped)
                continue
            yield lineno, obj


def _reject(path: Path, lineno: int, exc: _BadLine, skip_bad: bool, skipped: list[Issue]) -> None:
    """Raise a DataValidationError for a bad line, or record it when skipping."""
    if not skip_bad:
        raise DataValidationError(exc.reason, file=str(path), column=exc.column, line=lineno) from exc
    skipped.append((str(path), lineno, f"{exc.column}: {exc.reason}"))


def _get(obj: dict[str, Any], key: str, where: str = "") -> Any:
    """The value of a required key."""
    if key not in obj:
        raise _BadLine(where + key, "missing")
    return obj[key]


def _int(obj: dict[str, Any], key: str, minimum: int = 0, where: str = "") -> int:
    """A required integer field with a lower bound."""
    return _check_int(_get(obj, key, where), where + key, minimum)


def _check_int(value: Any, name: str, minimum: int = 0) -> int:
    """Check that a value is an integer (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _BadLine(name, f"expected an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise _BadLine(name, f"must be >= {minimum}, got {value}")
    return value


def _number(obj: dict[str, Any], key: str, where: str = "") -> float:
    """A required finite, non-negative number."""
    value = _get(obj, key, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _BadLine(where + key, f"expected a finite number, got {value!r}")
    if value < 0:
        raise _BadLine(where + key, f"must be >= 0, got {value}")
    return float(value)


def _list(obj: dict[str, Any], key: str, where: str = "") -> list[Any]:
    """A required list field."""
    value = _get(obj, key, where)
    if not isinstance(value, list):
        raise _BadLine(where + key, f"expected a list, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------- hashing and rows


def _mix(x: int) -> int:
    """splitmix64 finaliser: a fast, deterministic 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _key(text: str) -> int:
    """A stable 64-bit key for an owner name (group or session)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _signed(x: int) -> int:
    """Reinterpret an unsigned 64-bit value as int64."""
    return x - (1 << 64) if x >= 1 << 63 else x


class _Chains:
    """Chain hashes of token streams made of a shared group prompt and per-session continuations."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.bs = block_size
        self._full: dict[str, tuple[list[int], list[int]]] = {}  # session -> its full blocks: (unsigned, int64)

    def blocks(self, group: str, prompt_len: int, session: str, n_tokens: int) -> list[int]:
        """Block hashes of the first ``n_tokens`` of a session whose first ``prompt_len`` are the group's."""
        bs = self.bs
        raw, signed = self._full.setdefault(session, ([], []))
        gkey, skey = _key(group), _key(session)

        def link(prev: int, i: int, fill: int) -> int:
            owner = gkey if i * bs + fill <= prompt_len else skey
            return _mix(prev ^ ((owner + i * (bs + 1) + fill) & _MASK))

        n_full = n_tokens // bs
        for i in range(len(raw), n_full):
            raw.append(link(raw[-1] if raw else 0, i, bs))
            signed.append(_signed(raw[-1]))
        out = signed[:n_full]
        fill = n_tokens - n_full * bs
        if fill:
            out.append(_signed(link(raw[n_full - 1] if n_full else 0, n_full, fill)))
        return out


def _new_columns() -> dict[str, list[Any]]:
    """Empty column lists in WORKLOAD order."""
    return {name: [] for name in WORKLOAD.schema.names}


def _append(cols: dict[str, list[Any]], **row: Any) -> None:
    """Append one row; nullable columns not given are null."""
    for name, values in cols.items():
        values.append(row.get(name))


def _table(cols: dict[str, list[Any]]) -> pa.Table:
    """Build the WORKLOAD table from column lists."""
    return pa.table(cols, schema=WORKLOAD.schema)


# ---------------------------------------------------------------- Mooncake


def import_mooncake(
    paths: PathsLike, *, skip_bad: bool = False, block_size: int = 512, domain: str | None = None
) -> ImportResult:
    """Import Mooncake-format JSONL traces: one single-turn request per line, in arrival order."""
    skipped: list[Issue] = []
    rows: list[tuple[float, int, int, dict[str, Any]]] = []
    for file_index, path in enumerate(_paths(paths)):
        dom = domain or re.sub(r"_?trace$", "", path.stem) or "trace"
        for lineno, obj in _records(path, skip_bad, skipped):
            try:
                row = _mooncake_row(obj, file_index, lineno, block_size)
            except _BadLine as exc:
                _reject(path, lineno, exc, skip_bad, skipped)
                continue
            rid = f"{path.stem}:{lineno}"
            row.update(request_id=rid, prompt_id=rid, group_id=rid, session_id=rid, domain=dom)
            rows.append((row["arrival_s"], file_index, lineno, row))
    rows.sort(key=lambda r: r[:3])
    cols = _new_columns()
    for *_, row in rows:
        _append(cols, **row)
    return ImportResult(_table(cols), skipped)


def _mooncake_row(obj: dict[str, Any], file_index: int, lineno: int, block_size: int) -> dict[str, Any]:
    """Check one Mooncake record and turn it into the request's fields (ids and domain excluded)."""
    arrival = _number(obj, "timestamp") / 1000.0
    prompt = _int(obj, "input_length", 1)
    output = _int(obj, "output_length", 1)
    ids = [_check_int(h, f"hash_ids[{i}]") for i, h in enumerate(_list(obj, "hash_ids"))]
    if any(h >= _FILE_ID_STRIDE for h in ids):
        raise _BadLine("hash_ids", f"ids must be < 2**40, got {max(ids)}")
    offset = file_index * _FILE_ID_STRIDE
    hashes = [offset + h for h in ids]
    n_ceil, n_floor = -(-prompt // block_size), prompt // block_size
    if len(ids) == n_floor != n_ceil:
        hashes.append(-(offset + lineno))  # partial tail block: unique to this request
    elif len(ids) != n_ceil:
        raise _BadLine(
            "hash_ids",
            f"{len(ids)} ids for input_length {prompt}: expected ceil({prompt}/{block_size}) = {n_ceil}"
            f" (or {n_floor} full blocks only); is block_size right?",
        )
    return dict(
        kind="rollout", step=0, group_size=1, sample_index=0, turn=0, paradigm="reward_model",
        prompt_tokens=prompt, output_tokens=output, max_tokens=output, finish_reason="stop",
        block_size=block_size, block_hashes=hashes, arrival_s=arrival,
    )


# ---------------------------------------------------------------- PolyTrace Search-R1


@dataclass
class _Turn:
    """One parsed turn of a trajectory, before tool accounting."""

    prompt: int
    completion: int
    max_new: int
    finish: str


class _ToolCall(NamedTuple):
    """One parsed tool call."""

    name: str
    latency: float
    append: int


@dataclass
class _Trajectory:
    """One parsed Search-R1 line."""

    file: str
    line: int
    step: int
    group: int | str
    sample: int
    turns: list[_Turn]
    tools: dict[int, list[_ToolCall]]  # turn -> its tool calls


def import_polytrace_multiturn(paths: PathsLike, *, skip_bad: bool = False, block_size: int = 16) -> ImportResult:
    """Import PolyTrace Search-R1 rollouts: one session per line, GRPO groups by (step, prompt_group_id)."""
    files = _paths(paths)
    skipped: list[Issue] = []
    groups: dict[tuple[int, int | str], dict[int, _Trajectory]] = defaultdict(dict)
    for path in files:
        for lineno, obj in _records(path, skip_bad, skipped):
            try:
                traj = _parse_trajectory(obj, str(path), lineno)
                members = groups[(traj.step, traj.group)]
                if traj.sample in members:
                    first = members[traj.sample]
                    raise _BadLine("sample_id", f"duplicate sample {traj.sample} of group {traj.group} step "
                                                f"{traj.step} (first at {first.file}:{first.line})")
            except _BadLine as exc:
                _reject(path, lineno, exc, skip_bad, skipped)
                continue
            members[traj.sample] = traj
    label = files[0].parent.name if files else "polytrace"
    chains = _Chains(block_size)
    cols = _new_columns()
    repaired: list[Issue] = []
    for (step, group) in sorted(groups, key=lambda key: (key[0], isinstance(key[1], str), key[1])):
        members = groups[(step, group)]
        group_id = f"{label}:s{step}:g{group}"
        for index, sample in enumerate(sorted(members)):
            traj = members[sample]
            session_id = f"{group_id}:n{sample}"
            for turn, fields in enumerate(_session_turns(traj, repaired)):
                _append(
                    cols, request_id=f"{session_id}:t{turn}", kind="rollout", step=step, prompt_id=group_id,
                    group_id=group_id, group_size=len(members), sample_index=index, session_id=session_id,
                    turn=turn, domain="agentic", paradigm="search_tool", block_size=block_size,
                    block_hashes=chains.blocks(group_id, traj.turns[0].prompt, session_id, fields["prompt_tokens"]),
                    **fields,
                )
    return ImportResult(_table(cols), skipped, repaired)


def _parse_trajectory(obj: dict[str, Any], file: str, lineno: int) -> _Trajectory:
    """Check one Search-R1 record: ids, turns in order with growing prompts, tool calls in order."""
    step = _int(obj, "step")
    group = _get(obj, "prompt_group_id")
    if isinstance(group, bool) or not isinstance(group, (int, str)):
        raise _BadLine("prompt_group_id", f"expected an integer or string, got {group!r}")
    sample = _int(obj, "sample_id")
    raw_turns = _list(obj, "turns")
    if not raw_turns:
        raise _BadLine("turns", "empty")
    turns: list[_Turn] = []
    for k, t in enumerate(raw_turns):
        where = f"turns[{k}]."
        if not isinstance(t, dict):
            raise _BadLine(f"turns[{k}]", "expected an object")
        if _int(t, "turn", where=where) != k:
            raise _BadLine(where + "turn", f"out of order: expected {k}, got {t['turn']}")
        turn = _Turn(
            prompt=_int(t, "prompt_tokens", 1, where),
            completion=_int(t, "completion_tokens", 0, where),
            max_new=_int(t, "max_new_tokens", 1, where),
            finish=_get(t, "finish_reason", where),
        )
        if turn.finish not in _FINISH:
            raise _BadLine(where + "finish_reason", f"unknown value {turn.finish!r}")
        if turn.completion > turn.max_new:
            raise _BadLine(where + "completion_tokens", f"{turn.completion} exceeds max_new_tokens {turn.max_new}")
        if turns and _FINISH[turns[-1].finish] != "tool_call":
            raise _BadLine(f"turns[{k - 1}].finish_reason", f"{turns[-1].finish!r}, yet turn {k} follows")
        if turns and turn.prompt <= turns[-1].prompt:
            raise _BadLine(where + "prompt_tokens", f"{turn.prompt} does not extend turn {k - 1}'s {turns[-1].prompt}")
        turns.append(turn)
    tools: dict[int, list[_ToolCall]] = defaultdict(list)
    last = -1
    for j, c in enumerate(_list(obj, "tool_calls")):
        where = f"tool_calls[{j}]."
        if not isinstance(c, dict):
            raise _BadLine(f"tool_calls[{j}]", "expected an object")
        turn = _int(c, "turn", where=where)
        if turn < last or turn >= len(turns):
            raise _BadLine(where + "turn", f"out of order or beyond the last turn: {turn}")
        name = _get(c, "tool_name", where)
        if not isinstance(name, str):
            raise _BadLine(where + "tool_name", f"expected a string, got {name!r}")
        tools[turn].append(_ToolCall(name, _number(c, "latency_s", where), _int(c, "append_len", 0, where)))
        last = turn
    missing = [k for k in range(len(turns) - 1) if k not in tools]
    if missing:
        raise _BadLine("tool_calls", f"no tool call after turn {missing[0]}, yet turn {missing[0] + 1} follows")
    return _Trajectory(file, lineno, step, group, sample, turns, dict(tools))


def _session_turns(traj: _Trajectory, repaired: list[Issue]) -> Iterator[dict[str, Any]]:
    """Per-turn fields of a trajectory, with tool tokens derived so prompt[k+1] = prompt[k] + output[k] + tool."""
    turns, n = traj.turns, len(traj.turns)
    if traj.tools.get(n - 1):
        repaired.append((traj.file, traj.line, f"dropped {len(traj.tools[n - 1])} tool call(s) after the last turn"))
    for k, t in enumerate(turns):
        finish = _FINISH[t.finish]
        fields: dict[str, Any] = dict(prompt_tokens=t.prompt, output_tokens=t.completion, max_tokens=t.max_new)
        if k == n - 1:
            fields["finish_reason"] = "stop" if finish == "tool_call" else finish
            yield fields
            continue
        calls = traj.tools[k]
        growth = turns[k + 1].prompt - t.prompt
        tool_tokens = growth - t.completion
        if tool_tokens < 0:
            tool_tokens = min(sum(c.append for c in calls), growth)
            fields["output_tokens"] = growth - tool_tokens
            repaired.append((traj.file, traj.line, f"turn {k}: output cut from {t.completion} to "
                                                   f"{fields['output_tokens']} tokens kept in turn {k + 1}'s prompt"))
        fields.update(
            finish_reason=finish,
            tool="+".join(sorted({c.name for c in calls})),
            tool_latency_s=max(c.latency for c in calls),
            tool_tokens=tool_tokens,
        )
        yield fields


# ---------------------------------------------------------------- PolyTrace packed lengths


def import_polytrace_lengths(
    paths: PathsLike,
    *,
    domain: str | None = None,
    skip_bad: bool = False,
    block_size: int = 16,
    max_tokens: int | None = None,
) -> ImportResult:
    """Import PolyTrace packed-length files (DAPO math, DeepCoder): one GRPO group of one-turn sessions per line."""
    skipped: list[Issue] = []
    chains = _Chains(block_size)
    cols = _new_columns()
    for path in _paths(paths):
        dom = domain or _domain_from_path(path)
        if dom not in _PARADIGM_OF_DOMAIN:
            raise ValueError(f"unknown domain {dom!r}; expected one of {DOMAINS}")
        cap = max_tokens if max_tokens is not None else _LENGTH_CAPS.get(dom)
        if cap is None:
            raise ValueError(f"no default max_tokens for domain {dom!r}; pass max_tokens=")
        for lineno, obj in _records(path, skip_bad, skipped):
            try:
                step, prompt, outputs = _parse_lengths(obj, cap)
            except _BadLine as exc:
                _reject(path, lineno, exc, skip_bad, skipped)
                continue
            group_id = f"{path.parent.name}/{path.stem}:{lineno}"
            for j, output in enumerate(outputs):
                session_id = f"{group_id}:n{j}"
                _append(
                    cols, request_id=f"{session_id}:t0", kind="rollout", step=step, prompt_id=group_id,
                    group_id=group_id, group_size=len(outputs), sample_index=j, session_id=session_id, turn=0,
                    domain=dom, paradigm=_PARADIGM_OF_DOMAIN[dom], prompt_tokens=prompt, output_tokens=output,
                    max_tokens=cap, finish_reason="length" if output == cap else "stop", block_size=block_size,
                    block_hashes=chains.blocks(group_id, prompt, session_id, prompt),
                )
    return ImportResult(_table(cols), skipped)


def _domain_from_path(path: Path) -> str:
    """Infer math or code from a PolyTrace path."""
    text = str(path).lower()
    if "dapo" in text or "math" in text:
        return "math"
    if "deepcoder" in text or "code" in text:
        return "code"
    raise ValueError(f"cannot infer the domain of {path}: its path names neither math (dapo, math) nor code "
                     f"(deepcoder, code), as PolyTrace's do; rename it so that it does (the API takes domain=)")


def _parse_lengths(obj: dict[str, Any], cap: int) -> tuple[int, int, list[int]]:
    """Check one packed-lengths record: (step, prompt tokens, sampled output lengths)."""
    step = _int(obj, "step")
    prompt = _int(obj, "input", 1)
    outputs = [_check_int(o, f"output[{i}]", 1) for i, o in enumerate(_list(obj, "output"))]
    if not outputs:
        raise _BadLine("output", "empty")
    if "n_sampling" in obj and _int(obj, "n_sampling", 1) != len(outputs):
        raise _BadLine("n_sampling", f"{obj['n_sampling']} but {len(outputs)} outputs")
    for i, o in enumerate(outputs):
        if o > cap:
            raise _BadLine(f"output[{i}]", f"{o} exceeds max_tokens {cap}")
    return step, prompt, outputs
