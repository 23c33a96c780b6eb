"""Retention and eviction baselines: Continuum, KVFlow, Marconi, LRB and the hindsight oracle.

Unit tests score plain :class:`CachedPrefix` objects; the ``vllm``-marked tests
drive vLLM's real scheduler with the hook and assert which prefix survives:

* Continuum: a pin outlives a short tool call (the next turn hits it) and is
  released on return; after a long call its TTL ends and LRU evicts it;
* oracle (Belady): evicts the furthest next use (never, then the later sibling);
* KVFlow: evicts the furthest predicted next use (tool latencies);
* Marconi: keeps the long prefix over a short recent one when alpha weighs
  FLOPs per byte enough, and falls back to recency when it does not;
* LRB: evicts the furthest next use *within its seeded sample*.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from data.schemas import WORKLOAD
from policy.baselines.continuum import ToolPauseTTLPolicy
from policy.baselines.kvflow import NextUseEvictionPolicy
from policy.baselines.lrb import SampledNextUseEvictionPolicy
from policy.baselines.marconi import FlopsAwareEvictionPolicy
from policy.baselines.oracle import HindsightOraclePolicy
from policy.catalog import create_policy
from policy.interface import (
    CachedPrefix,
    CandidateRequest,
    EngineState,
    Event,
    EventKind,
    OwnerState,
    RequestMeta,
    RequestStatus,
    RetentionAction,
)
from policy.predictors import OracleReusePredictor, row_key
from policy.tool_latency import quantile
from simulator import fake_runner
from tests.hooks import hook_scheduler as _hook

INF = math.inf


# ------------------------------------------------------------------ helpers
def workload(rows):
    """A WORKLOAD table from partial rows (session_id, turn and lead required)."""
    cols = {f.name: [] for f in WORKLOAD.schema}
    for i, r in enumerate(rows):
        full = {
            "request_id": f"{r['session_id']}-{r.get('turn', 0)}",
            "kind": "rollout",
            "step": 0,
            "prompt_id": "p",
            "group_id": r.get("group_id", r["session_id"]),
            "group_size": 1,
            "sample_index": 0,
            "turn": 0,
            "domain": "agentic",
            "paradigm": "search_tool",
            "prompt_tokens": 48,
            "output_tokens": 2,
            "max_tokens": 2,
            "finish_reason": "stop",
            "block_size": 16,
            "block_hashes": [r.pop("lead", i), 7000 + i],
            "tool": None,
            "tool_latency_s": None,
            "tool_tokens": None,
            "verify_latency_s": None,
            "scores_session_id": None,
            "arrival_s": None,
        }
        full.update(r)
        if full["tool_latency_s"] is not None:
            full["finish_reason"] = "tool_call"
            full["tool"] = full["tool"] or "search"
        for k in cols:
            cols[k].append(full[k])
    return pa.table(cols, schema=WORKLOAD.schema)


def meta(session=None, turn=0, tool=None, group=None):
    return RequestMeta(session_id=session, turn=turn, tool=tool, group_id=group)


def prefix(pid, n_blocks=3, last_used=0.0, session=None, turn=0, tool=None, state=OwnerState.FINISHED, pinned=None):
    return CachedPrefix(
        prefix_id=pid,
        owner_request_id=pid,
        owner_state=state,
        meta=meta(session or pid, turn, tool),
        block_ids=tuple(range(n_blocks)),
        block_hashes=tuple(range(n_blocks)),
        last_used_s=last_used,
        protected_until_s=pinned,
    )


def engine_state(now=1000.0, waiting=0, usage=0.0, total=1000, block_size=16):
    return EngineState(
        time_s=now,
        engine_step=1,
        num_running=0,
        num_waiting=waiting,
        num_free_blocks=total,
        num_total_blocks=total,
        num_pinned_blocks=0,
        kv_usage=usage,
        block_size=block_size,
        max_num_running=256,
        max_num_batched_tokens=8192,
    )


def cand(rid, session=None, turn=0, arrival=0.0, out=0):
    return CandidateRequest(
        request_id=rid,
        meta=meta(session, turn),
        status=RequestStatus.WAITING,
        prompt_token_ids=(),
        num_prompt_tokens=10,
        num_cached_tokens=-1,
        num_computed_tokens=0,
        num_output_tokens=out,
        max_tokens=100,
        arrival_s=arrival,
        wait_s=0.0,
    )


def ev(kind, session, turn=0, t=1000.0, tool=None):
    return Event(kind=kind, time_s=t, request_id=f"{session}-{turn}", meta=meta(session, turn, tool))


class StubReuse:
    """A ReusePredictor from a fixed table (prefix id -> next use)."""

    def __init__(self, table):
        self.table = table
        self.asked = []

    def next_use_s(self, prefixes, now_s):
        self.asked.append([p.prefix_id for p in prefixes])
        return [self.table.get(p.prefix_id, INF) for p in prefixes]


# ================================================================ unit tests
def test_oracle_reuse_predictor_next_uses():
    wl = workload(
        [
            {"session_id": "a", "turn": 0, "lead": 1, "tool_latency_s": 2.5},
            {"session_id": "a", "turn": 1, "lead": 1, "tool_latency_s": 4.0},
            {"session_id": "a", "turn": 2, "lead": 1},
            {"session_id": "b", "turn": 0, "lead": 2},
            {"session_id": "c", "turn": 0, "lead": 3},
            {"session_id": "c2", "turn": 0, "lead": 3, "arrival_s": 1030.0},
            {"session_id": "d", "turn": 0, "lead": 4},
            {"session_id": "d-score", "turn": 0, "lead": 4, "kind": "scoring", "scores_session_id": "d"},
        ]
    )
    o = OracleReusePredictor.from_workload(wl)
    for k, s, t in ((EventKind.SCHEDULED, "a", 0), (EventKind.FINISHED, "a", 0)):
        o.observe(ev(k, s, t, t=1000.0))
    for s in ("b", "c", "d"):
        o.observe(ev(EventKind.SCHEDULED, s))
        o.observe(ev(EventKind.FINISHED, s, t=1001.0))
    ps = [prefix("a0", session="a"), prefix("b0", session="b"), prefix("c0", session="c"), prefix("d0", session="d")]
    # a: turn 1 comes at finish + 2.5; b: never; c: the sibling's arrival; d: the scorer, when d finished
    assert o.next_use_s(ps, 1000.5) == [1002.5, INF, 1030.0, 1001.0]
    assert o.next_use_s(ps[3:], 1005.0) == [1005.0]  # the scorer is due: now
    # a's turn 1 arrived and waits: now; once scheduled, the next use is turn 2 (chained lower bound)
    o.observe(ev(EventKind.ARRIVED, "a", 1, t=1002.5))
    assert o.next_use_s(ps[:1], 1002.6) == [1002.6]
    o.observe(ev(EventKind.SCHEDULED, "a", 1, t=1002.7))
    assert o.next_use_s(ps[:1], 1003.0) == [1007.0]
    o.observe(ev(EventKind.FINISHED, "a", 1, t=1010.0))
    assert o.next_use_s(ps[:1], 1010.0) == [1014.0]
    # a preempted request waits again: its prefix is needed now
    o.observe(ev(EventKind.SCHEDULED, "c2", 0, t=1031.0))
    assert o.next_use_s([ps[2]], 1031.0) == [INF]
    o.observe(ev(EventKind.PREEMPTED, "c2", 0, t=1032.0))
    assert o.next_use_s([ps[2]], 1033.0) == [1033.0]
    # no metadata, or a row the workload does not have: never
    assert o.next_use_s([prefix("x", session="zz")], 0.0) == [INF]


def test_oracle_reuse_batch_equals_one_by_one():
    """next_use_s scans a leading block's sharers once per call; each answer equals next_use_key's, the owner
    itself left out (also when the owner is pending again, after a preemption)."""
    import random

    rng = random.Random(7)
    rows = []
    for g in range(6):  # groups of siblings sharing a lead, some with a second turn after a tool
        for i in range(4):
            s = f"g{g}s{i}"
            rows.append({"session_id": s, "turn": 0, "lead": g, "tool_latency_s": rng.choice([None, 1.5, 40.0]),
                         "arrival_s": 1000.0 + rng.choice([0.0, 5.0, 60.0])})
            if rows[-1]["tool_latency_s"] is not None:
                rows.append({"session_id": s, "turn": 1, "lead": g})
    o = OracleReusePredictor.from_workload(workload(rows))
    keys = [(r["session_id"], r["turn"]) for r in rows]
    ps = [prefix(f"{s}-{t}", session=s, turn=t) for s, t in keys] + [prefix("x", session="zz")]
    now = 1000.0
    kinds = [EventKind.ARRIVED, EventKind.SCHEDULED, EventKind.PREEMPTED, EventKind.FINISHED]
    for _ in range(60):
        s, t = rng.choice(keys)
        now += rng.random() * 3
        o.observe(ev(rng.choice(kinds), s, t, t=now))
        assert o.next_use_s(ps, now) == [o.next_use_key(row_key(p.meta), now) for p in ps]


def test_kvflow_orders_furthest_next_use_first_ties_lru():
    p = NextUseEvictionPolicy(reuse_predictor=StubReuse({"a": 1005.0, "b": INF, "c": 1100.0, "d": 1005.0}))
    ps = [prefix("a", last_used=3), prefix("b", last_used=4), prefix("c", last_used=1), prefix("d", last_used=2)]
    dec = p.evict(ps, 4, engine_state())
    assert list(dec.order) == ["b", "c", "d", "a"]


def test_marconi_scores():
    m = FlopsAwareEvictionPolicy(alpha=2.0)
    # FLOPs per KV byte grow with length (attention is quadratic in it)
    assert m.flops_per_byte(16) < m.flops_per_byte(1024) < m.flops_per_byte(32768)
    assert m.flops_per_byte(1024) == pytest.approx((2 * 6.53e9 + 2 * 28 * 3584 * 1025) / 57344)
    long_old = prefix("long", n_blocks=64, last_used=0.0)
    short_new = prefix("short", n_blocks=2, last_used=10.0)
    mid = prefix("mid", n_blocks=33, last_used=5.0)
    ps = [long_old, short_new, mid]
    # long: 0 + 2*1; short: 1 + 0; mid: 0.5 + 2*0.5
    assert m.scores(ps, 16) == pytest.approx([2.0, 1.0, 1.5])
    assert list(m.evict(ps, 1, engine_state()).order) == ["short", "mid", "long"]
    # alpha = 0: plain LRU
    lru = FlopsAwareEvictionPolicy(alpha=0.0)
    assert list(lru.evict(ps, 1, engine_state()).order) == ["long", "mid", "short"]


def test_lrb_samples_then_evicts_furthest_in_sample():
    table = {"p0": 1010.0, "p1": 1040.0, "p2": 1030.0, "p3": 1020.0}
    ps = [prefix(f"p{i}", n_blocks=2, last_used=i) for i in range(4)]
    lrb = SampledNextUseEvictionPolicy(sample_size=2, seed=5, reuse_predictor=StubReuse(table))
    dec = lrb.evict(ps, 2, engine_state())
    assert lrb.last_sample == ["p2", "p3"]  # random.Random(5).sample(range(4), 2), sorted
    assert list(dec.order) == ["p2"]  # not p1, the global furthest: it was not sampled
    assert lrb.reuse.asked == [["p2", "p3"]]  # only the sample is scored
    # covering a bigger allocation lists more of the sample, furthest first
    lrb2 = SampledNextUseEvictionPolicy(sample_size=3, seed=5, reuse_predictor=StubReuse(table))
    dec = lrb2.evict(ps, 3, engine_state())
    assert list(dec.order) == [pid for pid in ("p1", "p2", "p3", "p0") if pid in lrb2.last_sample][:2]
    # a sample as large as the candidates is Belady over all of them
    full = SampledNextUseEvictionPolicy(sample_size=64, reuse_predictor=StubReuse(table))
    assert list(full.evict(ps, 8, engine_state()).order) == ["p1", "p2", "p3", "p0"]


def test_continuum_ttl_from_prior_then_learned_quantile():
    c = ToolPauseTTLPolicy(ttl_quantile=0.9, prior_ttl_s=3.0, min_observations=5)
    assert c.ttl_stats("search") == (3.0, 0.9, 3.0)
    for i, x in enumerate([0.1, 0.2, 0.3, 0.4, 10.0]):
        c.on_event(ev(EventKind.TOOL_CALL_STARTED, f"s{i}", 0, t=100.0, tool="search"))
        c.on_event(ev(EventKind.TOOL_CALL_ENDED, f"s{i}", 1, t=100.0 + x))
    ttl, p, hold = c.ttl_stats("search")
    assert ttl == pytest.approx(quantile([0.1, 0.2, 0.3, 0.4, 10.0], 0.9))
    assert ttl == pytest.approx(6.16)
    assert p == pytest.approx(0.8)
    assert hold == pytest.approx((0.1 + 0.2 + 0.3 + 0.4 + 6.16) / 5)
    # another tool with no observations of its own uses the pooled ones
    assert c.ttl_stats("sandbox") == c.ttl_stats("search")


def test_continuum_pin_rule():
    c = ToolPauseTTLPolicy(prior_ttl_s=2.0, prefill_tokens_per_s=1000.0)
    paused = prefix("P", n_blocks=10, session="agent", tool="search", state=OwnerState.PAUSED_TOOL)
    done = prefix("D", n_blocks=10, session="other")
    # saved: 0.9 * 160 tokens / 1000 tok/s = 0.144 s; cost with a queue: 10/100 * 2 s = 0.2 s -> no pin
    assert c.retain([paused, done], engine_state(waiting=3, total=100)) is None
    # idle engine at 50% usage: cost 0.1 s -> pin, with the prior TTL
    dec = c.retain([paused, done], engine_state(waiting=0, usage=0.5, total=100))
    assert set(dec.actions) == {"P"}
    assert dec.actions["P"].action is RetentionAction.PROTECT and dec.actions["P"].ttl_s == 2.0
    # a big cache makes the held fraction small: pin even with a queue
    assert "P" in ToolPauseTTLPolicy(prior_ttl_s=2.0, prefill_tokens_per_s=1000.0).retain(
        [paused], engine_state(waiting=3, total=10000)
    ).actions


def test_continuum_releases_when_next_turn_is_scheduled():
    c = ToolPauseTTLPolicy(prior_ttl_s=5.0)
    paused = prefix("P", session="agent", turn=0, tool="search", state=OwnerState.PAUSED_TOOL)
    assert "P" in c.retain([paused], engine_state()).actions
    pinned = prefix("P", session="agent", turn=0, state=OwnerState.RUNNING, pinned=1005.0)
    assert c.retain([pinned], engine_state()) is None  # returned but not scheduled yet: keep
    c.on_event(ev(EventKind.SCHEDULED, "agent", 1))
    dec = c.retain([prefix("X"), pinned], engine_state())
    assert set(dec.release) == {"P"} and not dec.actions


def test_continuum_returning_turn_keeps_program_arrival_order():
    c = ToolPauseTTLPolicy()
    first = [cand("A0", "A", 0, arrival=1.0), cand("B0", "B", 0, arrival=2.0)]
    assert list(c.admit(first, engine_state()).order) == ["A0", "B0"]
    # later: a fresh session C arrived before A's returning turn; A keeps its place
    later = [cand("C0", "C", 0, arrival=5.0), cand("X", None, 0, arrival=5.5), cand("A1", "A", 1, arrival=6.0)]
    assert list(c.admit(later, engine_state()).order) == ["A1", "C0", "X"]


def test_continuum_sessions_with_one_arrival_stamp_keep_the_order_first_seen():
    """A step's first turns released at one instant tie on arrival: the order is still session by session (as on a
    server, where the client's sends are stamped apart), not first come first served."""
    c = ToolPauseTTLPolicy()
    first = [cand(f"{s}0", s, 0, arrival=0.0) for s in "ABC"]
    assert list(c.admit(first, engine_state()).order) == ["A0", "B0", "C0"]
    # B's and A's returning turns arrive after C0 still waits: each keeps its session's place, A before B before C
    later = [cand("C0", "C", 0, arrival=0.0), cand("B1", "B", 1, arrival=3.0), cand("A1", "A", 1, arrival=4.0)]
    assert list(c.admit(later, engine_state()).order) == ["A1", "B1", "C0"]


