"""The eviction lever changes which cached prefix vLLM's real block pool evicts.

* LRU (stock vLLM) evicts the older prefix A first; a policy that names the
  newer B makes B's blocks go while A survives;
* the policy is asked once per step, only when an allocation evicts, with the
  freed prefixes still cached in LRU order (capped when asked to), and the
  order holds for every allocation of that step;
* an exception in ``evict()`` falls back to LRU and is counted;
* the decision is logged as a ``retain`` row with action ``evict``.
"""

from __future__ import annotations

import pytest

from policy.interface import EvictionDecision, Policy
from serving_hook import block_pool, eviction
from simulator import fake_runner
from tests.hooks import hook_scheduler as _hook
from tests.hooks import stock_scheduler as _stock

pytestmark = pytest.mark.vllm


class EvictPolicy(Policy):
    """Evict the named prefixes first (by request id); record what it was offered."""

    name = "test-evict"
    uses_eviction = True

    def __init__(self, order=(), raise_exc=False, cap=None):
        self.order = list(order)
        self.raise_exc = raise_exc
        self.max_eviction_candidates = cap
        self.calls = []

    def evict(self, prefixes, num_blocks_needed, state):
        self.calls.append(([(p.prefix_id, p.num_blocks, p.owner_state.value) for p in prefixes], num_blocks_needed))
        if self.raise_exc:
            raise RuntimeError("boom")
        return EvictionDecision(order=self.order)


def _run_until_done(s, runner, limit=200):
    for _ in range(limit):
        runner.step(s)
        if not s.has_requests():
            return
    raise AssertionError("requests did not finish")


def _cached(engine, s, prompt):
    probe = engine.make_request("probe", prompt, 1)
    return s.kv_cache_manager.get_computed_blocks(probe)[1]


def _prefixes(engine, s, runner, names):
    """Run one 48-token request per name, one after the other (3 cached blocks each)."""
    prompts = {}
    for n in names:
        prompts[n] = fake_runner.prompt_tokens(f"ev-{n}", 48)
        s.add_request(engine.make_request(n, prompts[n], 2))
        _run_until_done(s, runner)
    for n in names:
        assert _cached(engine, s, prompts[n] + [1]) == 48
    return prompts


def _two_prefix_scenario(engine, cls):
    """A then B are cached (12 usable blocks: 6 cached, 6 empty); a 144-token filler
    needs the 6 empty blocks and 3 cached ones."""
    s = engine.make_scheduler(cls, num_blocks=13, max_num_seqs=4)
    runner = fake_runner.FakeRunner()
    prompts = _prefixes(engine, s, runner, ["A", "B"])
    s.add_request(engine.make_request("F", fake_runner.prompt_tokens("ev-filler", 144), 1))
    _run_until_done(s, runner)
    return s, prompts


def test_lru_evicts_older_prefix(vllm_engine):
    s, p = _two_prefix_scenario(vllm_engine, _stock())
    assert _cached(vllm_engine, s, p["A"] + [1]) == 0
    assert _cached(vllm_engine, s, p["B"] + [1]) == 48


def test_named_prefix_is_evicted_first(vllm_engine):
    policy = EvictPolicy(order=["B"])
    s, p = _two_prefix_scenario(vllm_engine, _hook(policy))
    assert _cached(vllm_engine, s, p["B"] + [1]) == 0
    assert _cached(vllm_engine, s, p["A"] + [1]) == 48
    # asked once, by the filler's allocation of 9 blocks, with A and B in LRU order
    assert policy.calls == [([("A", 3, "finished"), ("B", 3, "finished")], 9)]
    st = s.kvpilot_stats
    assert st.eviction_calls == 1 and st.eviction_orders == 1 and st.evict_first_blocks == 3
    assert not st.fallbacks


def test_a_listed_prefix_loses_only_its_own_tail(vllm_engine):
    """A = S+a and B = S+b share S (2 blocks), C apart; a 112-token filler needs 2 cached blocks.

    Listing B first moves only b (S is shared with A): the second evicted block
    is LRU's oldest, a. Moving all of B's blocks would have evicted b and S's
    second block, cutting A to 16 tokens.
    """
    engine = vllm_engine
    policy = EvictPolicy(order=["B"])
    s = engine.make_scheduler(_hook(policy), num_blocks=13, max_num_seqs=4)
    runner = fake_runner.FakeRunner()
    shared = fake_runner.prompt_tokens("ev-shared", 32)
    prompts = {n: shared + fake_runner.prompt_tokens(f"ev-tail-{n}", 16) for n in "AB"}
    prompts["C"] = fake_runner.prompt_tokens("ev-C", 48)
    for n, p in prompts.items():
        s.add_request(engine.make_request(n, p, 2))
        _run_until_done(s, runner)
    children = s.kv_cache_manager.block_pool.kvpilot_children
    assert sorted(len(kids) for kids in children.values()) == [1, 1, 1, 2]  # s0 -> s1 -> {a, b}; c0 -> c1 -> c2
    s.add_request(engine.make_request("F", fake_runner.prompt_tokens("ev-filler112", 112), 1))
    _run_until_done(s, runner)
    assert {n: _cached(engine, s, p + [1]) for n, p in prompts.items()} == {"A": 32, "B": 32, "C": 48}
    assert s.kvpilot_stats.evict_first_blocks == 1  # b only: s0 and s1 stay where LRU had them


