"""Each lever changes vLLM's real scheduler the way the policy asks.

* admission: an order changes who runs first; a held request waits and comes back;
* preemption: the chosen victim is the one preempted (stock vLLM takes the tail);
* retention: a TTL-protected prompt survives pressure that LRU evicts, and is
  released when the TTL ends; a demoted prefix is evicted before older ones.
"""

from __future__ import annotations

import pytest

from policy.interface import (
    AdmissionDecision,
    Policy,
    PreemptionDecision,
    Retention,
    RetentionAction,
    RetentionDecision,
)
from simulator import fake_runner
from tests.hooks import hook_scheduler as _hook
from tests.hooks import stock_scheduler as _stock

pytestmark = pytest.mark.vllm


class FakeClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


# ------------------------------------------------------------------ admission
class ReversePolicy(Policy):
    name = "test-reverse"
    uses_admission = True

    def __init__(self, hold=()):
        self.hold = set(hold)
        self.seen = []

    def admit(self, waiting, state):
        self.seen.append([c.request_id for c in waiting])
        return AdmissionDecision(order=[c.request_id for c in reversed(waiting)], hold=self.hold)


def _admission_run(engine, cls, n=3):
    # max_num_seqs=1: exactly one request is admitted at a time.
    s = engine.make_scheduler(cls, num_blocks=64, max_num_seqs=1)
    for i in range(n):
        s.add_request(engine.make_request(f"r{i}", fake_runner.prompt_tokens(f"a{i}", 20), 3, arrival_time=float(i)))
    runner = fake_runner.FakeRunner()
    order = []
    for _ in range(40):
        out = runner.step(s)
        order.extend(d.req_id for d in out.scheduled_new_reqs)
        if not s.has_requests():
            break
    return order, s


def test_admission_order_changes_who_runs_first(vllm_engine):
    stock, _ = _admission_run(vllm_engine, _stock())
    assert stock == ["r0", "r1", "r2"]
    hooked, s = _admission_run(vllm_engine, _hook(ReversePolicy()))
    assert hooked[0] == "r2"
    assert sorted(hooked) == ["r0", "r1", "r2"]
    assert s.kvpilot_stats.admission_reorders > 0
    # candidates are presented in vLLM's order
    assert s.kvpilot_policy.seen[0] == ["r0", "r1", "r2"]


def test_reorder_puts_the_order_first_and_keeps_every_request_once():
    """The policy's order (unknown and repeated ids skipped), then the others in queue order; read by position
    when the ids are known, by request otherwise."""
    from types import SimpleNamespace

    from serving_hook.admission import _reordered

    reqs = [SimpleNamespace(request_id=f"r{i}") for i in range(6)]
    ids = tuple(r.request_id for r in reqs)
    for known in (ids, None):
        got = _reordered(["r4", "gone", "r1", "r4"], reqs, known)
        assert [r.request_id for r in got] == ["r4", "r1", "r0", "r2", "r3", "r5"]
        assert all(a is b for a, b in zip(got, [reqs[4], reqs[1], reqs[0]]))
    # an order longer than those placed by scans (a dict of the queue's positions instead): the same rule
    many = [SimpleNamespace(request_id=f"r{i}") for i in range(40)]
    order = [f"r{i}" for i in range(39, 0, -2)] + ["gone", "r39", "r2"]
    want = [f"r{i}" for i in range(39, 0, -2)] + ["r2"] + [f"r{i}" for i in range(0, 40, 2) if i != 2]
    for known in (tuple(r.request_id for r in many), None):
        assert [r.request_id for r in _reordered(order, many, known)] == want


def test_a_queue_shifted_by_its_head_and_arrivals_is_recognised() -> None:
    """``shifted``: how many left the head when the rest is unchanged and arrivals joined the end; -1 for any other
    change (a request gone from the middle, a new order, one put back in front), so the caller reads afresh."""
    from policy.common import shifted, to_front

    last = [object() for _ in range(6)]
    new = [object(), object()]
    assert shifted(last, last) == 0
    assert shifted(last, last[2:] + new) == 2
    assert shifted(last, last[6:] + new) == -1  # all left: nothing to keep
    assert shifted(last, last[:3] + last[4:]) == -1  # one left from the middle
    assert shifted(last, [last[3]] + last[:3] + last[4:]) == -1  # one moved to the front
    assert shifted(last, new + last) == -1  # put back in front (a preemption)
    assert shifted(last, last[2:], within=2) == -1  # more left than looked for
    assert shifted([], new) == shifted(last, []) == -1
    assert to_front(tuple("abcdef"), [4, 1]) == tuple("ebacdf")