def test_oracle_chain_admission_serves_the_longest_remaining_session_first():
    """``chain``: this turn's remaining output plus the session's later turns (critical path first), where
    ``lpt`` sees only this turn."""
    wl = workload([
        {"session_id": "a", "turn": 0, "lead": 1, "output_tokens": 50},
        {"session_id": "b", "turn": 0, "lead": 2, "tool_latency_s": 1.0, "output_tokens": 10},
        {"session_id": "b", "turn": 1, "lead": 2, "output_tokens": 200},
    ])
    w = [cand("a0", "a", 0, arrival=0.0), cand("b0", "b", 0, arrival=1.0), cand("x", None, 0, arrival=2.0)]
    assert list(HindsightOraclePolicy(admission="lpt", workload=wl).admit(w, engine_state()).order)[:2] == ["a0", "b0"]
    assert list(HindsightOraclePolicy(admission="chain", workload=wl).admit(w, engine_state()).order) == \
        ["b0", "a0", "x"]  # (a request the workload does not know goes last, as with lpt)
    with pytest.raises(ValueError, match="admission='chain' needs the simulated workload"):
        HindsightOraclePolicy(admission="chain", length_predictor=None)


def test_oracle_admission_retention_and_belady():
    wl = workload(
        [
            {"session_id": "a", "turn": 0, "lead": 1, "tool_latency_s": 2.0, "output_tokens": 50},
            {"session_id": "a", "turn": 1, "lead": 1, "output_tokens": 10},
            {"session_id": "b", "turn": 0, "lead": 2, "tool_latency_s": 100.0, "output_tokens": 5},
            {"session_id": "b", "turn": 1, "lead": 2},
            {"session_id": "c", "turn": 0, "lead": 3, "output_tokens": 30},
        ]
    )
    o = HindsightOraclePolicy(max_ttl_s=10.0, ttl_margin_s=0.5, workload=wl)
    # SRPT on true remaining output
    w = [cand("a0", "a", 0, arrival=0.0), cand("b0", "b", 0, arrival=1.0), cand("c0", "c", 0, arrival=2.0, out=28)]
    assert list(o.admit(w, engine_state()).order) == ["c0", "b0", "a0"]
    lpt = HindsightOraclePolicy(admission="lpt", workload=wl)
    assert list(lpt.admit(w, engine_state()).order) == ["a0", "b0", "c0"]
    for s in ("a", "b", "c"):
        o.on_event(ev(EventKind.SCHEDULED, s, 0, t=999.0))
        o.on_event(ev(EventKind.FINISHED, s, 0, t=1000.0))
    pa_ = prefix("a0", session="a", tool="search", state=OwnerState.PAUSED_TOOL, last_used=1000.0)
    pb = prefix("b0", session="b", tool="search", state=OwnerState.PAUSED_TOOL, last_used=1000.0)
    pc = prefix("c0", session="c", last_used=1000.0)
    dec = o.retain([pa_, pb, pc], engine_state(now=1000.0))
    # a returns in 2 s (within max_ttl 10): pinned until then + margin; b's 100 s return is too far
    assert set(dec.actions) == {"a0"} and dec.actions["a0"].ttl_s == pytest.approx(2.5)
    # Belady: c never again, then b (1100), then a (1002)
    assert list(o.evict([pa_, pb, pc], 3, engine_state(now=1000.0)).order) == ["c0", "b0", "a0"]
    # once a's next turn is scheduled, its pin has no near use left: released
    o.on_event(ev(EventKind.ARRIVED, "a", 1, t=1002.0))
    o.on_event(ev(EventKind.SCHEDULED, "a", 1, t=1002.0))
    pinned = prefix("a0", session="a", state=OwnerState.RUNNING, pinned=1002.5)
    dec = o.retain([pinned], engine_state(now=1002.1))
    assert set(dec.release) == {"a0"}


