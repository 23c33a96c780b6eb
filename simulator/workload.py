"""A workload prepared for simulation: validated once, taken apart once, shared by every run on it.

The boundary: whoever reads a workload validates it, once. :func:`load_workload`
reads a file (:func:`data.io.read_workload` validates as it reads) and
:func:`prepare_workload` validates a table in memory; both then prepare it
(:class:`PreparedWorkload`) and check what the simulator needs beyond the
WORKLOAD schema (:data:`data.schemas.WORKLOAD`): at least one request,
``arrival_s`` on every row (a trace replay) or on none (RL steps), at least
one output token per request (vLLM generates one), and streams whose requests
agree on their shared blocks (:class:`simulator.tokens.WorkloadTokens`). A
failure is a :class:`~simulator.errors.SimulationError`. Everything downstream
(the drivers, KV sizing, the summary) reads the prepared object and checks
nothing again; an evaluation prepares its workload once and runs every case on it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from data.errors import DataValidationError
from data.io import read_workload, source_of
from data.schemas import WORKLOAD
from data.validate import validate_table
from simulator.errors import SimulationError
from simulator.tokens import WorkloadTokens

__all__ = ["PreparedWorkload", "Session", "load_workload", "prepare_workload"]


@dataclass(frozen=True)
class Session:
    """One trajectory of the workload: its rollout turns (rows, by turn) and the rows of requests scoring it."""

    session_id: str
    step: int
    turns: tuple[int, ...]
    scoring: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class PreparedWorkload:
    """A validated WORKLOAD table and what the simulator reads of it, per row as Python values."""

    table: pa.Table
    tokens: WorkloadTokens
    #: Every row has ``arrival_s``: a trace replay (else synchronous RL steps).
    trace: bool
    request_id: list[str]
    kind: list[str]
    step: list[int]
    group_id: list[str]
    prompt_id: list[str | None]
    group_size: list[int]
    session_id: list[str]
    turn: list[int]
    domain: list[str]
    paradigm: list[str]
    max_tokens: list[int]
    finish_reason: list[str]
    tool: list[str | None]
    tool_latency_s: list[float | None]
    verify_latency_s: list[float | None]
    scores_session_id: list[str | None]
    arrival_s: list[float | None]
    prompt_tokens: list[int]
    output_tokens: list[int]
    row_of: dict[str, int]  # request id -> row
    #: Trajectories in order of their first rollout row.
    sessions: tuple[Session, ...]
    #: The RL step values, ascending.
    steps: tuple[int, ...]
    #: Tokens of the largest request at full length (prompt + output).
    largest_request: int
    #: What made the workload (:data:`data.io.SOURCE_KEY`), None when it does not say.
    source: dict | None = None

    @property
    def num_rows(self) -> int:
        return len(self.request_id)

    def time_scaled(self, scale: float) -> PreparedWorkload:
        """This workload with its tool and verifier latencies times ``scale`` (``replay --time-scale``)."""
        if scale == 1:
            return self
        scaled = {k: [None if v is None else v * scale for v in getattr(self, k)]
                  for k in ("tool_latency_s", "verify_latency_s")}
        table = self.table
        for name, values in scaled.items():
            i = table.schema.get_field_index(name)
            table = table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))
        return dataclasses.replace(self, table=table, **scaled)

    @functools.cached_property
    def kv_need(self) -> int:
        """Distinct vLLM blocks of the largest step (or the whole trace) at full length, nothing evicted (the
        ``--kv-fraction`` base, :mod:`simulator.sizing`)."""
        tokens = self.tokens
        streams = np.arange(len(tokens.stream_names))
        if self.trace:
            return tokens.blocks_needed(streams)
        step_of_stream = np.zeros(streams.size, np.int64)
        step_of_stream[tokens.stream] = self.step
        return max((tokens.blocks_needed(streams[step_of_stream == s]) for s in np.unique(step_of_stream)), default=0)

    def xargs(self, row: int, session_ids: bool = True) -> dict[str, Any]:
        """Row ``row``'s metadata as the hook reads it (the ``kvpilot_*`` ``vllm_xargs``); ``session_ids=False``
        leaves out the session identity (session, turn, tool), as verl and AReaL send none. A missing value is
        left out (the hook reads an absent key and a null alike)."""
        out = {
            "kvpilot_domain": self.domain[row],
            "kvpilot_paradigm": self.paradigm[row],
            "kvpilot_group_id": self.group_id[row],
            "kvpilot_group_size": self.group_size[row],
            "kvpilot_step": self.step[row],
            "kvpilot_prompt_id": self.prompt_id[row],
        }
        if session_ids:
            out.update(kvpilot_session_id=self.session_id[row], kvpilot_turn=self.turn[row],
                       kvpilot_tool=self.tool[row])
        return {k: v for k, v in out.items() if v is not None}

    def rows(self, request_ids: Iterable[str], aliases: Mapping[str, int] | None = None) -> np.ndarray:
        """Table rows of request ids; ``aliases`` maps the ids a run gave rows it submitted again (tail batching)."""
        row_of = {**self.row_of, **aliases} if aliases else self.row_of
        return np.array([row_of[r] for r in request_ids], np.int64)


def prepare_workload(table: pa.Table, source: str = "workload") -> PreparedWorkload:
    """Validate a WORKLOAD table (``source`` names it in errors) and prepare it; :class:`SimulationError` if bad."""
    try:
        table = validate_table(table, WORKLOAD, source)
    except DataValidationError as e:
        raise SimulationError(f"bad workload: {e}") from None
    return _prepare(table)


def load_workload(path: str | os.PathLike[str]) -> PreparedWorkload:
    """Read a workload file or directory (validated as read: ``DataValidationError``) and prepare it."""
    return _prepare(read_workload(path))


def _prepare(table: pa.Table) -> PreparedWorkload:
    """Prepare a validated table: the simulator's own checks, token expansion, columns, trajectories, steps."""
    n = table.num_rows
    if n == 0:
        raise SimulationError("the workload has no requests")
    arrival = table.column("arrival_s")
    if 0 < arrival.null_count < n:
        raise SimulationError("arrival_s must be set on every row (trace replay) or on none (RL steps); "
                              f"{arrival.null_count} of {n} rows have none")
    try:
        tokens = WorkloadTokens(table)
    except ValueError as e:
        raise SimulationError(f"bad workload: {e}") from None
    if (tokens.output < 1).any():
        r = int(np.argmax(tokens.output < 1))
        raise SimulationError(f"request {table.column('request_id')[r]} has output_tokens "
                              f"{tokens.output[r]}: vLLM generates at least one token per request")
    col = {name: table.column(name).to_pylist() for name in (
        "request_id", "kind", "step", "group_id", "prompt_id", "group_size", "session_id", "turn", "domain",
        "paradigm", "max_tokens", "finish_reason", "tool", "tool_latency_s", "verify_latency_s",
        "scores_session_id", "arrival_s")}
    kind, session = col["kind"], col["session_id"]
    turns: dict[str, list[int]] = {}  # validated: a session's turns are 0..n-1 in table order
    for i in range(n):
        if kind[i] == "rollout":
            turns.setdefault(session[i], []).append(i)
    scoring: dict[str, list[int]] = {s: [] for s in turns}  # validated: each names a rollout session
    for i in range(n):
        if kind[i] != "rollout":
            scoring[col["scores_session_id"][i]].append(i)
    step = col["step"]
    sessions = tuple(Session(s, step[rows[0]], tuple(rows), tuple(scoring[s])) for s, rows in turns.items())
    return PreparedWorkload(
        table=table, tokens=tokens, trace=arrival.null_count == 0, **col,
        prompt_tokens=tokens.prompt.tolist(), output_tokens=tokens.output.tolist(),
        row_of={r: i for i, r in enumerate(col["request_id"])},
        sessions=sessions, steps=tuple(sorted({s.step for s in sessions})),
        largest_request=int((tokens.prompt + tokens.output).max()), source=source_of(table),
    )