def test_held_request_waits_and_comes_back(vllm_engine):
    engine = vllm_engine
    policy = ReversePolicy(hold={"r1"})
    s = engine.make_scheduler(_hook(policy), num_blocks=64, max_num_seqs=8)
    s.kvpilot_clock = lambda: 5.0  # within the starvation bound of every arrival
    for i in range(3):
        s.add_request(engine.make_request(f"r{i}", fake_runner.prompt_tokens(f"h{i}", 20), 4, arrival_time=float(i)))
    runner = fake_runner.FakeRunner()
    out = runner.step(s)
    # room for all three, but r1 is held back; the others run in the policy's order
    assert [d.req_id for d in out.scheduled_new_reqs] == ["r2", "r0"]
    assert [r.request_id for r in s.waiting] == ["r1"]
    policy.hold = set()
    out = runner.step(s)
    assert [d.req_id for d in out.scheduled_new_reqs] == ["r1"]
    assert s.kvpilot_stats.held == 1


def test_held_requests_keep_policy_order(vllm_engine):
    engine = vllm_engine
    policy = ReversePolicy(hold={"r0", "r2", "r3"})
    s = engine.make_scheduler(_hook(policy), num_blocks=64, max_num_seqs=8)
    s.kvpilot_clock = lambda: 5.0
    for i in range(4):
        s.add_request(engine.make_request(f"r{i}", fake_runner.prompt_tokens(f"k{i}", 20), 4, arrival_time=float(i)))
    out = fake_runner.FakeRunner().step(s)
    assert [d.req_id for d in out.scheduled_new_reqs] == ["r1"]
    assert [r.request_id for r in s.waiting] == ["r3", "r2", "r0"]


# ----------------------------------------------------------------- preemption
class VictimPolicy(Policy):
    name = "test-victim"
    uses_preemption = True

    def __init__(self, victim):
        self.victim = victim
        self.asked = []

    def preempt(self, running, state):
        ids = [c.request_id for c in running]
        self.asked.append(ids)
        return PreemptionDecision(victim=self.victim if self.victim in ids else None)


def _preemption_run(engine, cls):
    # 8 usable blocks; 4 requests of 31 prompt tokens take 2 blocks each. At the
    # second decode step every request needs a third block: r0 fails first.
    s = engine.make_scheduler(cls, num_blocks=9, max_num_seqs=8)
    for i in range(4):
        s.add_request(engine.make_request(f"r{i}", fake_runner.prompt_tokens(f"v{i}", 31), 8, arrival_time=float(i)))
    runner = fake_runner.FakeRunner()
    preempted = []
    for _ in range(6):
        out = runner.step(s)
        if out.preempted_req_ids:
            # vLLM's set is unordered; the hook's event order is in request.num_preemptions
            preempted.append(sorted(out.preempted_req_ids))
            break
    return preempted, s


def test_chosen_victim_is_preempted(vllm_engine):
    stock, _ = _preemption_run(vllm_engine, _stock())
    assert stock and "r3" in stock[0] and "r1" not in stock[0]  # vLLM preempts from the tail
    policy = VictimPolicy("r1")
    hooked, s = _preemption_run(vllm_engine, _hook(policy))
    assert hooked and "r1" in hooked[0]
    assert s.requests["r1"].num_preemptions == 1
    assert s.kvpilot_stats.policy_victims >= 1
    # asked first with every request not yet scheduled in the step, in running order
    assert policy.asked[0] == ["r0", "r1", "r2", "r3"]


# ------------------------------------------------------------------ retention
class RetainPolicy(Policy):
    """Protect (or demote) the prefixes of requests of one session."""

    name = "test-retain"
    uses_retention = True

    def __init__(self, session, action, ttl_s=None):
        self.session = session
        self.action = action
        self.ttl_s = ttl_s
        self.calls = []

    def retain(self, prefixes, state):
        self.calls.append([(p.prefix_id, p.owner_state.value, p.num_blocks) for p in prefixes])
        acts = {
            p.prefix_id: Retention(self.action, ttl_s=self.ttl_s)
            for p in prefixes
            if p.meta.session_id == self.session and p.protected_until_s is None
        }
        return RetentionDecision(actions=acts)