def test_factories_and_options():
    wl = workload([{"session_id": "a", "turn": 0, "lead": 1}])
    for name in ("kvflow", "lrb", "oracle"):
        p = create_policy(name, workload=wl)
        assert p.uses_eviction and p.name == name
    with pytest.raises(ValueError, match="workload"):  # hindsight needs the workload; kvflow and lrb go online
        create_policy("oracle")
    assert create_policy("marconi", alpha=0.5).alpha == 0.5
    assert create_policy("continuum", prior_ttl_s=1.0).uses_retention
    assert create_policy("lrb", workload=wl, max_candidates=128).max_eviction_candidates == 128
    with pytest.raises(ValueError):
        create_policy("lrb", workload=wl, sample_size=0)
    with pytest.raises(ValueError):
        create_policy("oracle", workload=wl, admission="nope")
    with pytest.raises(ValueError):
        create_policy("continuum", ttl_quantile=1.5)


# ===================================================== on the real scheduler
class FakeClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def _run_until_done(s, runner, limit=300):
    for _ in range(limit):
        runner.step(s)
        if not s.has_requests():
            return
    raise AssertionError("requests did not finish")


def _cached(engine, s, prompt):
    return s.kv_cache_manager.get_computed_blocks(engine.make_request("probe", prompt, 1))[1]