def test_not_asked_without_eviction(vllm_engine):
    """Allocations served by empty blocks never reach the policy."""
    engine = vllm_engine
    policy = EvictPolicy(order=["A"])
    s = engine.make_scheduler(_hook(policy), num_blocks=13, max_num_seqs=4)
    runner = fake_runner.FakeRunner()
    p = _prefixes(engine, s, runner, ["A"])
    s.add_request(engine.make_request("F", fake_runner.prompt_tokens("ev-small", 64), 1))  # 4 of 8 empty blocks
    _run_until_done(s, runner)
    assert policy.calls == []
    assert _cached(engine, s, p["A"] + [1]) == 48


def _two_fillers_in_one_step(engine, policy, f2_name, f2_tokens):
    """A, B, C cached (9 blocks, 3 empty), then F1 (64 tokens) and F2 admitted in one step; prompts of A, B, C."""
    s = engine.make_scheduler(_hook(policy), num_blocks=13, max_num_seqs=4)
    runner = fake_runner.FakeRunner()
    p = _prefixes(engine, s, runner, ["A", "B", "C"])
    s.add_request(engine.make_request("F1", fake_runner.prompt_tokens("ev-f1", 64), 1))
    s.add_request(engine.make_request("F2", fake_runner.prompt_tokens(f2_name, f2_tokens), 1))
    out = runner.step(s)
    assert sorted(d.req_id for d in out.scheduled_new_reqs) == ["F1", "F2"]
    _run_until_done(s, runner)
    return s, p


def test_one_ask_per_step_and_order_holds_for_the_step(vllm_engine):
    """A, B, C cached (9 blocks, 3 empty). Two fillers admitted in one step both
    evict: F1 takes the 3 empty blocks + 1 cached, F2 2 cached. One ask; C goes."""
    engine = vllm_engine
    policy = EvictPolicy(order=["C", "B"])
    s, p = _two_fillers_in_one_step(engine, policy, "ev-f2", 32)
    assert len(policy.calls) == 1
    assert [c[0] for c in policy.calls[0][0]] == ["A", "B", "C"]
    assert policy.calls[0][1] == 4
    assert _cached(engine, s, p["C"] + [1]) == 0
    assert _cached(engine, s, p["A"] + [1]) == 48
    assert _cached(engine, s, p["B"] + [1]) == 48


def test_candidate_cap_takes_lru_order(vllm_engine):
    policy = EvictPolicy(order=["A"], cap=1)
    s, p = _two_prefix_scenario(vllm_engine, _hook(policy))
    assert [c[0] for c in policy.calls[0][0]] == ["A"]


def test_exception_falls_back_to_lru_and_is_counted(vllm_engine):
    policy = EvictPolicy(order=["B"], raise_exc=True)
    s, p = _two_prefix_scenario(vllm_engine, _hook(policy))
    # LRU: A goes, B survives, exactly as stock vLLM
    assert _cached(vllm_engine, s, p["A"] + [1]) == 0
    assert _cached(vllm_engine, s, p["B"] + [1]) == 48
    st = s.kvpilot_stats
    assert st.fallbacks == {"evict:exception": 1}
    assert st.fallback_steps == 1
    assert st.eviction_calls == 1 and st.eviction_orders == 0


def test_unknown_ids_and_none_keep_lru(vllm_engine):
    policy = EvictPolicy(order=["nope"])
    s, p = _two_prefix_scenario(vllm_engine, _hook(policy))
    assert _cached(vllm_engine, s, p["A"] + [1]) == 0
    assert _cached(vllm_engine, s, p["B"] + [1]) == 48
    assert s.kvpilot_stats.eviction_orders == 0


class _Writer:
    dropped = 0
    tables = frozenset({"decisions"})

    def __init__(self):
        self.rows = []

    def put(self, table, row):
        self.rows.append((table, row))

    def flush(self):
        pass

    def close(self):
        pass