def _run_until_done(s, runner, limit=200):
    for _ in range(limit):
        runner.step(s)
        if not s.has_requests():
            return
    raise AssertionError("requests did not finish")


def _cached_tokens(engine, s, prompt):
    """Prefix-cache hit length for ``prompt`` right now (read-only lookup)."""
    probe = engine.make_request("probe", prompt, 1)
    return s.kv_cache_manager.get_computed_blocks(probe)[1]


def _retention_scenario(engine, cls, clock=None):
    """P (64-token prompt, a tool turn) finishes; then two 100-token fillers run one
    after the other in a 12-block cache, enough for LRU to evict all of P."""
    s = engine.make_scheduler(cls, num_blocks=13, max_num_seqs=4)
    if clock is not None:
        s.kvpilot_clock = clock
    runner = fake_runner.FakeRunner()
    p_prompt = fake_runner.prompt_tokens("agent-ctx", 64)
    s.add_request(
        engine.make_request(
            "P", p_prompt, 2, extra_args={"kvpilot_session_id": "agent", "kvpilot_turn": 0, "kvpilot_tool": "search"}
        )
    )
    _run_until_done(s, runner)
    assert _cached_tokens(engine, s, p_prompt + [5] * 10) == 64
    for i in range(2):
        s.add_request(engine.make_request(f"F{i}", fake_runner.prompt_tokens(f"filler{i}", 100), 2))
        _run_until_done(s, runner)
    return s, runner, p_prompt


def test_lru_evicts_unprotected_prompt(vllm_engine):
    s, _, p_prompt = _retention_scenario(vllm_engine, _stock())
    assert _cached_tokens(vllm_engine, s, p_prompt + [5] * 10) == 0


def test_ttl_protected_prompt_survives_pressure_then_expires(vllm_engine):
    engine = vllm_engine
    clock = FakeClock()
    policy = RetainPolicy("agent", RetentionAction.PROTECT, ttl_s=30.0)
    s, runner, p_prompt = _retention_scenario(engine, _hook(policy, max_pinned_fraction=0.5), clock)
    assert s.kvpilot_pinned_blocks == 4
    assert policy.calls and policy.calls[0][0] == ("P", "paused_tool", 4)
    # the protected prompt survived both fillers
    assert _cached_tokens(engine, s, p_prompt + [5] * 10) == 64
    # a returning turn hits it
    s.add_request(engine.make_request("P2", p_prompt + [7] * 10, 2))
    out = runner.step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 64
    _run_until_done(s, runner)
    # TTL ends: the pin is released at the next step, then LRU applies again
    clock.t += 31.0
    runner.step(s)
    assert s.kvpilot_pinned_blocks == 0
    assert s._kvp_retention.pins.num_released_expired == 1
    for i in range(2, 4):
        s.add_request(engine.make_request(f"F{i}", fake_runner.prompt_tokens(f"filler{i}", 100), 2))
        _run_until_done(s, runner)
    assert _cached_tokens(engine, s, p_prompt + [5] * 10) == 0


def test_pins_released_under_pressure_before_preemption(vllm_engine):
    """Pinned blocks are given back before vLLM would preempt a running request."""
    engine = vllm_engine
    clock = FakeClock()
    policy = RetainPolicy("agent", RetentionAction.PROTECT, ttl_s=1e6)
    s = engine.make_scheduler(_hook(policy, max_pinned_fraction=1.0), num_blocks=13, max_num_seqs=4)
    s.kvpilot_clock = clock
    runner = fake_runner.FakeRunner()
    s.add_request(
        engine.make_request("P", fake_runner.prompt_tokens("agent-ctx", 64), 2,
                            extra_args={"kvpilot_session_id": "agent"})
    )
    _run_until_done(s, runner)
    assert s.kvpilot_pinned_blocks == 4
    # one request that grows past the unpinned space: 100 prompt + 60 output = 10 blocks > 8 free
    s.add_request(engine.make_request("G", fake_runner.prompt_tokens("grow", 100), 60))
    _run_until_done(s, runner)
    assert s.requests.get("G") is None
    assert s.kvpilot_stats.preemptions == 0
    assert s._kvp_retention.pins.num_released_pressure == 1
    assert s.kvpilot_pinned_blocks == 0