def _run_prefixes(engine, s, runner, specs, clock=None, dt=0.0):
    """Run one request per (name, n_tokens, extra_args), one after the other."""
    prompts = {}
    for name, n, extra in specs:
        prompts[name] = fake_runner.prompt_tokens(f"bl-{name}", n)
        s.add_request(engine.make_request(name, prompts[name], 2, extra_args=extra))
        _run_until_done(s, runner)
        if clock is not None:
            clock.t += dt
    return prompts


def _xa(session, turn=0, tool=None):
    d = {"kvpilot_session_id": session, "kvpilot_turn": turn}
    if tool:
        d["kvpilot_tool"] = tool
    return d


def _continuum_scenario(engine, tool_s):
    clock = FakeClock()
    policy = ToolPauseTTLPolicy(prior_ttl_s=5.0)
    s = engine.make_scheduler(_hook(policy, max_pinned_fraction=0.5), num_blocks=13, max_num_seqs=4)
    s.kvpilot_clock = clock
    runner = fake_runner.FakeRunner()
    p_prompt = fake_runner.prompt_tokens("bl-agent", 64)
    s.add_request(engine.make_request("P", p_prompt, 2, extra_args=_xa("agent", 0, "search")))
    _run_until_done(s, runner)
    runner.step(s)  # retention decision
    assert s.kvpilot_pinned_blocks == 4
    clock.t += tool_s
    for i in range(2):  # pressure while the tool runs: LRU alone would evict P (see test_hook_levers)
        s.add_request(engine.make_request(f"F{i}", fake_runner.prompt_tokens(f"bl-filler{i}", 100), 2))
        _run_until_done(s, runner)
    s.add_request(engine.make_request("P2", p_prompt + [7] * 10, 2, extra_args=_xa("agent", 1)))
    out = runner.step(s)
    hit = out.scheduled_new_reqs[0].num_computed_tokens
    _run_until_done(s, runner)
    runner.step(s)
    return s, policy, hit


