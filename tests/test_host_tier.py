"""kvpilot's host-tier CachePolicy (serving_hook.host_tier) inside vLLM's real CPU offloading manager.

* unbound, it evicts exactly as vLLM's LRU does;
* bound, the policy's owner order decides which chunks leave first (deepest first), unlisted ones keep LRU
  order, and a store whose owner comes first is skipped with nothing changed;
* on the real scheduler and OffloadingConnector, a paused session's context survives a filler's stores when the
  policy skips them, and returns from the tier, where vLLM's LRU lets the filler push it out;
* ``oracle-offload`` (Belady on both tiers) runs a whole simulation through the seam.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from policy.interface import EvictionDecision, OwnerState, Policy
from simulator import fake_runner
from tests.hooks import hook_scheduler

pytestmark = pytest.mark.vllm


def _ctx(rid: str, keys=(), start: int = 0):
    from vllm.v1.kv_offload.base import ReqContext

    c = ReqContext(req_id=rid)
    for i, k in enumerate(keys):
        c.set_offload_key_position(k, (start + i + 1) * 16)
    return c


class FakeLever:
    """The lever's two calls, with a fixed owner order."""

    def __init__(self, order):
        self.fixed = order
        self.stats = SimpleNamespace(host_bypassed=0, host_evicted_listed=0, side_time_s=0.0)
        self.guard = SimpleNamespace(inner_s=0.0)  # the hook's time inside schedule(): evict adds its own

    def owner_of(self, rid: str) -> str:
        return rid.split("/")[0]  # "session/turn"

    used = owner_of

    def order(self, cp, n, storer):
        return self.fixed


def _fill(cp, stores):
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    cid = 0
    for rid, keys in stores:
        ctx = _ctx(rid, keys)
        cp.on_store_miss(keys, ctx)
        for k in keys:
            ch = ChunkStatus(cid)
            ch.ref_cnt = 0
            cid += 1
            cp.insert(k, ch, ctx)
        cp.on_request_finished((tuple(keys),), set(keys), set(), ctx)


def _keys(tag: str, n: int):
    return [f"{tag}{i}".encode() for i in range(n)]


def test_unbound_policy_evicts_as_vllms_lru():
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

    from serving_hook.host_tier import KVPilotCachePolicy

    stores = [("a/0", _keys("a", 3)), ("b/0", _keys("b", 2)), ("c/0", _keys("c", 3))]
    ours, lru = KVPilotCachePolicy(8), LRUCachePolicy(8)
    _fill(ours, stores)
    _fill(lru, stores)
    got = ours.evict(4, {b"c0"})
    want = lru.evict(4, {b"c0"})
    assert [k for k, _ in got] == [k for k, _ in want]
    assert ours.owned == {} and ours.owner == {}  # nothing is tracked without a lever


def test_policy_order_decides_and_a_store_listed_first_is_skipped():
    from serving_hook.host_tier import KVPilotCachePolicy

    cp = KVPilotCachePolicy(8)
    cp.kvpilot_lever = lever = FakeLever(["b"])
    _fill(cp, [("a/0", _keys("a", 3)), ("b/0", _keys("b", 2)), ("c/0", _keys("c", 3))])
    assert cp.owned["b"] == dict.fromkeys(_keys("b", 2))
    # b listed: its chunks go first, deepest first; the third comes from LRU (a's, the oldest), not from c
    got = [k for k, _ in cp.evict(3, set())]
    assert got == [b"b1", b"b0", b"a2"] or got == [b"b1", b"b0", b"a0"]
    assert "b" not in cp.owned and b"b0" not in cp.chunks and lever.stats.host_evicted_listed == 2
    assert lever.guard.inner_s > 0.0  # the ordered eviction is the hook's time inside schedule()
    # the storer ("c", set by on_store_miss) listed before enough room is found: skipped, nothing changed
    cp.kvpilot_lever = FakeLever(["c", "a"])
    cp.kvpilot_lever.stats = lever.stats
    cp.on_store_miss([b"c9"], _ctx("c/1"))
    before = (dict(cp.chunks), {o: dict(k) for o, k in cp.owned.items()})
    assert cp.evict(2, set()) is None
    assert (dict(cp.chunks), {o: dict(k) for o, k in cp.owned.items()}) == before
    assert lever.stats.host_bypassed == 1
    # a later request that reuses a's chunks takes them over (its session's next use is what counts)
    ctx = _ctx("d/0", [b"a0"])
    cp.on_request_finished(((b"a0",),), set(), {b"a0"}, ctx)
    assert cp.owner[b"a0"] == "d" and b"a0" not in cp.owned.get("a", {})