def test_pinned_blocks_are_capped(vllm_engine):
    engine = vllm_engine
    policy = RetainPolicy("agent", RetentionAction.PROTECT, ttl_s=100.0)
    # cap: 25% of 12 blocks = 3 < 4 blocks of P
    s = engine.make_scheduler(_hook(policy, max_pinned_fraction=0.25), num_blocks=13, max_num_seqs=4)
    runner = fake_runner.FakeRunner()
    s.add_request(
        engine.make_request("P", fake_runner.prompt_tokens("agent-ctx", 64), 2,
                            extra_args={"kvpilot_session_id": "agent"})
    )
    _run_until_done(s, runner)
    runner.step(s)
    assert s.kvpilot_pinned_blocks == 0
    assert s._kvp_retention.pins.num_refused == 1


def _demotion_scenario(engine, cls):
    s = engine.make_scheduler(cls, num_blocks=13, max_num_seqs=4)
    runner = fake_runner.FakeRunner()
    old = fake_runner.prompt_tokens("old-ctx", 48)
    new = fake_runner.prompt_tokens("new-ctx", 48)
    s.add_request(engine.make_request("OLD", old, 2))
    _run_until_done(s, runner)
    s.add_request(engine.make_request("NEW", new, 2, extra_args={"kvpilot_session_id": "demote-me"}))
    _run_until_done(s, runner)
    runner.step(s)  # the retention decision for NEW is taken at the next step
    # both prefixes are cached (3 blocks each)
    assert _cached_tokens(engine, s, old + [1]) == 48
    assert _cached_tokens(engine, s, new + [1]) == 48
    # a filler that needs every unhashed block plus 3 cached ones
    s.add_request(engine.make_request("F", fake_runner.prompt_tokens("filler-d", 144), 1))
    _run_until_done(s, runner)
    return s, old, new


def test_lru_evicts_older_prefix_first(vllm_engine):
    s, old, new = _demotion_scenario(vllm_engine, _stock())
    assert _cached_tokens(vllm_engine, s, old + [1]) == 0
    assert _cached_tokens(vllm_engine, s, new + [1]) == 48


def test_demoted_prefix_is_evicted_before_older_ones(vllm_engine):
    policy = RetainPolicy("demote-me", RetentionAction.DEMOTE)
    s, old, new = _demotion_scenario(vllm_engine, _hook(policy))
    assert s.kvpilot_stats.demoted_blocks == 3
    assert _cached_tokens(vllm_engine, s, new + [1]) == 0
    assert _cached_tokens(vllm_engine, s, old + [1]) == 48


def test_reset_prefix_cache_releases_pins(vllm_engine):
    engine = vllm_engine
    policy = RetainPolicy("agent", RetentionAction.PROTECT, ttl_s=100.0)
    s = engine.make_scheduler(_hook(policy, max_pinned_fraction=1.0), num_blocks=13, max_num_seqs=4)
    runner = fake_runner.FakeRunner()
    s.add_request(
        engine.make_request("P", fake_runner.prompt_tokens("agent-ctx", 64), 2,
                            extra_args={"kvpilot_session_id": "agent"})
    )
    _run_until_done(s, runner)
    runner.step(s)
    assert s.kvpilot_pinned_blocks == 4
    assert s.reset_prefix_cache()
    assert s.kvpilot_pinned_blocks == 0