@pytest.mark.vllm
def test_continuum_pin_outlives_short_tool_call_and_is_released(vllm_engine):
    s, policy, hit = _continuum_scenario(vllm_engine, tool_s=1.0)
    assert hit == 64  # the returning turn hit the pinned context
    assert s.kvpilot_pinned_blocks == 0
    assert s._kvp_retention.pins.num_released_policy == 1 and s._kvp_retention.pins.num_released_expired == 0
    assert list(policy.latencies._lat["search"]) == [1.0]  # the tool latency was learned


@pytest.mark.vllm
def test_continuum_pin_expires_after_long_tool_call(vllm_engine):
    s, policy, hit = _continuum_scenario(vllm_engine, tool_s=6.0)  # TTL 5 s (prior)
    assert s._kvp_retention.pins.num_released_expired == 1
    assert hit == 0  # released at the TTL, then evicted by the fillers


def _three_prefix_eviction(engine, policy_cls_or_none, specs):
    """A, B, C (48 tokens = 3 blocks each) cached in that order, then a 144-token filler
    needs the 3 empty blocks and 6 cached ones. Returns the cached tokens of each."""
    clock = FakeClock()
    cls = _hook(policy_cls_or_none) if policy_cls_or_none is not None else None
    s = engine.make_scheduler(cls, num_blocks=13, max_num_seqs=4)
    if policy_cls_or_none is not None:
        s.kvpilot_clock = clock
    runner = fake_runner.FakeRunner()
    prompts = _run_prefixes(engine, s, runner, specs)
    s.add_request(engine.make_request("F", fake_runner.prompt_tokens("bl-filler", 144), 1))
    _run_until_done(s, runner)
    return s, {k: _cached(engine, s, p + [1]) for k, p in prompts.items()}