def test_only_the_warning_right_after_a_skipped_store_is_dropped():
    """vLLM warns of every store a full tier refuses; kvpilot's filter drops the one after a store it skipped. A
    skip whose warning never came (the connector's level off) must not hide the next real refusal."""
    import logging

    from serving_hook.host_tier import _FILTER, KVPilotCachePolicy, _BypassLogFilter

    def warning() -> logging.LogRecord:
        return logging.LogRecord("vllm", logging.WARNING, __file__, 1, "Request %s: cannot store chunks", ("x",), None)

    cp = KVPilotCachePolicy(4)
    cp.kvpilot_lever = FakeLever(["c"])
    _fill(cp, [("a/0", _keys("a", 2)), ("c/0", _keys("c", 2))])
    cp.on_store_miss([b"c9"], _ctx("c/1"))
    try:
        assert cp.evict(1, set()) is None  # the storer first: skipped
        assert not _FILTER.filter(warning())  # its warning: dropped
        assert cp.evict(1, set()) is None and _BypassLogFilter.pending == 1  # skipped again; no warning this time
        cp.kvpilot_lever = FakeLever([])
        assert cp.evict(1, set(cp.chunks)) is None  # every chunk protected: vLLM's own refusal
        assert _FILTER.filter(warning())  # shown
    finally:
        _BypassLogFilter.pending = 0


def test_chunks_that_lru_evicts_leave_their_owners():
    """Where the policy gives no order (or an order that falls short, or one that raises), vLLM's LRU evicts; the
    chunks it takes leave their owners too, so an owner's tier blocks (``CachedPrefix.tier_blocks``) stay true."""
    from serving_hook.host_tier import KVPilotCachePolicy

    stores = [("a/0", _keys("a", 3)), ("b/0", _keys("b", 2)), ("c/0", _keys("c", 3))]
    for order in (None, ["b"], [["a"]]):
        cp = KVPilotCachePolicy(8)
        cp.kvpilot_lever = lever = FakeLever(order)
        lever.guard.internal_error = lambda where, e: None
        _fill(cp, stores)
        gone = {k for k, _ in cp.evict(4, set())}
        assert len(gone) == 4
        assert not gone & set(cp.owner), order
        assert {k for keys in cp.owned.values() for k in keys} == set(cp.chunks) == set(cp.owner), order


def test_a_bad_order_never_reaches_vllms_store_planning():
    """An owner listed twice is evicted once; an order with an id that cannot be looked up falls back to LRU for
    that eviction (counted as the hook's error), where it would raise inside vLLM's ``schedule()``."""
    from serving_hook.host_tier import KVPilotCachePolicy

    stores = [("a/0", _keys("a", 3)), ("b/0", _keys("b", 2)), ("c/0", _keys("c", 3))]
    cp = KVPilotCachePolicy(8)
    cp.kvpilot_lever = FakeLever(["b", "b"])
    _fill(cp, stores)
    got = [k for k, _ in cp.evict(3, set())]
    assert got[:2] == [b"b1", b"b0"] and len(set(got)) == 3 and got[2].startswith(b"a")
    errors: list = []
    bad, lru = KVPilotCachePolicy(8), KVPilotCachePolicy(8)  # lru: unbound, vLLM's own order
    bad.kvpilot_lever = FakeLever([["a"], "b"])
    bad.kvpilot_lever.guard.internal_error = lambda where, e: errors.append((where, type(e).__name__))
    _fill(bad, stores)
    _fill(lru, stores)
    assert [k for k, _ in bad.evict(4, {b"c0"})] == [k for k, _ in lru.evict(4, {b"c0"})]
    assert errors == [("evict_host", "TypeError")]
    assert set(bad.chunks) == set(lru.chunks)  # nothing evicted twice, nothing lost


