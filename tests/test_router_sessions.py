"""Session-aware routers: affinity with load awareness and kvpilot's demand-based router, by hand and on the real
simulator (a session stays on its replica at low load; past the threshold it moves and the move is priced)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from simulator.routers import KVPilotRouter, ReplicaLoad, RouteRequest, SessionAffinityRouter

BS = 16


def req(rid: str, tokens: int, *, home: int | None = None, stream: str | None = None, hashes: list[int] | None = None,
        domain: str | None = "swe") -> RouteRequest:
    return RouteRequest(rid, hashes or [], tokens, BS, session_id=stream, stream=stream or rid, home=home,
                        domain=domain)


def rep(index: int, load: int, kv_blocks: int = 1000, free: int = 1000) -> ReplicaLoad:
    return ReplicaLoad(index, load, kv_blocks, free)


# ------------------------------------------------------------------ session affinity, by hand
def test_affinity_places_new_sessions_on_the_least_loaded_and_keeps_them_home() -> None:
    r = SessionAffinityRouter()
    assert r.route(req("a", 100), [rep(0, 3), rep(1, 1), rep(2, 1, free=900)]) == 1  # ties: more free KV
    # home 0 has 10 against a lightest 2: 10 <= 2 * 2 + 8, it stays
    assert r.route(req("a1", 100, home=0), [rep(0, 10), rep(1, 2)]) == 0
    # 13 > 2 * 2 + 8: past the queue threshold, to the least-loaded
    assert r.route(req("a2", 100, home=0), [rep(0, 13), rep(1, 2)]) == 1


def test_affinity_moves_off_a_full_kv_cache_only_when_another_has_room() -> None:
    r = SessionAffinityRouter(max_kv_usage=0.9)
    full, roomy = rep(0, 4, free=50), rep(1, 4, free=500)
    assert r.route(req("a", 100, home=0), [full, roomy]) == 1
    assert r.route(req("b", 100, home=0), [full, rep(1, 4, free=60)]) == 0  # both full: moving buys nothing


def test_affinity_rejects_bad_thresholds() -> None:
    with pytest.raises(ValueError, match="max_load_ratio"):
        SessionAffinityRouter(max_load_ratio=0.5)


# ------------------------------------------------------------------ kvpilot router, by hand
def test_kvpilot_balances_predicted_demand_not_request_counts() -> None:
    r = KVPilotRouter()
    reps = [rep(0, 0), rep(1, 0)]  # 16,000 tokens each
    assert r.route(req("big", 12_000), reps) == 0
    # two small sessions both go to replica 1: replica 0 holds 12,000 tokens of demand
    assert r.route(req("s1", 1_000), reps) == 1
    assert r.route(req("s2", 1_000), reps) == 1
    assert r.committed(0) == 12_000 and r.committed(1) == 2_000


def test_kvpilot_learns_each_domains_peak_from_ended_sessions() -> None:
    r = KVPilotRouter()
    reps = [rep(0, 0), rep(1, 0)]
    r.route(req("a", 1_000, stream="a"), reps)
    r.route(req("a1", 9_000, stream="a", home=0), reps)  # the session grew
    r.on_session_end("a")
    assert r.committed(0) == 0
    assert r.predicted_demand(500, "swe") == 9_000  # a new swe session is expected to reach 9,000
    assert r.predicted_demand(500, "math") == 500  # no math session ended yet
    r.route(req("b", 500, stream="b"), reps)
    assert r.committed(0) + r.committed(1) == 9_000


def _crowded(router: KVPilotRouter) -> list[ReplicaLoad]:
    """Replica 0 committed to 3,000 of its 3,200 tokens, then session ``s`` (100 tokens) forced onto it."""
    reps = [rep(0, 0, kv_blocks=200), rep(1, 0, kv_blocks=200)]
    router.route(req("big", 3_000, stream="big"), reps)
    assert router.route(req("s", 100, stream="s"), [reps[0], rep(1, 0, kv_blocks=1)]) == 0
    return reps


def test_kvpilot_keeps_a_session_home_while_it_fits() -> None:
    prefix = list(range(1, 101))  # 1,600 tokens
    r = KVPilotRouter()
    reps = [rep(0, 0, kv_blocks=200), rep(1, 0, kv_blocks=200)]
    r.route(req("big", 3_000, stream="big"), reps)
    assert r.route(req("x", 1_600, stream="x", hashes=prefix), reps) == 1  # 0 would be at 4,600 / 3,200
    r.on_kv_event(1, "stored", prefix)
    assert r.route(req("x1", 2_000, stream="x", home=1, hashes=prefix), reps) == 1
    assert r.committed(1) == 2_000  # its demand moved from its old context to the new one, not added twice


def test_kvpilot_moves_an_evicted_session_off_an_over_committed_replica() -> None:
    r = KVPilotRouter()
    reps = _crowded(r)
    # s grows to 400: replica 0 at 3,400 / 3,200; nothing of s is cached there, so moving costs nothing
    assert r.route(req("s1", 400, stream="s", home=0), reps) == 1
    assert (r.committed(0), r.committed(1)) == (3_000, 400)


def test_kvpilot_keeps_a_cached_session_when_giving_it_up_costs_more_than_the_overflow() -> None:
    r = KVPilotRouter()
    reps = _crowded(r)
    cached = list(range(1, 26))  # 400 tokens of s, cached on replica 0
    r.on_kv_event(0, "stored", cached)
    # staying loses 400 x (1 - 3,200 / 3,400) = 23.5 tokens expected; moving gives up all 400
    assert r.route(req("s1", 400, stream="s", home=0, hashes=cached), reps) == 0


# ------------------------------------------------------------------ on the real simulator
@pytest.fixture(scope="module")
def agentic() -> Any:
    from data.synth import SynthConfig, generate

    return generate(dataclasses.replace(SynthConfig.preset("agentic"), steps=1, prompts_per_step=2))


def _run(workload: Any, router: Any, kv_fraction: float) -> tuple[Any, Any]:
    from simulator.simulation import Simulation

    sim = Simulation(workload, "vllm-default", replicas=2, router=router, kv_fraction=kv_fraction, progress=False,
                     decode_stride=32, decision_log=False, kv_event_log=False)
    return sim, sim.run()


def _turns(result: Any) -> dict[str, list[dict]]:
    """Each session's rollout turns, in order, as the hook logged them (with the replica each ran on)."""
    sessions: dict[str, list[dict]] = {}
    for r in result.requests.to_pylist():
        if r["turn"] is not None and not r["session_id"].endswith("-score"):
            sessions.setdefault(r["session_id"], []).append(r)
    return {s: sorted(t, key=lambda r: r["turn"]) for s, t in sessions.items()}