_SIBLINGS = [("A", 48, _xa("sa")), ("B", 48, _xa("sb")), ("C", 48, _xa("sc"))]
_SIBLING_WL = [
    {"session_id": "sa", "lead": 1},
    {"session_id": "sa2", "lead": 1, "arrival_s": 1001.0},  # A's sibling arrives in 1 s
    {"session_id": "sb", "lead": 2},  # nothing shares B: never used again
    {"session_id": "sc", "lead": 3},
    {"session_id": "sc2", "lead": 3, "arrival_s": 1100.0},  # C's sibling in 100 s
]


@pytest.mark.vllm
def test_lru_baseline_of_three_prefix_scenario(vllm_engine):
    _, hits = _three_prefix_eviction(vllm_engine, None, _SIBLINGS)
    assert hits == {"A": 0, "B": 0, "C": 48}


@pytest.mark.vllm
def test_oracle_belady_evicts_furthest_next_use(vllm_engine):
    policy = HindsightOraclePolicy(workload=workload([dict(r) for r in _SIBLING_WL]))
    s, hits = _three_prefix_eviction(vllm_engine, policy, _SIBLINGS)
    assert hits == {"A": 48, "B": 0, "C": 0}
    assert s.kvpilot_stats.eviction_calls == 1 and not s.kvpilot_stats.fallbacks


# Block-level Belady. S (2 blocks) is shared by A = S+a and B = S+b+b' (B never
# used again); C (3 blocks) is used again after A. Cached in the order A, C, B:
# 8 blocks, 4 empty; a 112-token filler F needs 3 cached blocks, then A' = A+x
# and C' = C+y come. Block hashes per 16-token block.
_BLOCK_RUNS = [("A", "sa", ["s", "a"]), ("C", "sc", ["c"]), ("B", "sb", ["s", "b"]), ("F", "sf", ["f"]),
               ("A2", "sa2", ["s", "a", "x"]), ("C2", "sc2", ["c", "y"])]