class TierOrder(Policy):
    """Host tier: the storer's and finished owners first (their blocks are not worth keeping), paused last."""

    name = "test-tier-order"
    uses_host_eviction = True
    uses_offload = True

    def __init__(self) -> None:
        self.calls: list = []

    def evict_host(self, prefixes, n, state):
        self.calls.append([(p.prefix_id, p.owner_state, p.tier_blocks) for p in prefixes])
        rank = {OwnerState.FINISHED: 0, OwnerState.RUNNING: 0, OwnerState.PAUSED_TOOL: 1}
        return EvictionDecision(order=[p.prefix_id for p in sorted(prefixes, key=lambda p: rank[p.owner_state])])


def _paused_session(engine, policy, host_policy: bool, fillers_together: bool = False):
    """Turn 0 of session s0 (10 blocks) pauses; four fillers of 10 blocks take the GPU; turn 1 returns. Tier: 12.

    ``fillers_together``: the fillers arrive at once (admitted in one step), else one after another."""
    from simulator.cost_model import CostModel
    from simulator.offload import OffloadWorker
    from tests.test_paused_sessions import Clock, _step

    cls = hook_scheduler(policy, kv_block_bytes=1_000_000, host_link_gbps=1.0)
    cfg = engine.make_vllm_config(num_blocks=40, offload_blocks=12, host_policy=host_policy)
    s = engine.make_scheduler(cls, num_blocks=40, vllm_config=cfg)
    if hasattr(policy, "sched"):  # a policy that reads the scheduler (RunningCheck)
        policy.sched = s
    clock = s.kvpilot_clock = Clock()
    cost = CostModel.preset("H200-7B")
    worker = OffloadWorker(cost, cost.kv_block_bytes(16))
    meta = {"kvpilot_session_id": "s0", "kvpilot_turn": 0, "kvpilot_tool": "bash"}
    prompt = fake_runner.prompt_tokens("ctx", 160)

    def drain():
        while s.has_requests() or worker.busy:
            _step(engine, s, worker, clock)

    s.add_request(engine.make_request("t0", prompt, 4, arrival_time=0.0, extra_args=meta))
    drain()
    for i in range(4):  # one after another: each store fits the tier, together they take the whole GPU
        s.add_request(engine.make_request(f"fill{i}", fake_runner.prompt_tokens(f"fill{i}", 160), 4,
                                          arrival_time=clock.t))
        if not fillers_together:
            drain()
    drain()
    turn2 = prompt + fake_runner.output_tokens("t0", 3) + fake_runner.prompt_tokens("tool", 30)
    s.add_request(engine.make_request("t1", turn2, 4, arrival_time=clock.t,
                                      extra_args={**meta, "kvpilot_turn": 1, "kvpilot_tool": None}))
    loaded0 = worker.load_blocks
    drain()
    return worker.load_blocks - loaded0, s


def test_tier_keeps_the_paused_session_that_lru_pushes_out(vllm_engine):
    from serving_hook.host_tier import KVPilotCachePolicy, find_cache_policy

    policy = TierOrder()
    loaded, s = _paused_session(vllm_engine, policy, host_policy=True)
    assert isinstance(find_cache_policy(s), KVPilotCachePolicy) and s._kvp_host is not None
    assert loaded >= 9  # turn 0's context came back from host memory
    st = s.kvpilot_stats
    assert st.host_evict_calls >= 1 and st.host_bypassed >= 1  # the filler's stores were skipped
    assert any(("s0", OwnerState.PAUSED_TOOL, 10) in c for c in policy.calls)
    # vLLM's LRU (the same policy, but the tier runs vLLM's own cache policy): the filler pushed s0 out
    lru_loaded, s2 = _paused_session(vllm_engine, TierOrder(), host_policy=False)
    assert find_cache_policy(s2) is None and s2._kvp_host is None
    assert lru_loaded <= 2


