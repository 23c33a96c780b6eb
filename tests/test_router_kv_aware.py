"""KV-aware router (after llm-d's precise prefix-cache scorer): cases worked by hand, and vLLM's own hashes."""

from __future__ import annotations

import pytest

from simulator import fake_runner
from simulator.engine import vllm_block_hashes
from simulator.routers import KVAwareRouter, ReplicaLoad, RouteRequest, make_router

BS = 16


def req(rid: str, hashes: list[int]) -> RouteRequest:
    return RouteRequest(rid, hashes, len(hashes) * BS, BS)


def loads(*values: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, v) for i, v in enumerate(values)]


def test_resident_prefix_wins_when_loads_are_equal() -> None:
    r = KVAwareRouter()
    r.on_kv_event(1, "stored", [1, 2, 3])
    # Replica 1: 3 of 4 blocks as a leading run -> 2 * 0.75 + 1 * (1 - 5/5) = 1.5; replica 0: 0 + 0 = 0.
    assert r.matched_blocks(1, [1, 2, 3, 4]) == 3
    assert r.scores(req("a", [1, 2, 3, 4]), loads(5, 5)) == {0: 0.0, 1: 1.5}
    assert r.route(req("a", [1, 2, 3, 4]), loads(5, 5)) == 1
    # Only a leading run counts: block 1 missing on replica 0 stops its match at 1 block.
    r.on_kv_event(0, "stored", [1, 3, 4])
    assert r.matched_blocks(0, [1, 2, 3, 4]) == 1
    assert r.route(req("b", [1, 2, 3, 4]), loads(5, 5)) == 1


def test_load_dominates_when_prefix_match_is_small() -> None:
    r = KVAwareRouter()
    r.on_kv_event(0, "stored", [1])
    chain = [1, 2, 3, 4, 5, 6, 7, 8]
    # Replica 0: 2 * 1/8 + 1 * (1 - 10/10) = 0.25; replica 1: 0 + 1 * (1 - 2/10) = 0.8.
    s = r.scores(req("a", chain), loads(10, 2))
    assert s[0] == pytest.approx(0.25) and s[1] == pytest.approx(0.8)
    assert r.route(req("a", chain), loads(10, 2)) == 1
    # A long match outweighs the same load gap: 2 * 6/8 + 0 = 1.5 > 0.8.
    r.on_kv_event(0, "stored", [2, 3, 4, 5, 6])
    assert r.route(req("b", chain), loads(10, 2)) == 0


def test_weights_are_options() -> None:
    r = KVAwareRouter(prefix_weight=0.5, load_weight=1.0)
    r.on_kv_event(0, "stored", [1, 2])
    # Replica 0: 0.5 * 1 + (1 - 4/4) = 0.5; replica 1: 0 + (1 - 2/4) = 0.5 -> tie to the lower load.
    assert r.route(req("a", [1, 2]), loads(4, 2)) == 1
    assert KVAwareRouter(prefix_weight=0.0).route(req("b", [1, 2]), loads(4, 2)) == 1
    pure_prefix = KVAwareRouter(load_weight=0.0)
    pure_prefix.on_kv_event(0, "stored", [1, 2])
    assert pure_prefix.route(req("c", [1, 2]), loads(100, 0)) == 0


def test_removed_events_lose_the_advantage() -> None:
    r = KVAwareRouter()
    r.on_kv_event(0, "stored", [1, 2, 3])
    assert r.route(req("a", [1, 2, 3]), loads(3, 3)) == 0
    # Evicting the head block breaks the leading run entirely, though blocks 2 and 3 stay resident.
    r.on_kv_event(0, "removed", [1])
    assert r.resident_blocks(0) == 2 and r.matched_blocks(0, [1, 2, 3]) == 0
    assert r.route(req("b", [1, 2, 3]), loads(3, 2)) == 1
    # Removing hashes a replica does not hold (or a replica never seen) is harmless.
    r.on_kv_event(0, "removed", [99])
    r.on_kv_event(7, "removed", [1])
    assert r.resident_blocks(0) == 2 and r.resident_blocks(7) == 0


def test_cleared_empties_only_that_replica() -> None:
    r = KVAwareRouter()
    r.on_kv_event(0, "stored", [1, 2])
    r.on_kv_event(1, "stored", [1])
    assert r.route(req("a", [1, 2]), loads(0, 0)) == 0
    r.on_kv_event(0, "cleared", [])
    assert r.resident_blocks(0) == 0 and r.resident_blocks(1) == 1
    assert r.route(req("b", [1, 2]), loads(0, 0)) == 1
    # Blocks stored after a clear count again.
    r.on_kv_event(0, "stored", [1, 2])
    assert r.matched_blocks(0, [1, 2]) == 2