_BLOCK_TOKENS = {"s": 32, "a": 16, "b": 32, "c": 48, "f": 112, "x": 16, "y": 16}
_BLOCK_HASHES = {"s": [1, 2], "a": [3], "b": [4, 5], "c": [6, 7, 8], "f": list(range(20, 27)), "x": [9], "y": [10]}


def _block_belady_run(engine, policy):
    """Hits (tokens) of A' and C', and the cached tokens of A, B and C right after F."""
    clock = FakeClock()
    s = engine.make_scheduler(_hook(policy) if policy is not None else None, num_blocks=13, max_num_seqs=4)
    if policy is not None:
        s.kvpilot_clock = clock
    runner = fake_runner.FakeRunner()
    parts = {k: fake_runner.prompt_tokens(f"bb-{k}", n) for k, n in _BLOCK_TOKENS.items()}
    prompts, hits, after_f = {}, {}, {}
    for name, session, keys in _BLOCK_RUNS:
        prompts[name] = [t for k in keys for t in parts[k]]
        s.add_request(engine.make_request(name, prompts[name], 1 if name == "F" else 2, extra_args=_xa(session)))
        out = runner.step(s)
        hits[name] = out.scheduled_new_reqs[0].num_computed_tokens
        _run_until_done(s, runner)
        clock.t += 1.0
        if name == "F":
            after_f = {n: _cached(engine, s, prompts[n] + [1]) for n in "ABC"}
    return s, hits, after_f


def _block_workload():
    rows = []
    for i, (_, session, keys) in enumerate(_BLOCK_RUNS):
        rows.append({"session_id": session, "prompt_tokens": sum(_BLOCK_TOKENS[k] for k in keys),
                     "block_hashes": [h for k in keys for h in _BLOCK_HASHES[k]], "arrival_s": 1000.0 + i})
    return workload(rows)


def test_block_next_use_reads_the_hash_chains():
    from policy.baselines.oracle import BlockNextUse

    nu = BlockNextUse(_block_workload())
    m = lambda s: meta(s)  # noqa: E731
    # A's blocks s0 s1 a: next hit by B (rank 2, shares S only) then A' (rank 4); a by A' only
    assert [nu.next_use(m("sa"), d) for d in range(4)] == [2.0, 2.0, 4.0, INF]  # block 3: A's output
    for rid, session in (("A", "sa"), ("C", "sc"), ("B", "sb")):
        nu.observe(Event(EventKind.SCHEDULED, 0.0, rid, m(session)))
    assert [nu.next_use(m("sa"), d) for d in range(3)] == [4.0, 4.0, 4.0]
    assert [nu.next_use(m("sb"), d) for d in range(4)] == [4.0, 4.0, INF, INF]  # B's own blocks: never
    # C' (64 tokens) hits at most 3 blocks: all of C
    assert [nu.next_use(m("sc"), d) for d in range(3)] == [5.0] * 3


@pytest.mark.vllm
def test_block_belady_evicts_the_furthest_next_use_blocks(vllm_engine):
    """Belady drops B's own blocks (never used) then C's deepest (used after A'); S, shared with A, stays.

    LRU drops a, c2, c1 (the oldest); leading-block Belady (prefix mode) ranks B
    by S's next use (A') and drops C first. Block Belady hits the most.
    """
    _, lru, lru_after = _block_belady_run(vllm_engine, None)
    policy = HindsightOraclePolicy(admission="fcfs", eviction="block", workload=_block_workload())
    s, bel, bel_after = _block_belady_run(vllm_engine, policy)
    assert bel_after == {"A": 48, "B": 32, "C": 32}  # b, b' and c2 went
    assert bel["A2"] == 48 and bel["C2"] == 32
    assert lru_after == {"A": 32, "B": 64, "C": 16}  # a, c2, c1 went
    assert bel["A2"] + bel["C2"] > lru["A2"] + lru["C2"]
    assert not s.kvpilot_stats.fallbacks
    prefix_mode = HindsightOraclePolicy(admission="fcfs", workload=_block_workload())
    _, pre, _ = _block_belady_run(vllm_engine, prefix_mode)
    assert pre["A2"] + pre["C2"] < bel["A2"] + bel["C2"]


