"""Importers of Mooncake and PolyTrace traces: real files, bad lines, group and chain structure."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from data.errors import DataValidationError
from data.importers import (
    ImportResult,
    import_mooncake,
    import_polytrace_lengths,
    import_polytrace_multiturn,
)
from data.schemas import WORKLOAD
from data.stats import workload_stats
from data.validate import validate_table

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
SEARCH_R1 = [TRACES / "polytrace" / "search_r1" / f"multiturn_workload_step_{s}.jsonl" for s in range(3)]
DAPO = sorted((TRACES / "polytrace" / "dapo_math").glob("packed_lengths_step_*.jsonl"))
DEEPCODER = sorted((TRACES / "polytrace" / "deepcoder").glob("packed_lengths_step_*.jsonl"))


def _need(*paths: Path) -> None:
    """Skip unless the shared trace files exist."""
    missing = [p for p in paths if not p.exists()]
    if missing or not paths:
        pytest.skip(f"real traces not found at {TRACES} (expected ../shared/traces next to the repo): {missing}")


def _valid(result: ImportResult, source: str) -> pa.Table:
    """The imported table, checked against the WORKLOAD contract."""
    assert result.table.schema.equals(WORKLOAD.schema)
    return validate_table(result.table, WORKLOAD, source)


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    return table.to_pylist()


def _write(path: Path, lines: list[Any]) -> Path:
    """Write JSONL: dicts are dumped, strings written as they are."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# ---------------------------------------------------------------- real traces


def test_mooncake_synthetic_trace() -> None:
    _need(MOONCAKE)
    result = import_mooncake(MOONCAKE)
    table = _valid(result, "mooncake")
    assert table.num_rows == 3993
    assert result.skipped == [] and result.repaired == []
    stats = json.loads(json.dumps(workload_stats(table)))  # what `workload stats --json` prints
    assert stats["requests"] == 3993
    assert stats["unlimited_cache_hit_fraction"] == pytest.approx(0.640, abs=0.005)
    assert stats["first_block_shared_fraction"] == pytest.approx(0.446, abs=0.005)
    rows = _rows(table)
    first = rows[0]
    assert first["arrival_s"] == 0.0 and first["prompt_tokens"] == 40160 and first["output_tokens"] == 6
    assert first["block_hashes"] == list(range(79)) and first["block_size"] == 512
    shape = {(r["kind"], r["step"], r["turn"], r["group_size"], r["sample_index"]) for r in rows}
    assert shape == {("rollout", 0, 0, 1, 0)}
    assert {r["domain"] for r in rows} == {"synthetic"} and {r["paradigm"] for r in rows} == {"reward_model"}
    assert all(r["max_tokens"] == r["output_tokens"] and r["finish_reason"] == "stop" for r in rows)
    arrivals = [r["arrival_s"] for r in rows]
    assert arrivals == sorted(arrivals) and arrivals[-1] == pytest.approx(1022.025)


def test_search_r1_groups_and_chains() -> None:
    _need(*SEARCH_R1)
    result = import_polytrace_multiturn(SEARCH_R1)
    table = _valid(result, "search_r1")
    rows = _rows(table)
    assert result.skipped == []
    sessions: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        sessions[r["session_id"]].append(r)
    groups: dict[str, set[str]] = defaultdict(set)
    for sid, turns in sessions.items():
        groups[turns[0]["group_id"]].add(sid)
    assert len(sessions) == 3 * 2048 and len(groups) == 3 * 256
    assert {len(s) for s in groups.values()} == {8}
    assert {r["step"] for r in rows} == {0, 1, 2}
    assert {(r["domain"], r["paradigm"], r["kind"]) for r in rows} == {("agentic", "search_tool", "rollout")}
    assert all(r["arrival_s"] is None for r in rows)

    # Line 1 of step 0 is (step 0, group 0, sample 0): two turns, one search in between.
    t0, t1 = sessions["search_r1:s0:g0:n0"]
    assert (t0["prompt_tokens"], t0["output_tokens"], t0["finish_reason"]) == (317, 40, "tool_call")
    assert (t0["tool"], t0["tool_tokens"]) == ("search", 1401 - 317 - 40)
    assert t0["tool_latency_s"] == pytest.approx(0.07405877113342285)
    assert (t1["prompt_tokens"], t1["finish_reason"], t1["tool"]) == (1401, "stop", None)

    bs = rows[0]["block_size"]
    for sid, turns in sessions.items():
        assert [t["turn"] for t in turns] == list(range(len(turns)))
        for prev, nxt in zip(turns, turns[1:]):
            # Each turn's chain extends the previous turn's full blocks, and the context adds up.
            full = prev["prompt_tokens"] // bs
            assert nxt["block_hashes"][:full] == prev["block_hashes"][:full], sid
            if prev["prompt_tokens"] % bs:  # the partial block grew full: a different prefix
                assert nxt["block_hashes"][full] != prev["block_hashes"][full], sid
            assert nxt["prompt_tokens"] == prev["prompt_tokens"] + prev["output_tokens"] + prev["tool_tokens"], sid
            assert prev["finish_reason"] == "tool_call" and prev["tool"] is not None
        assert turns[-1]["tool"] is None and turns[-1]["finish_reason"] in {"stop", "length"}
    for members in groups.values():
        # Siblings share the prompt's blocks and nothing after it.
        firsts = [sessions[s][0] for s in members]
        assert len({tuple(t["block_hashes"]) for t in firsts}) == 1
        assert {t["group_size"] for t in firsts} == {8}
        assert sorted(t["sample_index"] for t in firsts) == list(range(8))
        seconds = [sessions[s][1]["block_hashes"] for s in members if len(sessions[s]) > 1]
        assert len({h[-1] for h in seconds}) == len(seconds)
    # Tail-truncated completions (prompt[k+1] < prompt[k] + completion[k]) are repaired, never silently.
    assert 40 <= sum("output cut" in reason for _, _, reason in result.repaired) <= 80


