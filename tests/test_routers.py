"""Routers: SGLang cache_aware rules worked by hand, round robin, least loaded, the registry."""

from __future__ import annotations

import pytest

from simulator.routers import (
    CacheAwareRouter,
    LeastLoadedRouter,
    ReplicaLoad,
    RoundRobinRouter,
    RouteRequest,
    make_router,
)

BS = 16


def req(rid: str, hashes: list[int], tokens: int | None = None) -> RouteRequest:
    return RouteRequest(rid, hashes, tokens if tokens is not None else len(hashes) * BS, BS, session_id=None)


def loads(*values: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, v) for i, v in enumerate(values)]


def seeded(prefix: list[int]) -> CacheAwareRouter:
    r = CacheAwareRouter()
    r.on_routed(req("seed", prefix), 0)  # replica 0 holds the whole prefix
    return r


def test_imbalance_switches_to_least_loaded() -> None:
    prefix = [1, 2, 3, 4]
    # 40 - 5 = 35 > 32 and 40 > 1.0001 * 5: imbalanced, shortest queue wins over the full match.
    r = seeded(prefix)
    assert r.is_imbalanced(loads(40, 5))
    assert r.route(req("a", prefix), loads(40, 5)) == 1
    # 30 - 5 = 25 <= 32: balanced, so the full match on replica 0 wins.
    r = seeded(prefix)
    assert not r.is_imbalanced(loads(30, 5))
    assert r.route(req("b", prefix), loads(30, 5)) == 0


def test_equal_matches_go_to_lower_load() -> None:
    r = seeded([1, 2])
    r.on_routed(req("seed1", [1, 2]), 1)
    assert r.route(req("a", [1, 2]), loads(6, 4)) == 1
    assert r.route(req("b", [1, 2]), loads(4, 4)) == 0


def test_imbalance_needs_both_gaps() -> None:
    r = CacheAwareRouter(balance_abs_threshold=16)  # slime's setting
    assert r.is_imbalanced(loads(20, 3))  # 17 > 16 and 20 > 3.0003
    assert not r.is_imbalanced(loads(19, 3))  # 16 is not > 16
    rel = CacheAwareRouter(balance_abs_threshold=0, balance_rel_threshold=2.0)
    assert not rel.is_imbalanced(loads(10, 5))  # 10 is not > 2.0 * 5
    assert rel.is_imbalanced(loads(11, 5))


def test_match_above_threshold_goes_to_longest_match() -> None:
    r = CacheAwareRouter()
    r.on_routed(req("seed0", [9, 8]), 0)
    r.on_routed(req("seed1", [1, 2, 3]), 1)
    # Chain [1, 2, 3, 7]: 3 of 4 blocks on replica 1, 48 of 64 tokens = 0.75 > 0.5.
    assert r.matched_blocks(1, [1, 2, 3, 7]) == 3
    assert r.route(req("a", [1, 2, 3, 7]), loads(3, 3)) == 1


def test_match_at_or_below_threshold_goes_to_smallest_tree() -> None:
    r = CacheAwareRouter()
    r.on_routed(req("seed1", [1, 2, 30, 31, 32, 33]), 1)  # replica 1: 6 blocks
    r.on_routed(req("seed0", [50, 51, 52]), 0)  # replica 0: 3 blocks
    # Chain [1, 2, 3, 4, 5]: 2 of 5 blocks on replica 1, 0.4 <= 0.5 -> smallest tree, replica 0.
    assert r.matched_blocks(1, [1, 2, 3, 4, 5]) == 2
    assert r.route(req("a", [1, 2, 3, 4, 5]), loads(0, 0)) == 0
    # Exactly at the threshold is not above it: 2 of 4 blocks = 0.5.
    r2 = CacheAwareRouter()
    r2.on_routed(req("seed1", [1, 2, 30, 31, 32]), 1)
    r2.on_routed(req("seed0", [50]), 0)
    assert r2.route(req("b", [1, 2, 3, 4]), loads(0, 0)) == 0


def test_fraction_is_over_tokens() -> None:
    r = CacheAwareRouter()
    r.on_routed(req("seed1", [1, 2, 90, 91, 92]), 1)
    # Chain of 3 blocks over 40 tokens (last block holds 8): 2 matched blocks = 32/40 = 0.8 > 0.5.
    assert r.route(req("a", [1, 2, 3], tokens=40), loads(0, 0)) == 1
    # The same 2 blocks over 6 blocks' worth of tokens: 32/96 = 0.33 -> smallest tree (replica 0).
    assert r.route(req("b", [1, 2, 4, 5, 6, 7]), loads(0, 0)) == 0