@pytest.mark.vllm
def test_affinity_keeps_every_turn_home_at_low_load(vllm_engine: Any, agentic: Any) -> None:
    sim, result = _run(agentic, "session-affinity", kv_fraction=0.5)
    turns = _turns(result)
    assert max(len(t) for t in turns.values()) > 3  # multi-turn sessions
    assert {r["replica"] for t in turns.values() for r in t} == {0, 1}
    for sid, t in turns.items():
        assert len({r["replica"] for r in t}) == 1, sid
    assert result.summary.session_moves == 0 and result.summary.session_move_tokens == 0
    assert sim.submitted == [1] * agentic.num_rows and sim.finished == [1] * agentic.num_rows


@pytest.mark.vllm
def test_affinity_past_the_threshold_moves_sessions_and_the_move_is_priced(vllm_engine: Any, agentic: Any) -> None:
    # any queue above the lightest one's is past this threshold
    sim, result = _run(agentic, SessionAffinityRouter(max_load_ratio=1.0, min_load_gap=0), kv_fraction=0.2)
    moved, stayed = [], []
    for t in _turns(result).values():
        for a, b in zip(t, t[1:]):
            (moved if b["replica"] != a["replica"] else stayed).append(b)
    s = result.summary
    assert len(moved) == s.session_moves > 0 and stayed
    assert s.session_move_tokens == sum(r["prompt_tokens"] for r in moved)
    # priced: the new replica prefills the context again (it holds at most the siblings' shared prompt)
    share = lambda rs: sum(r["cached_tokens"] for r in rs) / sum(r["prompt_tokens"] for r in rs)  # noqa: E731
    assert share(moved) < 0.5 * share(stayed)
    assert sum(r["prompt_tokens"] - r["cached_tokens"] for r in moved) > 0.5 * s.session_move_tokens
    assert sim.submitted == [1] * agentic.num_rows and sim.finished == [1] * agentic.num_rows


@pytest.mark.vllm
def test_kvpilot_router_runs_every_request_and_moves_only_sessions(vllm_engine: Any, agentic: Any) -> None:
    sim, result = _run(agentic, "kvpilot", kv_fraction=0.15)
    assert sim.submitted == [1] * agentic.num_rows and sim.finished == [1] * agentic.num_rows
    turns = _turns(result)
    assert {r["replica"] for t in turns.values() for r in t} == {0, 1}
    moves = sum(b["replica"] != a["replica"] for t in turns.values() for a, b in zip(t, t[1:]))
    assert moves == result.summary.session_moves