def test_index_is_built_only_from_events() -> None:
    r = KVAwareRouter()
    assert r.route(req("a", [1, 2, 3]), loads(0, 0)) == 0
    r.on_routed(req("b", [1, 2, 3]), 1)
    # Neither routing nor an explicit on_routed stores anything.
    assert r.resident_blocks(0) == 0 and r.resident_blocks(1) == 0
    # With nothing resident, the least-loaded replica wins (ties to the lower index).
    assert r.route(req("c", [1, 2, 3]), loads(2, 1, 1)) == 1
    assert r.route(req("d", [1, 2, 3]), loads(0, 0, 0)) == 0


def test_repeated_stores_are_idempotent() -> None:
    r = KVAwareRouter()
    r.on_kv_event(0, "stored", [5, 6])
    r.on_kv_event(0, "stored", [5])  # vLLM re-announces reused blocks
    assert r.resident_blocks(0) == 2
    r.on_kv_event(0, "removed", [5])
    assert not r.is_resident(0, 5) and r.is_resident(0, 6)


def test_unknown_event_kind_is_an_error() -> None:
    r = KVAwareRouter()
    with pytest.raises(ValueError, match=r"unknown KV event kind 'evicted'; expected one of stored, removed, cleared"):
        r.on_kv_event(0, "evicted", [1])


def test_ties_go_to_lower_load_then_lower_index() -> None:
    r = KVAwareRouter()
    r.on_kv_event(0, "stored", [1])
    r.on_kv_event(2, "stored", [1])
    # Replicas 0 and 2 tie on prefix and on load (score 2 * 1 + 1 - 3/3 = 2 each); index breaks it.
    reps = [ReplicaLoad(2, 3), ReplicaLoad(0, 3), ReplicaLoad(1, 3)]
    assert r.route(req("a", [1]), reps) == 0
    # All zero loads: every load score is 1.0.
    assert r.load_scores(loads(0, 0)) == {0: 1.0, 1: 1.0}


def test_empty_chain_matches_nothing() -> None:
    r = KVAwareRouter()
    r.on_kv_event(1, "stored", [1])
    assert r.prefix_scores(req("z", []), loads(0, 0)) == {0: 0.0, 1: 0.0}
    assert r.route(req("z", []), loads(0, 0)) == 0


def test_llm_d_min_max_normalisation() -> None:
    r = KVAwareRouter(prefix_score="min-max", load_score="min-max")
    r.on_kv_event(0, "stored", [1, 2, 3])
    r.on_kv_event(1, "stored", [1])
    chain = [1, 2, 3, 4]
    # Hits 3, 1, 0: min-max over the replicas with a hit -> 1.0, 0.0; no hit -> 0.0.
    assert r.prefix_scores(req("a", chain), loads(0, 0, 0)) == {0: 1.0, 1: 0.0, 2: 0.0}
    # One replica with a hit, or equal hits, scores 1.0 (llm-d's min == max case).
    assert r.prefix_scores(req("b", [1]), loads(0, 0, 0)) == {0: 1.0, 1: 1.0, 2: 0.0}
    # Queue-scorer: (max - q) / (max - min), 1.0 when all equal.
    assert r.load_scores(loads(2, 6, 4)) == {0: 1.0, 1: 0.0, 2: 0.5}
    assert r.load_scores(loads(3, 3)) == {0: 1.0, 1: 1.0}
    # Replica 0: 2 * 1 + 0 = 2; replica 2: 0 + 1 = 1 -> 0.
    assert r.route(req("c", chain), loads(6, 6, 2)) == 0


def test_bad_options_are_errors() -> None:
    with pytest.raises(ValueError, match="prefix_score"):
        KVAwareRouter(prefix_score="tokens")
    with pytest.raises(ValueError, match="load_score"):
        KVAwareRouter(load_score="queue")
    with pytest.raises(ValueError, match="finite and >= 0"):
        KVAwareRouter(prefix_weight=-1)
    with pytest.raises(ValueError, match="no replica"):
        KVAwareRouter().route(req("a", [1]), [])


def test_make_router_kv_aware() -> None:
    r = make_router("kv-aware")
    assert isinstance(r, KVAwareRouter)
    assert (r.prefix_weight, r.load_weight, r.prefix_score, r.load_score) == (2.0, 1.0, "fraction", "max")
    assert make_router("kv-aware", prefix_weight=3.0).prefix_weight == 3.0


