"""Token expansion of workloads: siblings, turns, scoring, exact prefix sharing, and the counting convention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from data.importers import import_mooncake, import_polytrace_multiturn
from data.schemas import WORKLOAD
from data.stats import _replay_order, workload_stats
from data.synth import SynthConfig, generate
from simulator import fake_runner
from simulator.tokens import (
    FIRST_ID,
    VOCAB_SIZE,
    WorkloadTokens,
    block_keys,
    prompt_token_ids,
    unlimited_cached_tokens,
)

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
SEARCH_R1 = [TRACES / "polytrace" / "search_r1" / f"multiturn_workload_step_{s}.jsonl" for s in range(3)]
V = 16  # vLLM block size


def _need(*paths: Path) -> None:
    """Skip unless the shared trace files exist."""
    missing = [p for p in paths if not p.exists()]
    if missing:
        pytest.skip(f"real traces not found at {TRACES} (expected ../shared/traces next to the repo): {missing}")


@pytest.fixture(scope="module", params=["synth", "search_r1", "mooncake"])
def source(request: pytest.FixtureRequest) -> tuple[str, pa.Table, WorkloadTokens]:
    """(name, workload table, its tokens) for the default synthetic workload and the real traces."""
    if request.param == "synth":
        table = generate(SynthConfig())
    elif request.param == "search_r1":
        _need(*SEARCH_R1)
        table = import_polytrace_multiturn(SEARCH_R1).table
    else:
        _need(MOONCAKE)
        table = import_mooncake(MOONCAKE).table
    return request.param, table, WorkloadTokens(table)


def _col(table: pa.Table, name: str) -> list[Any]:
    return table.column(name).to_pylist()


def _sample(n: int, k: int = 400) -> range:
    """Rows to check one by one: all of a small table, an even spread of a large one."""
    return range(0, n, max(1, n // k))


# ---------------------------------------------------------------- properties (a)-(e)


def test_siblings_share_prompt_tokens(source: tuple[str, pa.Table, WorkloadTokens]) -> None:
    """(a) Turn-0 rollouts of a group have identical prompt ids, partial last block included."""
    _, table, wt = source
    groups: dict[str, list[int]] = {}
    for r, (g, kind, turn) in enumerate(zip(_col(table, "group_id"), _col(table, "kind"), _col(table, "turn"))):
        if kind == "rollout" and turn == 0:
            groups.setdefault(g, []).append(r)
    shared = [rows for rows in groups.values() if len(rows) > 1]
    if not shared:
        pytest.skip("no GRPO groups in this source")
    for rows in shared[:: max(1, len(shared) // 200)]:
        first = wt.prompt_ids(rows[0])
        for r in rows[1:]:
            np.testing.assert_array_equal(wt.prompt_ids(r), first)


def test_turns_extend_previous_context(source: tuple[str, pa.Table, WorkloadTokens]) -> None:
    """(b) Turn k+1's prompt is turn k's prompt + turn k's output ids + tool tokens."""
    _, table, wt = source
    row_of = {(s, t): r for r, (s, t) in enumerate(zip(_col(table, "session_id"), _col(table, "turn")))}
    pairs = [(r, row_of[(s, t + 1)]) for (s, t), r in row_of.items() if (s, t + 1) in row_of]
    if not pairs:
        pytest.skip("no multi-turn sessions in this source")
    for r, nxt in pairs[:: max(1, len(pairs) // 500)]:
        prompt, output, following = wt.prompt_ids(r), wt.output_ids(r), wt.prompt_ids(nxt)
        assert len(prompt) == wt.prompt[r] and len(output) == wt.output[r]
        np.testing.assert_array_equal(following[: len(prompt)], prompt)
        np.testing.assert_array_equal(following[len(prompt): len(prompt) + len(output)], output)


def test_equal_hashes_give_equal_tokens(source: tuple[str, pa.Table, WorkloadTokens]) -> None:
    """(c) Equal hash at block i means equal tokens of that block, partial blocks included."""
    _, table, wt = source
    bs = wt.block_size
    seen: dict[int, list[int]] = {}
    compared = mismatched = 0
    for r in _sample(table.num_rows, 1500):
        ids = wt.prompt_ids(r).tolist()
        for i, h in enumerate(table.column("block_hashes")[r].as_py()):
            block = seen.setdefault(h, ids[i * bs: (i + 1) * bs])
            compared += 1
            mismatched += block != ids[i * bs: (i + 1) * bs]
    assert compared > 0 and mismatched == 0


def test_scoring_prompt_extends_final_context(source: tuple[str, pa.Table, WorkloadTokens]) -> None:
    """(d) A scoring prompt is the scored trajectory's last prompt + last output + template tokens."""
    _, table, wt = source
    last: dict[str, tuple[int, int]] = {}  # session -> (turn, row) of its last turn
    for r, (s, t) in enumerate(zip(_col(table, "session_id"), _col(table, "turn"))):
        last[s] = max(last.get(s, (t, r)), (t, r))
    scored = [(r, s) for r, s in enumerate(_col(table, "scores_session_id")) if s is not None]
    if not scored:
        pytest.skip("no scoring requests in this source")
    for r, s in scored[:: max(1, len(scored) // 200)]:
        final = np.concatenate([wt.prompt_ids(last[s][1]), wt.output_ids(last[s][1])])
        ids = wt.prompt_ids(r)
        assert len(ids) > len(final)
        np.testing.assert_array_equal(ids[: len(final)], final)


def test_ids_are_deterministic_and_valid(source: tuple[str, pa.Table, WorkloadTokens]) -> None:
    """(e) Same ids from a fresh expansion, last outputs included; never pad, bos or eos."""
    _, table, wt = source
    again = WorkloadTokens(table)
    for r in _sample(table.num_rows):
        for a, b in ((wt.prompt_ids(r), again.prompt_ids(r)), (wt.output_ids(r), again.output_ids(r))):
            np.testing.assert_array_equal(a, b)
            assert a.size == 0 or (a.min() >= FIRST_ID and a.max() < VOCAB_SIZE)


# ---------------------------------------------------------------- the counting convention


def _stats_leading(table: pa.Table, order: np.ndarray) -> np.ndarray:
    """Per row, leading workload blocks data.stats' unlimited cache hits (blocks registered by earlier requests)."""
    chains = table.column("block_hashes").to_pylist()
    seen: set[int] = set()
    out = np.zeros(table.num_rows, np.int64)
    for r in order.tolist():
        chain = chains[r]
        n = 0
        while n < len(chain) and chain[n] in seen:
            n += 1
        out[r] = n
        seen.update(chain)
    return out


def _token_leading(wt: WorkloadTokens, order: np.ndarray, include_outputs: bool) -> np.ndarray:
    """Per row, leading 16-token blocks of the prompt already registered, by vLLM-like chained (parent, tokens) keys."""
    ids_of: dict[tuple[int, tuple[int, ...]], int] = {}
    out = np.zeros(len(order), np.int64)
    for r in order.tolist():
        prompt = wt.prompt_ids(r)
        ids = np.concatenate([prompt, wt.output_ids(r)[:-1]]) if include_outputs else prompt
        parent, hits = -1, 0
        for b in range(len(ids) // V):
            key = (parent, tuple(ids[b * V: (b + 1) * V].tolist()))
            if b == hits and b < len(prompt) // V and key in ids_of:
                hits += 1
            parent = ids_of.setdefault(key, len(ids_of))
        out[r] = hits
    return out


def _reference_subset(name: str, table: pa.Table, wt: WorkloadTokens) -> tuple[pa.Table, WorkloadTokens]:
    """What the slow Python reference can check quickly: real traces cut to whole groups (Mooncake: first 400)."""
    if name == "synth":
        return table, wt
    keep = sorted(set(_col(table, "group_id")), key=_col(table, "group_id").index)[: 400 if name == "mooncake" else 120]
    rows = np.flatnonzero(np.isin(np.array(_col(table, "group_id")), keep))
    subset = table.take(pa.array(rows))
    return subset, WorkloadTokens(subset)


def test_prompt_block_hits_equal_stats(source: tuple[str, pa.Table, WorkloadTokens]) -> None:
    """Leading 16-token blocks seen in earlier prompts == data.stats' count converted to 16-token blocks."""
    table, wt = _reference_subset(*source)
    order = _replay_order(table)
    leading = _stats_leading(table, order)
    stats = workload_stats(table)
    assert leading.sum() == round(stats["unlimited_cache_hit_fraction"] * stats["block_references"])
    expected = np.minimum(leading * wt.block_size, wt.prompt) // V
    np.testing.assert_array_equal(_token_leading(wt, order, include_outputs=False), expected)
    capped = np.minimum(expected, np.maximum(wt.prompt - 1, 0) // V) * V  # vLLM computes the last prompt token
    np.testing.assert_array_equal(unlimited_cached_tokens(wt, include_outputs=False, order=order), capped)


def test_unlimited_cached_tokens_whole_mooncake_trace() -> None:
    """On the whole Mooncake trace, the vectorised count equals data.stats' converted count."""
    _need(MOONCAKE)
    table = import_mooncake(MOONCAKE).table
    wt = WorkloadTokens(table)
    order = _replay_order(table)
    expected = np.minimum(_stats_leading(table, order) * wt.block_size, wt.prompt) // V
    capped = np.minimum(expected, np.maximum(wt.prompt - 1, 0) // V) * V
    np.testing.assert_array_equal(unlimited_cached_tokens(wt, include_outputs=False, order=order), capped)


def test_output_blocks_add_hits_only_after_a_turn(source: tuple[str, pa.Table, WorkloadTokens]) -> None:
    """vLLM-style counting (output blocks cached too) matches the Python reference and exceeds prompt-chain
    counting only for requests that follow an earlier request of their stream (later turns, scoring)."""
    if source[0] == "mooncake":
        pytest.skip("single-request streams: nothing to add")
    _, wt = _reference_subset(*source)
    order = wt.causal_order()
    with_out = unlimited_cached_tokens(wt, include_outputs=True)
    prompt_only = unlimited_cached_tokens(wt, include_outputs=False)
    capped = np.minimum(_token_leading(wt, order, include_outputs=True), np.maximum(wt.prompt - 1, 0) // V) * V
    np.testing.assert_array_equal(with_out, capped)
    assert (with_out >= prompt_only).all()
    assert (with_out[wt.rank == 0] == prompt_only[wt.rank == 0]).all()
    assert with_out.sum() > prompt_only.sum()


def test_block_keys_identify_prefixes() -> None:
    """Keys are equal exactly when the token prefixes through that block are equal."""
    a = np.arange(3, 3 + 48)
    b = a.copy()
    b[20] = 7  # differs in block 1
    keys = block_keys(np.concatenate([a, b, a[:40]]), np.array([48, 48, 40]))
    ka, kb, kc = keys[:3], keys[3:6], keys[6:]
    assert ka[0] == kb[0] and ka[1] != kb[1] and ka[2] != kb[2]
    np.testing.assert_array_equal(kc, ka[:2])
    assert len(set(ka.tolist())) == 3


# ---------------------------------------------------------------- hand-built workloads


def _table(rows: list[dict[str, Any]], block_size: int = 16) -> pa.Table:
    """A WORKLOAD table from partial rows, with defaults for what a test leaves out."""
    full = []
    for i, r in enumerate(rows):
        sid = r.get("session_id", f"s{i}")
        full.append({
            "request_id": f"r{i}", "kind": "rollout", "step": 0, "prompt_id": "p", "group_id": "g",
            "group_size": 1, "sample_index": 0, "session_id": sid, "turn": 0, "domain": "math",
            "paradigm": "math_verifier", "output_tokens": 1, "max_tokens": 100, "finish_reason": "stop",
            "block_size": block_size, **r,
        })
    return pa.Table.from_pylist(full, schema=WORKLOAD.schema)


def tiny() -> pa.Table:
    """Session s: turn 0 (40 prompt, 30 out, 10 tool) then turn 1 (80, 5); sibling t: one turn (40, 20)."""
    return _table([
        {"session_id": "s", "prompt_tokens": 40, "output_tokens": 30, "block_hashes": [1, 2, 3], "tool_tokens": 10},
        {"session_id": "t", "prompt_tokens": 40, "output_tokens": 20, "block_hashes": [1, 2, 3]},
        {"session_id": "s", "turn": 1, "prompt_tokens": 80, "output_tokens": 5, "block_hashes": [1, 2, 10, 11, 12]},
    ])


def test_hand_worked_unlimited_counts() -> None:
    # Causal order r0, r1, r2. Prompt-chain rule: r1 and r2 hit r0's 2 full prompt blocks (32 tokens).
    # With outputs, r0 registers (40+30-1)//16 = 4 blocks, so r2 hits 4 of its 5 (64 tokens); r1's third block
    # would mix its own output in, and its query stops at (40-1)//16 = 2 blocks anyway.
    wt = WorkloadTokens(tiny())
    np.testing.assert_array_equal(unlimited_cached_tokens(wt, include_outputs=False), [0, 32, 32])
    np.testing.assert_array_equal(unlimited_cached_tokens(wt, include_outputs=True), [0, 32, 64])
    # Separate caches (e.g. replicas): r1 alone on its cache hits nothing.
    np.testing.assert_array_equal(unlimited_cached_tokens(wt, partition=np.array([0, 1, 0])), [0, 0, 64])
    # Rows left out of the order are neither counted nor registered.
    np.testing.assert_array_equal(unlimited_cached_tokens(wt, order=np.array([1, 2])), [0, 0, 32])


def test_hand_worked_streams() -> None:
    wt = WorkloadTokens(tiny())
    s0, t0, s1 = (wt.prompt_ids(r) for r in range(3))
    np.testing.assert_array_equal(s0, t0)  # siblings: the partial block [32, 40) too
    np.testing.assert_array_equal(s1[:70], np.concatenate([s0, wt.output_ids(0)]))
    assert wt.output_ids(1)[0] != wt.output_ids(0)[0]  # siblings' outputs differ (this pair does)
    assert len(wt.output_ids(2)) == 5 and wt.stream_length.tolist() == [85, 60]
    np.testing.assert_array_equal(s0[:32], prompt_token_ids([1, 2, 3], 40, 16)[:32])


def test_inconsistent_stream_raises() -> None:
    rows = [
        {"session_id": "s", "prompt_tokens": 40, "block_hashes": [1, 2, 3]},
        {"session_id": "s", "turn": 1, "prompt_tokens": 80, "block_hashes": [1, 9, 10, 11, 12]},
    ]
    with pytest.raises(ValueError, match="r0.*block 1 differs"):
        WorkloadTokens(_table(rows))


def test_lone_request_ids() -> None:
    a = prompt_token_ids([5, 6, 7], 40, 16)
    b = prompt_token_ids([5, 6, 8], 33, 16)
    np.testing.assert_array_equal(a[:32], b[:32])
    assert a[32] != b[32] and a.dtype == np.int32 and a.min() >= FIRST_ID
    with pytest.raises(ValueError):
        prompt_token_ids([5, 6], 40, 16)


# ---------------------------------------------------------------- against vLLM's own prefix cache


@pytest.mark.vllm
def test_vllm_hits_what_unlimited_cached_tokens_predicts(vllm_engine: Any) -> None:
    """One request at a time in causal order, on a pool that never evicts: vLLM's prefix hits equal the
    vLLM-style count (output blocks included) for siblings, later turns and scoring requests alike."""
    table = generate(SynthConfig())
    groups = [g for d in ("math", "agentic") for g in
              sorted({g for g, dom in zip(_col(table, "group_id"), _col(table, "domain")) if dom == d})[:2]]
    table = table.filter(pa.array(np.isin(np.array(_col(table, "group_id")), groups)))
    assert {"math", "agentic", "reward"} <= set(_col(table, "domain"))
    wt = WorkloadTokens(table)
    scheduler = vllm_engine.make_scheduler(num_blocks=20000, max_num_batched_tokens=16384)
    runner = fake_runner.FakeRunner()
    measured = np.zeros(table.num_rows, np.int64)
    for r in wt.causal_order().tolist():
        rid, output = table.column("request_id")[r].as_py(), wt.output_ids(r).tolist()
        runner.scripted[rid] = output
        request = vllm_engine.make_request(rid, wt.prompt_ids(r).tolist(), max_tokens=len(output))
        scheduler.add_request(request)
        first = True
        while not request.is_finished():
            scheduled = runner.step(scheduler).num_scheduled_tokens
            if first and rid in scheduled:  # schedule() already advanced num_computed_tokens by this step's share
                measured[r], first = request.num_computed_tokens - scheduled[rid], False
        assert list(request.output_token_ids) == output
    expected = unlimited_cached_tokens(wt, include_outputs=True)
    np.testing.assert_array_equal(measured, expected)
    assert expected.sum() > unlimited_cached_tokens(wt, include_outputs=False).sum()