def test_decision_is_logged_as_retain_evict(vllm_engine):
    engine = vllm_engine
    policy = EvictPolicy(order=["B"])
    s = engine.make_scheduler(_hook(policy), num_blocks=13, max_num_seqs=4)
    w = s.kvpilot_telemetry = _Writer()
    runner = fake_runner.FakeRunner()
    _prefixes(engine, s, runner, ["A", "B"])
    s.add_request(engine.make_request("F", fake_runner.prompt_tokens("ev-filler", 144), 1))
    _run_until_done(s, runner)
    s.kvpilot_telemetry = None
    rows = [r for t, r in w.rows if t == "decisions"]
    assert len(rows) == 1
    r = rows[0]
    assert (r["kind"], r["action"], r["candidate_ids"], r["chosen"]) == ("retain", "evict", ["A", "B"], 1)
    assert len(r["features"]) == 2 and r["features"][0][0] == 3.0  # num_blocks


@pytest.mark.parametrize("first_blocks", [1, 256])
def test_order_placed_lazily_evicts_as_if_placed_at_once(vllm_engine, monkeypatch, first_blocks):
    """A, B, C cached (9 blocks, 3 empty); F1 takes the 3 empty blocks and 1 cached, F2 4 cached, in one step.

    Order C, B: C goes, then B's two deepest blocks; A survives. With a first
    placement of 1 block only C's tail is placed for F1, and F2's allocation
    places B's tail behind what is left of C's: the same evictions as placing
    both tails at once.
    """
    monkeypatch.setattr(eviction, "PLAN_FIRST_BLOCKS", first_blocks)
    engine = vllm_engine
    policy = EvictPolicy(order=["C", "B"])
    s, p = _two_fillers_in_one_step(engine, policy, "ev-f2b", 64)
    assert len(policy.calls) == 1
    assert {n: _cached(engine, s, p[n] + [1]) for n in "ABC"} == {"A": 48, "B": 16, "C": 0}
    assert s.kvpilot_stats.evict_first_blocks == 6


def test_index_tracks_cached_lengths_without_walking(vllm_engine, monkeypatch):
    """Under churn (siblings sharing a prompt, evictions every step, a cache hit on a cut prefix), every
    candidate's cached length equals a walk of its blocks, and every left-out prefix is dead or has its
    deepest cached block in use."""
    checked = []
    original = eviction.CachedPrefixIndex.candidates

    def checking(index, limit=None):
        found = original(index, limit)
        offered = {pid for pid, _, _ in found}
        for pid, e, n in found:
            assert n == block_pool.cached_length(e.blocks, e.hashes), pid
        for pid, e in index.entries.items():
            if pid not in offered:
                n = block_pool.cached_length(e.blocks, e.hashes)
                assert n > 0 and e.blocks[n - 1].ref_cnt > 0, pid
        checked.append(len(found))
        return found

    monkeypatch.setattr(eviction.CachedPrefixIndex, "candidates", checking)
    engine = vllm_engine
    policy = EvictPolicy(order=[f"r{i}" for i in range(40)][::-1])  # newest first: not LRU
    s = engine.make_scheduler(_hook(policy), num_blocks=24, max_num_seqs=4)
    runner = fake_runner.FakeRunner()
    shared = fake_runner.prompt_tokens("ix-shared", 48)
    for i in range(40):
        prompt = shared + fake_runner.prompt_tokens(f"ix-{i % 7}", 16 + 16 * (i % 3))  # repeats: hits on cut chains
        s.add_request(engine.make_request(f"r{i}", prompt, 20))
        if i % 3 == 2:
            _run_until_done(s, runner)
    _run_until_done(s, runner)
    assert len(checked) >= 5 and max(checked) >= 3
    assert s.kvpilot_stats.evict_first_blocks > 0 and not s.kvpilot_stats.fallbacks


def test_a_failed_later_placement_falls_back_to_lru_for_the_step(vllm_engine, monkeypatch):
    """The same step as above, with the second placement (B's tail, for F2) raising: the engine goes on, F2
    evicts in LRU order (what is left of C, then A's deepest blocks), and the failure is counted once."""
    monkeypatch.setattr(eviction, "PLAN_FIRST_BLOCKS", 1)
    calls = []
    real = eviction.exclusive_tail

    def flaky(pool, blocks, n):
        calls.append(n)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(pool, blocks, n)

    monkeypatch.setattr(eviction, "exclusive_tail", flaky)
    engine = vllm_engine
    policy = EvictPolicy(order=["C", "B"])
    s, p = _two_fillers_in_one_step(engine, policy, "ev-f2b", 64)
    assert len(calls) == 2
    assert {n: _cached(engine, s, p[n] + [1]) for n in "ABC"} == {"A": 16, "B": 48, "C": 0}
    assert s.kvpilot_stats.fallbacks == {"hook:evict": 1}
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 12  # every block back in the free list