@pytest.mark.slow
def test_owners_with_nothing_in_the_tier_and_no_request_are_forgotten(vllm_engine, monkeypatch):
    """Past ``MAX_OWNERS`` the lever forgets the owners with nothing in the tier and no live request (one entry per
    owner that ever used the tier would grow without bound); here at every order, with the same decisions."""
    from serving_hook import host_tier

    loaded, s = _paused_session(vllm_engine, TierOrder(), host_policy=True)
    monkeypatch.setattr(host_tier, "MAX_OWNERS", 0)
    policy = TierOrder()
    loaded2, s2 = _paused_session(vllm_engine, policy, host_policy=True)
    assert loaded2 == loaded and s2.kvpilot_stats.host_bypassed == s.kvpilot_stats.host_bypassed
    kept, every = set(s2._kvp_host.metas), set(s._kvp_host.metas)
    assert "s0" in kept and set(s2._kvp_host.last_used) <= kept
    assert kept < every  # without the bound, every finished filler stays


def test_oracle_offload_runs_both_tiers_in_a_simulation(vllm_engine):
    import dataclasses

    from data.synth import SynthConfig, generate
    from simulator.simulation import run_simulation

    w = generate(dataclasses.replace(SynthConfig.preset("agentic"), steps=1, prompts_per_step=2))
    kw = dict(kv_fraction=0.15, progress=False, decode_stride=32, decision_log=False, kv_event_log=False,
              offload_gib=2.0)
    orc = run_simulation(w, "oracle-offload", **kw).summary
    lru = run_simulation(w, "vllm-offload", **kw).summary
    assert orc.offload.offload_host_evict_calls > 0 and lru.offload.offload_host_evict_calls == 0
    # Belady keeps what returns: more of what the tier stores comes back, and less is written to it
    assert orc.offload.offload_loaded_blocks / orc.offload.offload_stored_blocks > \
        lru.offload.offload_loaded_blocks / lru.offload.offload_stored_blocks
    assert orc.bound.makespan_over_bound >= 1.0


def test_a_session_whose_next_turn_is_queued_is_a_waiting_owner_at_its_queue_position():
    """The tier's candidates say where each owner's session is: running, queued (and where in the queue the
    policy put it), paused on a tool, or done; a queued owner keeps its last tier user's meta."""
    from policy.interface import RequestMeta
    from serving_hook.host_tier import HostTierLever, KVPilotCachePolicy

    metas = {f"{s}-t{t}": RequestMeta(session_id=s, turn=t, tool="bash") for s in "abcd" for t in (0, 1)}
    req = {rid: SimpleNamespace(request_id=rid) for rid in metas}
    sched = SimpleNamespace(running=[req["a-t1"]], waiting=[req["d-t0"], req["b-t1"]], kvpilot_clock=lambda: 5.0)
    tr = SimpleNamespace(infos={rid: SimpleNamespace(meta=m, running=rid == "a-t1") for rid, m in metas.items()},
                         sessions={"c": 0}, session_request={"a": "a-t1", "b": "b-t1", "d": "d-t0"},
                         running_owners=lambda: {"a": metas["a-t1"]})
    guard = SimpleNamespace(stats=SimpleNamespace(side_time_s=0.0), step_no=0)
    lever = HostTierLever(sched, None, guard, tr, None)
    cp = KVPilotCachePolicy(16)
    cp.kvpilot_lever = lever
    _fill(cp, [("a-t0", _keys("a", 2)), ("b-t0", _keys("b", 3)), ("c-t0", _keys("c", 2))])
    got = {p.prefix_id: p for p in lever._prefixes(cp, None)}
    assert got["a"].owner_state is OwnerState.RUNNING and got["a"].meta.turn == 1
    assert got["b"].owner_state is OwnerState.WAITING and got["b"].queue_position == 1
    assert got["b"].meta.turn == 0 and got["b"].tier_blocks == 3  # the meta of b's turn that stored
    assert got["c"].owner_state is OwnerState.PAUSED_TOOL and got["c"].queue_position is None
    assert "d" not in got  # nothing of d in the tier, and it does not run
    # unchanged owners keep their candidate objects from call to call; a changed one gets a new, right one
    again = {p.prefix_id: p for p in lever._prefixes(cp, None)}
    assert all(again[k] is got[k] for k in "abc")
    sched.waiting[:] = [req["b-t1"], req["d-t0"], req["c-t1"]]  # b moves to the head; c's tool returned
    tr.sessions.clear()
    tr.session_request["c"] = "c-t1"
    moved = {p.prefix_id: p for p in lever._prefixes(cp, None)}
    assert moved["a"] is got["a"]
    assert moved["b"].owner_state is OwnerState.WAITING and moved["b"].queue_position == 0
    assert moved["c"].owner_state is OwnerState.WAITING and moved["c"].queue_position == 2
    assert moved["c"].meta.turn == 0  # still the meta of the turn that stored