def test_dapo_groups() -> None:
    _need(*DAPO)
    result = import_polytrace_lengths(DAPO)
    table = _valid(result, "dapo")
    rows = _rows(table)
    assert len(rows) == 6 * 96 * 8
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r["group_id"]].append(r)
    assert len(groups) == 6 * 96
    for members in groups.values():
        assert [m["sample_index"] for m in members] == list(range(8))
        assert {m["group_size"] for m in members} == {8}
        assert len({m["session_id"] for m in members}) == 8
        assert len({tuple(m["block_hashes"]) for m in members}) == 1  # one shared prompt
        assert len({m["prompt_id"] for m in members}) == 1
        assert all(len(m["block_hashes"]) == math.ceil(m["prompt_tokens"] / 16) for m in members)
    assert {(r["domain"], r["paradigm"], r["max_tokens"]) for r in rows} == {("math", "math_verifier", 20480)}
    assert {r["step"] for r in rows} == set(range(6))
    first = groups["dapo_math/packed_lengths_step_0:1"]
    assert [m["output_tokens"] for m in first] == [450, 453, 396, 274, 26, 393, 1842, 681]
    assert {m["prompt_tokens"] for m in first} == {112}
    # Prompts do not recur by line across steps, so prompt ids are per step.
    assert len({r["prompt_id"] for r in rows}) == 6 * 96


def test_deepcoder_groups_and_cap() -> None:
    _need(*DEEPCODER)
    result = import_polytrace_lengths(DEEPCODER)
    rows = _rows(_valid(result, "deepcoder"))
    assert len(rows) == 5 * 16 * 8
    assert {(r["domain"], r["paradigm"], r["max_tokens"]) for r in rows} == {("code", "unit_test_sandbox", 16000)}
    capped = [r for r in rows if r["output_tokens"] == 16000]
    assert capped and all(r["finish_reason"] == "length" for r in capped)
    assert all(r["finish_reason"] == "stop" for r in rows if r["output_tokens"] < 16000)
    assert len({r["group_id"] for r in rows}) == 80


# ---------------------------------------------------------------- synthetic files: rules and bad lines


def _moon(ts: float = 0, n_in: int = 1000, n_out: int = 5, ids: list[int] | None = None) -> dict[str, Any]:
    ids = [0, 1] if ids is None else ids
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def _traj(step: int = 0, group: int = 0, sample: int = 0, **over: Any) -> dict[str, Any]:
    """A valid two-turn Search-R1 line: 40 prompt + 10 output + 30 tool tokens -> 80-token second prompt."""
    line = {
        "step": step,
        "prompt_group_id": group,
        "sample_id": sample,
        "turns": [
            {"turn": 0, "prompt_tokens": 40, "completion_tokens": 10, "max_new_tokens": 100,
             "finish_reason": "tool_calls"},
            {"turn": 1, "prompt_tokens": 80, "completion_tokens": 7, "max_new_tokens": 100, "finish_reason": "stop"},
        ],
        "tool_calls": [
            {"turn": 0, "tool_name": "search", "latency_s": 0.5, "response_token_len": 20, "append_len": 27}
        ],
        "finish_reason": "stop",
    }
    line.update(over)
    return line