def test_no_match_goes_to_fewest_cached_blocks() -> None:
    r = CacheAwareRouter()
    r.on_routed(req("s0", [10, 11, 12, 13]), 0)
    r.on_routed(req("s1", [20]), 1)
    r.on_routed(req("s2", [30, 31]), 2)
    assert [r.tree_blocks(i) for i in range(3)] == [4, 1, 2]
    assert r.route(req("a", [99, 98]), loads(1, 2, 0)) == 1
    # Empty trees tie on size; ties go to the lower load, then the lower index.
    fresh = CacheAwareRouter()
    assert fresh.route(req("b", [5]), loads(2, 1, 1)) == 1


def test_tree_updated_after_routing() -> None:
    r = CacheAwareRouter()
    first = r.route(req("a", [1, 2, 3]), loads(0, 0))
    assert first == 0 and r.tree_blocks(0) == 3 and r.tree_blocks(1) == 0
    assert r.matched_blocks(0, [1, 2, 3, 4]) == 3
    # An unrelated prompt goes to the now smaller tree, and is inserted there.
    assert r.route(req("b", [7, 8]), loads(0, 0)) == 1
    assert r.tree_blocks(1) == 2 and r.matched_blocks(1, [7, 8]) == 2
    # A GRPO sibling (same prompt) follows its prefix; the tree grows by its new block only.
    assert r.route(req("c", [1, 2, 3, 4]), loads(1, 1)) == 0
    assert r.tree_blocks(0) == 4
    # Routing under imbalance also records the prefix on the chosen replica.
    assert r.route(req("d", [1, 2, 3, 4]), loads(40, 5)) == 1
    assert r.matched_blocks(1, [1, 2, 3, 4]) == 4


def test_lru_eviction_keeps_tree_bounded_and_drops_tails_first() -> None:
    r = CacheAwareRouter(max_tree_blocks=3)
    r.on_routed(req("a", [1, 2, 3]), 0)  # LRU order, oldest first: 3, 2, 1 (leaf first, root last)
    r.on_routed(req("b", [1, 5, 6]), 0)  # 3, 2, 6, 5, 1: evicts 3 then 2, keeps the shared root 1
    assert r.tree_blocks(0) == 3
    assert r.matched_blocks(0, [1, 5, 6]) == 3
    assert r.matched_blocks(0, [1, 2, 3]) == 1


def test_zero_token_request_matches_nothing() -> None:
    r = CacheAwareRouter()
    r.on_routed(req("s", [1]), 1)
    assert r.route(RouteRequest("z", [], 0, BS), loads(0, 0)) == 0


def test_round_robin_cycles() -> None:
    r = RoundRobinRouter()
    reps = loads(9, 0, 5)
    assert [r.route(req(str(i), [i]), reps) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    # It cycles over the replicas it is offered, returning their indices.
    subset = [ReplicaLoad(4, 0), ReplicaLoad(7, 0)]
    assert {r.route(req("x", [1]), subset), r.route(req("y", [1]), subset)} == {4, 7}


def test_least_loaded_ties_to_lowest_index() -> None:
    r = LeastLoadedRouter()
    assert r.route(req("a", [1]), loads(3, 1, 1, 2)) == 1
    assert r.route(req("b", [1]), [ReplicaLoad(5, 0), ReplicaLoad(2, 0), ReplicaLoad(3, 4)]) == 2
    assert r.route(req("c", [1]), loads(4, 4)) == 0


@pytest.mark.parametrize("router", [RoundRobinRouter(), LeastLoadedRouter(), CacheAwareRouter()])
def test_no_replicas_is_an_error(router) -> None:
    with pytest.raises(ValueError, match="no replica"):
        router.route(req("a", [1]), [])


def test_make_router_by_name() -> None:
    assert isinstance(make_router("round-robin"), RoundRobinRouter)
    assert isinstance(make_router("least-loaded"), LeastLoadedRouter)
    ca = make_router("cache-aware", balance_abs_threshold=16)
    assert isinstance(ca, CacheAwareRouter) and ca.balance_abs_threshold == 16
    assert (ca.cache_threshold, ca.balance_rel_threshold) == (0.5, 1.0001)


def test_unknown_router_lists_known() -> None:
    known = r"cache-aware, fewest-sessions, kv-aware, kvpilot, least-loaded, round-robin, session-affinity"
    with pytest.raises(ValueError, match=rf"unknown router 'llm-d'; known routers: {known}"):
        make_router("llm-d")