class ByKey(Policy):
    """Orders owners by a key of each alone (a sort, as the learned policy's and the oracle's orders are); records
    each call's candidates."""

    name = "test-by-key"
    uses_host_eviction = True

    def __init__(self) -> None:
        self.calls: list = []

    def evict_host(self, prefixes, n, state):
        self.calls.append({p.prefix_id: p for p in prefixes})
        return EvictionDecision(order=[p.prefix_id for p in sorted(prefixes, key=lambda p: (p.last_used_s,
                                                                                          p.prefix_id))])


def test_the_steps_order_ranks_a_later_running_storer_as_it_stood_at_the_steps_first_eviction():
    """One order per step, as over the tier's owners and every running session at the step's first eviction: it
    ranks the tier's owners and the storer, a later running storer joins as it stood then (its last use as the
    step's order saw it), a third brings every running session in; a finished storer gets a fresh order; after a
    step with three storers or more every running session is ranked at once."""
    from policy.interface import RequestMeta
    from serving_hook.host_tier import HostTierLever, KVPilotCachePolicy

    metas = {f"{s}-t0": RequestMeta(session_id=s, turn=0, tool="bash") for s in "abcdf"}
    req = {rid: SimpleNamespace(request_id=rid) for rid in metas}
    now = [1.0]
    sched = SimpleNamespace(running=[req["a-t0"], req["c-t0"], req["d-t0"]], waiting=[], kvpilot_clock=lambda: now[0])
    tr = SimpleNamespace(infos={rid: SimpleNamespace(meta=m, running=rid[0] in "acd") for rid, m in metas.items()},
                         sessions={}, session_request={s: f"{s}-t0" for s in "abcdf"},
                         running_owners=lambda: {s: metas[f"{s}-t0"] for s in "acd"},
                         state=lambda t: SimpleNamespace(time_s=t))
    guard = SimpleNamespace(stats=SimpleNamespace(host_evict_calls=0, host_evicted_listed=0, host_bypassed=0,
                                                  side_time_s=0.0),
                            step_no=1, inner_s=0.0,
                            decide=lambda what, fn, kind, *a: fn(*a))
    policy = ByKey()
    lever = HostTierLever(sched, policy, guard, tr, None)
    cp = KVPilotCachePolicy(16)
    cp.kvpilot_lever = lever
    lever.used("b-t0")  # b finished earlier, its blocks in the tier
    _fill(cp, [("b-t0", [b"b0", b"b1"])])
    lever.last_used.update(b=0.5, c=0.2, d=0.1)
    now[0] = 2.0
    cp.on_store_miss([b"a0"], _ctx("a-t0"))  # step 1's first eviction: a stores
    assert cp.evict(1, set()) is not None
    assert set(policy.calls[-1]) == {"a", "b"}  # the tier's owner and the storer; c and d store nothing yet
    first = policy.calls[-1]
    cp.on_store_miss([b"c0"], _ctx("c-t0"))  # c stores next, in the same step: its last use becomes now
    assert lever.last_used["c"] == 2.0
    cp.evict(1, set())
    late = policy.calls[-1]
    assert set(late) == {"a", "b", "c"} and all(late[k] is first[k] for k in "ab")
    assert late["c"].last_used_s == 0.2  # as the step's first order saw it
    assert lever.order(cp, 1, "c") == lever.order(cp, 1, "a") and len(policy.calls) == 2  # ranked: no new call
    lever.metas["f"] = metas["f-t0"]
    lever.last_used["f"] = 1.5
    lever.order(cp, 1, "f")  # a finished storer: a fresh order, with the last uses as they are now
    assert set(policy.calls[-1]) == {"b", "f"}
    cp.on_store_miss([b"d0"], _ctx("d-t0"))  # the step's second late running storer: every running session joins
    lever.order(cp, 1, "d")
    assert set(policy.calls[-1]) == {"a", "b", "c", "d", "f"}
    assert policy.calls[-1]["d"].last_used_s == 0.1 and policy.calls[-1]["c"].last_used_s == 2.0
    assert len(policy.calls) == 4
    guard.step_no = 2  # step 1 had four storers: every running session at the first eviction
    lever.order(cp, 1, "d")
    assert set(policy.calls[-1]) == {"a", "b", "c", "d"} and policy.calls[-1]["d"].last_used_s == 2.0
    guard.step_no = 3  # step 2 had one: the tier's owners and the storer
    lever.order(cp, 1, "a")
    assert set(policy.calls[-1]) == {"a", "b"} and len(policy.calls) == 6