def test_a_reset_vllm_refuses_keeps_the_pins_and_the_eviction_index(vllm_engine):
    """While a request runs, vLLM refuses the prefix-cache reset (the cache stays): the pinned sessions keep their
    prefixes and the eviction lever its index; once nothing but pins holds blocks, the reset releases them."""
    engine = vllm_engine

    class RetainAndIndex(RetainPolicy):
        uses_eviction = True  # the eviction lever keeps its index of cached prefixes (the order is vLLM's)

    policy = RetainAndIndex("agent", RetentionAction.PROTECT, ttl_s=100.0)
    s = engine.make_scheduler(_hook(policy, max_pinned_fraction=1.0), num_blocks=24, max_num_seqs=4)
    runner = fake_runner.FakeRunner()
    ctx = fake_runner.prompt_tokens("agent-ctx", 64)
    s.add_request(engine.make_request("P", ctx, 2, extra_args={"kvpilot_session_id": "agent"}))
    _run_until_done(s, runner)
    runner.step(s)
    s.add_request(engine.make_request("B", fake_runner.prompt_tokens("busy", 32), 50))
    runner.step(s)
    assert s.kvpilot_pinned_blocks == 4 and s.running
    indexed = len(s._kvp_eviction.index)
    assert indexed > 0
    assert not s.reset_prefix_cache()
    assert s.kvpilot_pinned_blocks == 4 and len(s._kvp_eviction.index) == indexed
    assert _cached_tokens(engine, s, ctx + [1]) == 64
    assert s.reset_prefix_cache(reset_running_requests=True)
    assert s.kvpilot_pinned_blocks == 0 and len(s._kvp_eviction.index) == 0


class ReleaseOnNextFree(RetainPolicy):
    """Protect the agent's prefix; release it the next time retain() is asked."""

    def retain(self, prefixes, state):
        pinned = [p.prefix_id for p in prefixes if p.protected_until_s is not None]
        if pinned:
            self.calls.append([(p.prefix_id, p.owner_state.value, p.num_blocks) for p in prefixes])
            return RetentionDecision(release=pinned)
        return super().retain(prefixes, state)


def test_policy_releases_a_pin(vllm_engine):
    engine = vllm_engine
    policy = ReleaseOnNextFree("agent", RetentionAction.PROTECT, ttl_s=1e6)
    s = engine.make_scheduler(_hook(policy, max_pinned_fraction=1.0), num_blocks=13, max_num_seqs=4)
    runner = fake_runner.FakeRunner()
    s.add_request(
        engine.make_request("P", fake_runner.prompt_tokens("agent-ctx", 64), 2,
                            extra_args={"kvpilot_session_id": "agent"})
    )
    _run_until_done(s, runner)
    runner.step(s)
    assert s.kvpilot_pinned_blocks == 4
    s.add_request(engine.make_request("X", fake_runner.prompt_tokens("other", 20), 2))
    _run_until_done(s, runner)
    runner.step(s)  # X's blocks were freed: retain() sees X (freed) and P (pinned)
    assert policy.calls[-1][0][0] == "X" and policy.calls[-1][1][0] == "P"
    assert s.kvpilot_pinned_blocks == 0
    assert s._kvp_retention.pins.num_released_policy == 1


class Recorder(Policy):
    name = "test-recorder"
    uses_events = True

    def __init__(self):
        self.events = []

    def on_event(self, event):
        self.events.append((event.kind.value, event.request_id))


def test_events_reach_the_policy(vllm_engine):
    engine = vllm_engine
    policy = Recorder()
    s = engine.make_scheduler(_hook(policy), num_blocks=9, max_num_seqs=8)
    runner = fake_runner.FakeRunner()
    for i in range(4):  # the preemption scenario: two requests get preempted
        s.add_request(engine.make_request(f"r{i}", fake_runner.prompt_tokens(f"v{i}", 31), 8))
    t0 = {"kvpilot_session_id": "S", "kvpilot_turn": 0, "kvpilot_tool": "search"}
    _run_until_done(s, runner)
    s.add_request(engine.make_request("S-t0", fake_runner.prompt_tokens("s", 20), 2, extra_args=t0))
    _run_until_done(s, runner)
    s.add_request(
        engine.make_request(
            "S-t1", fake_runner.prompt_tokens("s", 40), 2, extra_args={"kvpilot_session_id": "S", "kvpilot_turn": 1}
        )
    )
    _run_until_done(s, runner)
    kinds = [k for k, _ in policy.events]
    for k in ("arrived", "scheduled", "preempted", "finished", "tool_call_started", "tool_call_ended"):
        assert k in kinds, k
    assert ("tool_call_started", "S-t0") in policy.events
    assert ("tool_call_ended", "S-t1") in policy.events
    assert kinds.count("arrived") == 6 and kinds.count("finished") == 6
    assert kinds.count("preempted") >= 2