@pytest.mark.vllm
def test_kvflow_evicts_furthest_predicted_next_use(vllm_engine):
    # tool turns: A's next turn comes 1 s after it finishes, C's 50 s after; B has none
    wl = workload(
        [
            {"session_id": "sa", "turn": 0, "lead": 1, "tool_latency_s": 1.0},
            {"session_id": "sa", "turn": 1, "lead": 1},
            {"session_id": "sb", "turn": 0, "lead": 2},
            {"session_id": "sc", "turn": 0, "lead": 3, "tool_latency_s": 50.0},
            {"session_id": "sc", "turn": 1, "lead": 3},
        ]
    )
    specs = [("A", 48, _xa("sa", 0, "search")), ("B", 48, _xa("sb")), ("C", 48, _xa("sc", 0, "search"))]
    policy = NextUseEvictionPolicy(workload=wl)
    s, hits = _three_prefix_eviction(vllm_engine, policy, specs)
    assert hits == {"A": 48, "B": 0, "C": 0}
    assert s.kvpilot_stats.evict_first_blocks == 9


def _marconi_run(engine, alpha):
    """L (96 tokens, 6 blocks) freed at t=1000, S (32 tokens, 2 blocks) at t=1010; a
    96-token filler needs the 4 empty blocks and 2 cached ones."""
    clock = FakeClock()
    s = engine.make_scheduler(_hook(FlopsAwareEvictionPolicy(alpha=alpha)), num_blocks=13, max_num_seqs=4)
    s.kvpilot_clock = clock
    runner = fake_runner.FakeRunner()
    prompts = _run_prefixes(engine, s, runner, [("L", 96, None), ("S", 32, None)], clock=clock, dt=10.0)
    s.add_request(engine.make_request("F", fake_runner.prompt_tokens("bl-mfill", 96), 1))
    _run_until_done(s, runner)
    return {k: _cached(engine, s, p + [1]) for k, p in prompts.items()}


@pytest.mark.vllm
def test_marconi_keeps_long_prefix_over_short_recent_one(vllm_engine):
    # alpha 2: L scores 0 + 2*1 = 2, S 1 + 0 = 1 -> S goes, L stays whole
    assert _marconi_run(vllm_engine, 2.0) == {"L": 96, "S": 0}
    # alpha 0.5: L 0.5 < S 1 -> L loses its 2 deepest blocks (as LRU would)
    assert _marconi_run(vllm_engine, 0.5) == {"L": 64, "S": 32}


def _lrb_run(engine, seed):
    """P0..P3 (32 tokens = 2 blocks each) cached in order; a 96-token filler needs the
    4 empty blocks and 2 cached ones: exactly one prefix goes."""
    table = {"P0": 1010.0, "P1": 1040.0, "P2": 1030.0, "P3": 1020.0}
    policy = SampledNextUseEvictionPolicy(sample_size=2, seed=seed, reuse_predictor=StubReuse(table))
    s = engine.make_scheduler(_hook(policy), num_blocks=13, max_num_seqs=4)
    s.kvpilot_clock = FakeClock()
    runner = fake_runner.FakeRunner()
    prompts = _run_prefixes(engine, s, runner, [(f"P{i}", 32, None) for i in range(4)])
    s.add_request(engine.make_request("F", fake_runner.prompt_tokens("bl-lfill", 96), 1))
    _run_until_done(s, runner)
    return policy, {k: _cached(engine, s, p + [1]) for k, p in prompts.items()}


@pytest.mark.vllm
def test_lrb_evicts_furthest_within_its_seeded_sample(vllm_engine):
    policy, hits = _lrb_run(vllm_engine, seed=5)
    assert policy.last_sample == ["P2", "P3"]
    assert hits == {"P0": 32, "P1": 32, "P2": 0, "P3": 32}  # P2: furthest of the sample (P1 not sampled)
    policy, hits = _lrb_run(vllm_engine, seed=0)
    assert policy.last_sample == ["P1", "P3"]
    assert hits == {"P0": 32, "P1": 0, "P2": 32, "P3": 32}


def test_hindsight_references_get_at_least_the_simulators_decision_budget() -> None:
    """The oracles' own budget replaces the hook's; below the simulator's, a loaded machine turns their steps into
    LRU (and the ceiling they stand for drops with the load)."""
    from policy.baselines.offload_tier import HindsightOracleOffloadPolicy
    from simulator.config import SIM_DECISION_BUDGET_S

    for cls in (HindsightOraclePolicy, HindsightOracleOffloadPolicy):
        assert cls.decision_budget_s >= SIM_DECISION_BUDGET_S