def test_mooncake_hash_count_rule(tmp_path: Path) -> None:
    lines = [_moon(0, 1000, 5, [0, 1]), _moon(1500, 1024, 3, [0, 1]), _moon(500, 1100, 2, [0, 1])]
    ok = _write(tmp_path / "conv_trace.jsonl", lines)
    result = import_mooncake(ok)
    rows = _rows(_valid(result, "t"))
    # Sorted by arrival; floor-counted ids get a fresh tail block that nobody shares.
    assert [r["arrival_s"] for r in rows] == [0.0, 0.5, 1.5]
    assert rows[0]["block_hashes"] == [0, 1] and rows[2]["block_hashes"] == [0, 1]
    tail = rows[1]["block_hashes"]
    assert tail[:2] == [0, 1] and len(tail) == 3 and tail[2] < 0
    assert {r["domain"] for r in rows} == {"conv"}
    bad = _write(tmp_path / "bad.jsonl", [_moon(), _moon(ids=[0, 1, 2, 3])])
    with pytest.raises(DataValidationError) as err:
        import_mooncake(bad)
    assert (err.value.file, err.value.line, err.value.column) == (str(bad), 2, "hash_ids")
    assert "ceil(1000/512) = 2" in str(err.value)


def test_mooncake_files_do_not_share_ids(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.jsonl", [_moon(0, 1000, 5, [0, 1])])
    b = _write(tmp_path / "b.jsonl", [_moon(0, 1000, 5, [0, 1])])
    rows = _rows(import_mooncake([a, b]).table)
    assert rows[0]["block_hashes"] != rows[1]["block_hashes"]
    assert len({r["request_id"] for r in rows}) == 2


@pytest.mark.parametrize(
    ("line", "column"),
    [
        ('{"timestamp": 0, "input_length": 10,', "<line>"),
        ('[1, 2]', "<line>"),
        (_moon() | {"input_length": None}, "input_length"),
        ({k: v for k, v in _moon().items() if k != "output_length"}, "output_length"),
        (_moon(n_out=-3), "output_length"),
        (_moon(n_in="1000"), "input_length"),
        (_moon(n_in=1000.5), "input_length"),
        (_moon(ts=-1), "timestamp"),
        (_moon(ids=[0, "x"]), "hash_ids[1]"),
        (_moon() | {"hash_ids": 7}, "hash_ids"),
    ],
    ids=["bad-json", "not-object", "null", "missing-key", "negative", "string", "float", "negative-time", "bad-id",
         "ids-not-list"],
)
def test_mooncake_bad_line(tmp_path: Path, line: Any, column: str) -> None:
    path = _write(tmp_path / "trace.jsonl", [_moon(), _moon(1), line, _moon(2)])
    with pytest.raises(DataValidationError) as err:
        import_mooncake(path)
    assert err.value.file == str(path) and err.value.line == 3 and err.value.column == column
    assert "trace.jsonl" in str(err.value) and "line 3" in str(err.value)


def _turn_swap(line: dict[str, Any]) -> dict[str, Any]:
    line["turns"] = line["turns"][::-1]
    return line


@pytest.mark.parametrize(
    ("line", "column"),
    [
        ("not json at all", "<line>"),
        ({k: v for k, v in _traj().items() if k != "turns"}, "turns"),
        (_traj(sample=-1), "sample_id"),
        (_traj(step="0"), "step"),
        (_turn_swap(_traj()), "turns[0].turn"),
        (_traj(turns=[_traj()["turns"][0] | {"completion_tokens": -5}]), "turns[0].completion_tokens"),
        (_traj(turns=[_traj()["turns"][0] | {"prompt_tokens": 40.0}]), "turns[0].prompt_tokens"),
        (_traj(turns=[_traj()["turns"][0], _traj()["turns"][1] | {"prompt_tokens": 30}]), "turns[1].prompt_tokens"),
        (_traj(turns=[_traj()["turns"][0] | {"finish_reason": "stop"}, _traj()["turns"][1]]), "turns[0].finish_reason"),
        (_traj(turns=[_traj()["turns"][0] | {"finish_reason": "weird"}]), "turns[0].finish_reason"),
        (_traj(tool_calls=[]), "tool_calls"),
        (_traj(tool_calls=[_traj()["tool_calls"][0] | {"turn": 5}]), "tool_calls[0].turn"),
        (_traj(tool_calls=[_traj()["tool_calls"][0] | {"latency_s": "slow"}]), "tool_calls[0].latency_s"),
        (_traj(sample=0), "sample_id"),  # duplicate of line 1
    ],
    ids=["bad-json", "missing-turns", "negative-id", "string-step", "turns-out-of-order", "negative-completion",
         "float-tokens", "prompt-shrinks", "stop-then-turn", "unknown-finish", "no-tool-between-turns",
         "tool-after-last-turn", "bad-latency", "duplicate-sample"],
)
def test_search_r1_bad_line(tmp_path: Path, line: Any, column: str) -> None:
    path = _write(tmp_path / "multiturn_workload_step_0.jsonl", [_traj(sample=0), _traj(sample=1), line])
    with pytest.raises(DataValidationError) as err:
        import_polytrace_multiturn([path])
    assert err.value.file == str(path) and err.value.line == 3 and err.value.column == column
    assert "multiturn_workload_step_0.jsonl" in str(err.value) and "line 3" in str(err.value)


def test_search_r1_accounting_rules(tmp_path: Path) -> None:
    truncated = _traj(sample=1)
    truncated["turns"][0]["completion_tokens"] = 60  # 40 + 60 > 80: the tail was dropped from the context
    last_tool = _traj(sample=2)
    last_tool["turns"][1]["finish_reason"] = "tool_calls"
    last_tool["tool_calls"].append({"turn": 1, "tool_name": "search", "latency_s": 0.1, "append_len": 5})
    multi = _traj(sample=3)
    multi["tool_calls"].append({"turn": 0, "tool_name": "fetch", "latency_s": 2.0, "append_len": 3})
    path = _write(tmp_path / "multiturn_workload_step_0.jsonl", [_traj(sample=0), truncated, last_tool, multi])
    result = import_polytrace_multiturn([path])
    rows = _rows(_valid(result, "t"))
    by = {(r["sample_index"], r["turn"]): r for r in rows}
    assert (by[0, 0]["output_tokens"], by[0, 0]["tool_tokens"]) == (10, 30)  # derived: 80 - 40 - 10
    assert (by[1, 0]["output_tokens"], by[1, 0]["tool_tokens"]) == (13, 27)  # cut to what turn 1 holds
    assert (by[2, 1]["finish_reason"], by[2, 1]["tool"]) == ("stop", None)
    assert (by[3, 0]["tool"], by[3, 0]["tool_latency_s"]) == ("fetch+search", 2.0)
    assert {r["group_size"] for r in rows} == {4}
    assert [(line, why.split(" ")[0]) for _, line, why in result.repaired] == [(2, "turn"), (3, "dropped")]
    assert "output cut from 60 to 13" in result.repaired[0][2]


def test_skip_bad_records_every_skip(tmp_path: Path) -> None:
    moon = _write(tmp_path / "m.jsonl", [_moon(), "{oops", _moon(n_out=-1), "", _moon(1)])
    result = import_mooncake(moon, skip_bad=True)
    assert result.table.num_rows == 2
    assert [(f, line) for f, line, _ in result.skipped] == [(str(moon), 2), (str(moon), 3)]
    assert "output_length" in result.skipped[1][2]

    sr1 = _write(tmp_path / "s.jsonl", [_traj(sample=0), _turn_swap(_traj(sample=1)), _traj(sample=2)])
    result = import_polytrace_multiturn([sr1], skip_bad=True)
    rows = _rows(_valid(result, "s"))
    assert [(f, line) for f, line, _ in result.skipped] == [(str(sr1), 2)]
    assert {r["group_size"] for r in rows} == {2}  # the group is what was imported
    assert sorted({r["sample_index"] for r in rows}) == [0, 1]

    (tmp_path / "dapo").mkdir()
    lengths = _write(
        tmp_path / "dapo" / "packed_lengths_step_0.jsonl",
        [{"step": 0, "input": 20, "output": [5, 6], "n_sampling": 2},
         {"step": 0, "input": 20, "output": [5], "n_sampling": 2}],
    )
    result = import_polytrace_lengths([lengths], skip_bad=True)
    assert result.table.num_rows == 2
    assert [(line, why.split(":")[0]) for _, line, why in result.skipped] == [(2, "n_sampling")]


def test_lengths_bad_lines_and_domain(tmp_path: Path) -> None:
    (tmp_path / "deepcoder").mkdir()
    path = _write(tmp_path / "deepcoder" / "packed_lengths_step_3.jsonl",
                  [{"step": 3, "input": 30, "output": [16000, 7]}, {"step": 3, "input": 30, "output": [16001, 7]}])
    with pytest.raises(DataValidationError) as err:
        import_polytrace_lengths([path])
    assert (err.value.file, err.value.line, err.value.column) == (str(path), 2, "output[0]")
    rows = _rows(import_polytrace_lengths([path], domain="math", skip_bad=True).table)
    assert {(r["domain"], r["paradigm"], r["max_tokens"]) for r in rows} == {("math", "math_verifier", 20480)}
    with pytest.raises(ValueError, match="domain"):
        import_polytrace_lengths([_write(tmp_path / "x.jsonl", [])])