def test_the_hooks_time_outside_its_schedule_is_counted(vllm_engine):
    """``HookStats.side_time_s`` counts the hook's time elsewhere on the engine thread (arrivals, events, finishes,
    frees, the tier's bookkeeping), so that the benchmarks report all of kvpilot's time; a passthrough hook counts
    none."""
    from policy.vllm_default import VllmDefaultPolicy

    _, s = _paused_session(vllm_engine, TierOrder(), host_policy=True)
    st = s.kvpilot_stats
    assert st.side_time_s > 0.0 and st.hook_time_s > 0.0
    before = st.side_time_s
    s.add_request(vllm_engine.make_request("late", fake_runner.prompt_tokens("late", 32), 2, arrival_time=0.0))
    assert st.side_time_s > before  # an arrival alone
    before = st.side_time_s
    cp = find_tier(s)
    cp.on_store_miss([b"x"], _ctx("late"))
    assert st.side_time_s > before  # the tier's bookkeeping of a store miss
    p = vllm_engine.make_scheduler(hook_scheduler(VllmDefaultPolicy()), num_blocks=40)
    p.add_request(vllm_engine.make_request("r", fake_runner.prompt_tokens("r", 32), 2, arrival_time=0.0))
    while p.has_requests():
        out = p.schedule()
        p.update_from_output(out, fake_runner.FakeRunner().model_output(p, out))
    assert p._kvp_passthrough and p.kvpilot_stats.side_time_s == 0.0


def find_tier(s):
    from serving_hook.host_tier import find_cache_policy

    return find_cache_policy(s)


class RunningCheck(TierOrder):
    """:class:`TierOrder` that, at each of the tier's eviction orders (inside vLLM's ``schedule()``), compares the
    hook's running owners with a pass over vLLM's ``running``."""

    def __init__(self) -> None:
        super().__init__()
        self.sched = None
        self.checked = self.unnoted = 0

    def evict_host(self, prefixes, n, state):
        s = self.sched
        tr = s._kvp_translate
        ref = {}
        for r in s.running:
            info = tr.infos.get(r.request_id)
            if info is not None:
                m = info.meta
                ref[m.session_id if m.session_id is not None else r.request_id] = m
        got = tr.running_owners()
        assert got.keys() == ref.keys() and all(got[k] is ref[k] for k in ref)
        self.checked += 1
        self.unnoted += got is not tr._running_owners  # admitted in this step, not noted yet
        return super().evict_host(prefixes, n, state)


def test_the_hooks_running_owners_are_a_pass_over_vllms_running(vllm_engine):
    """The tier's candidates read the running sessions from the hook's bookkeeping: at every eviction order of a
    run with stores, pauses, new turns and a same-step admission, the same mapping as a pass over vLLM's running
    list (the step's admissions included, which the hook notes only after the step)."""
    for together in (False, True):
        policy = RunningCheck()
        _paused_session(vllm_engine, policy, host_policy=True, fillers_together=together)
        assert policy.checked >= 10 and policy.unnoted >= 1