def test_import_does_not_load_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, simulator.routers; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.vllm
def test_helper_matches_vllm_block_stored_events(vllm_engine) -> None:
    """The helper's hashes equal those in the BlockStored events of vLLM's real scheduler, and route to it."""
    from serving_hook.events import hashes_to_int64, kv_event_rows

    eng = vllm_engine
    sched = eng.make_scheduler(num_blocks=64)
    # Enable events as serving_hook does: the pool emits them, and take_events is wrapped to see them.
    sched.kv_cache_manager.block_pool.enable_kv_cache_events = True
    rows: list[dict] = []
    orig_take = sched.kv_cache_manager.take_events

    def take_events():
        events = orig_take()
        rows.extend(kv_event_rows(events, time_s=0.0, replica=0, engine_step=0))
        return events

    sched.kv_cache_manager.take_events = take_events

    prompt = fake_runner.prompt_tokens("kv-aware", 5 * BS + 7)  # 5 full blocks and a partial one
    request = eng.make_request("r0", prompt, max_tokens=12)  # prompt + output - 1 = 98 tokens: 6 full blocks
    sched.add_request(request)
    runner = fake_runner.FakeRunner()
    for _ in range(50):
        if request.is_finished():
            break
        runner.step(sched)
    assert request.is_finished()

    stored = [h for row in rows if row["event"] == "stored" for h in row["block_hashes"]]
    assert len(stored) == 6
    all_tokens = list(request.all_token_ids)
    assert vllm_block_hashes(all_tokens[:98], BS) == stored
    prompt_hashes = vllm_block_hashes(prompt, BS)
    assert prompt_hashes == stored[:5] == hashes_to_int64(request.block_hashes[:5])

    # The events feed the router: replica 0 holds the prompt's prefix, replica 1 nothing.
    router = KVAwareRouter()
    for row in rows:
        router.on_kv_event(row["replica"], row["event"], row["block_hashes"])
    sibling = RouteRequest("r1", prompt_hashes, len(prompt), BS)
    assert router.matched_blocks(0, prompt_hashes) == 5
    assert router.route(sibling, loads(1, 1)) == 0
    # A different prompt shares no block.
    other = vllm_block_hashes(fake_runner.prompt_tokens("other", 3 * BS), BS)
    assert router.matched_blocks(0, other) == 0
    # A cache salt changes every hash (it is chained in through block 0).
    salted = vllm_block_hashes(prompt, BS, cache_salt="s")
    assert not set(salted) & set(prompt_hashes)


def _replay(rows: list[tuple[str, int, list[int]]]):
    """A trace-replay workload: (request id, arrival s, block hashes of a 64-token prompt in 32-token blocks)."""
    import pyarrow as pa

    from data.schemas import WORKLOAD

    cols: dict[str, list] = {f.name: [] for f in WORKLOAD.schema}
    for rid, arrival, hashes in rows:
        row = {
            "request_id": rid, "session_id": rid, "kind": "rollout", "step": 0, "prompt_id": rid, "group_id": rid,
            "group_size": 1,
            "sample_index": 0, "turn": 0, "domain": "math", "paradigm": "math_verifier", "prompt_tokens": 64,
            "output_tokens": 4, "max_tokens": 4, "finish_reason": "stop", "block_size": 32, "block_hashes": hashes,
            "tool": None, "tool_latency_s": None, "tool_tokens": None, "verify_latency_s": None,
            "scores_session_id": None, "arrival_s": float(arrival),
        }
        for k in cols:
            cols[k].append(row[k])
    return pa.table(cols, schema=WORKLOAD.schema)


@pytest.mark.vllm
@pytest.mark.parametrize("kv_event_log", [True, False])
def test_simulated_replicas_feed_their_kv_events_to_the_router(vllm_engine, kv_event_log: bool) -> None:
    """X and A arrive together (X -> replica 0, A -> replica 1 by load); B repeats A's prompt after both
    finished, with equal loads: only the replicas' KV events can tell the router that replica 1 holds it."""
    from simulator.simulation import Simulation

    wl = _replay([("X", 0, [1, 2]), ("A", 0, [3, 4]), ("B", 100, [3, 4])])
    router = KVAwareRouter()
    result = Simulation(wl, "vllm-default", replicas=2, router=router, kv_blocks=64, progress=False,
                        kv_event_log=kv_event_log).run()
    placed = dict(zip(result.requests.column("request_id").to_pylist(), result.requests.column("replica").to_pylist()))
    assert placed == {"X": 0, "A": 1, "B": 1}
    assert router.resident_blocks(0) >= 4 and router.resident_blocks(1) >= 4  # prompts' blocks (and outputs')
    # the router's index is in vLLM's hash space: B's prompt (4 blocks of 16, as the hook logs them) is resident
    # on replica 1 only
    b = result.requests.column("request_id").to_pylist().index("B")
    b_hashes = result.requests.column("block_hashes")[b].as_py()
    assert len(b_hashes) == 4
    assert router.matched_blocks(1, b_hashes) == 4 and router.matched_blocks(0, b_hashes) == 0
