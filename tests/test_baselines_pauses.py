"""The tool-pause baselines on plain records (no vLLM): InferCept's least-waste choice and the working set.

* InferCept: preserve (PROTECT) a small context with a short pause, discard (DEMOTE) when the pause is long
  and recompute cheap, swap (OFFLOAD) when a tier exists and loading is cheap; a preserved prefix becomes
  OFFLOAD / DEMOTE once its pause outlasted what was learned; pins are released when the next turn runs.
* Working set: a new session is held exactly when it would not fit beside the active ones and admitted once
  one finishes; nothing is held when nothing is active; returning turns are never held; paused sessions are
  pinned (or offloaded when the pin would not fit).
"""

from __future__ import annotations

import pytest

from policy.baselines import BASELINES
from policy.baselines.infercept import Choice, InterceptWastePolicy
from policy.baselines.working_set import WorkingSetAdmissionPolicy
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

BS = 16


def state(now=1000.0, total=1000, free=None, tier=0, load_s=0.0, pinned=0):
    return EngineState(
        time_s=now, engine_step=1, num_running=0, num_waiting=0,
        num_free_blocks=total if free is None else free, num_total_blocks=total, num_pinned_blocks=pinned,
        kv_usage=0.0, block_size=BS, max_num_running=256, max_num_batched_tokens=8192,
        num_offload_blocks=tier, offload_load_s_per_block=load_s,
    )


def paused(pid, n_blocks, session=None, tool="search", pinned=None, last_used=1000.0):
    return CachedPrefix(
        prefix_id=pid, owner_request_id=pid, owner_state=OwnerState.PAUSED_TOOL,
        meta=RequestMeta(session_id=session or pid, turn=0, tool=tool),
        block_ids=tuple(range(n_blocks)), block_hashes=tuple(range(n_blocks)),
        last_used_s=last_used, protected_until_s=pinned,
    )


def ev(kind, session, turn=0, t=1000.0, prompt=0, out=0, reason=None, tool=None, domain=None):
    return Event(kind=kind, time_s=t, request_id=f"{session}-{turn}",
                 meta=RequestMeta(session_id=session, turn=turn, tool=tool, domain=domain),
                 num_prompt_tokens=prompt, num_output_tokens=out, finish_reason=reason)


def cand(rid, session, turn=0, prompt=BS * 10, arrival=0.0):
    return CandidateRequest(
        request_id=rid, meta=RequestMeta(session_id=session, turn=turn), status=RequestStatus.WAITING,
        prompt_token_ids=(), num_prompt_tokens=prompt, num_cached_tokens=-1, num_computed_tokens=0,
        num_output_tokens=0, max_tokens=100, arrival_s=arrival, wait_s=0.0,
    )


def learn(policy, latencies, tool="search"):
    for i, x in enumerate(latencies):
        policy.on_event(ev(EventKind.TOOL_CALL_STARTED, f"L{i}", 0, t=0.0, tool=tool))
        policy.on_event(ev(EventKind.TOOL_CALL_ENDED, f"L{i}", 1, t=x))


# ----------------------------------------------------------------- InferCept
def test_infercept_preserves_short_pause_discards_long_one():
    # 10 blocks = 160 tokens, recompute 0.16 s at 1000 tok/s; the batch holds 100 blocks: discard 16 block-s
    p = InterceptWastePolicy(prefill_tokens_per_s=1000.0, prior_ttl_s=0.5)
    busy = state(total=1000, free=900)
    dec = p.retain([paused("P", 10)], busy)  # preserve: 0.5 s x 10 = 5 block-s
    assert dec.actions["P"].action is RetentionAction.PROTECT and dec.actions["P"].ttl_s == 0.5
    long = InterceptWastePolicy(prefill_tokens_per_s=1000.0, prior_ttl_s=5.0)  # preserve: 50 block-s
    assert long.retain([paused("P", 10)], busy).actions["P"].action is RetentionAction.DEMOTE
    # the same long pause with an idle batch: discard costs 0.16 s x 10 = 1.6 block-s, still below 50
    assert long.choose(10, 5.0, state()) is Choice.DISCARD
    # a slow prefill (recompute 16 s, 1600 block-s) makes preserve win the long pause
    slow = InterceptWastePolicy(prefill_tokens_per_s=10.0, prior_ttl_s=5.0)
    assert slow.retain([paused("P", 10)], busy).actions["P"].action is RetentionAction.PROTECT


def test_infercept_swaps_when_a_tier_exists_and_loading_is_cheap():
    p = InterceptWastePolicy(prefill_tokens_per_s=1000.0, prior_ttl_s=5.0)
    busy = state(total=1000, free=900, tier=500, load_s=0.001)  # swap: 10 x 0.001 x 10 = 0.1 block-s
    assert p.retain([paused("P", 10)], busy).actions["P"].action is RetentionAction.OFFLOAD
    assert p.wastes(10, 5.0, busy) == pytest.approx({Choice.PRESERVE: 50.0, Choice.SWAP: 0.1, Choice.DISCARD: 16.0})
    # a slow load (10 x 1 s x 10 = 100 block-s) loses to discard; a tier too small for the context is no option
    assert p.choose(10, 5.0, state(free=900, tier=500, load_s=1.0)) is Choice.DISCARD
    assert Choice.SWAP not in p.wastes(10, 5.0, state(tier=5, load_s=0.001))


def test_infercept_reevaluates_a_preserved_prefix_once_the_pause_ran_long():
    # mostly short calls, one long: mean 2.08 s; 10 blocks preserved 20.8 block-s, discard 0.16 s x 200 = 32
    lat = [0.1, 0.1, 0.1, 0.1, 10.0]
    busy, tier = dict(total=1000, free=800), dict(tier=500, load_s=0.25)  # swap: 10 x 0.25 x 10 = 25 block-s
    for offload, later in ((False, RetentionAction.DEMOTE), (True, RetentionAction.OFFLOAD)):
        p = InterceptWastePolicy(prefill_tokens_per_s=1000.0, offload=offload)
        learn(p, lat)
        p.on_event(ev(EventKind.TOOL_CALL_STARTED, "A", 0, t=1000.0, tool="search"))
        extra = tier if offload else {}
        dec = p.retain([paused("A0", 10, session="A")], state(now=1000.0, **busy, **extra))
        assert dec.actions["A0"].action is RetentionAction.PROTECT
        pin = paused("A0", 10, session="A", pinned=1000.0 + dec.actions["A0"].ttl_s)
        # 0.05 s in, the short calls may still return: the rest expected is (4 x 0.05 + 9.95) / 5 = 2.03 s
        assert p.retain([pin], state(now=1000.05, **busy, **extra)) is None
        # 0.5 s in, past the short calls: 9.5 s more expected (95 block-s): the pin goes
        dec = p.retain([pin], state(now=1000.5, **busy, **extra))
        assert dec.actions["A0"].action is later and "A0" not in p.pins
    # the prior is memoryless: however long the pause, the same choice
    prior = InterceptWastePolicy(prefill_tokens_per_s=1000.0, prior_ttl_s=1.0)
    assert prior.retain([paused("A0", 10)], state(**busy)).actions["A0"].action is RetentionAction.PROTECT
    assert prior.retain([paused("A0", 10, pinned=1002.0)], state(now=1100.0, **busy)) is None


def test_infercept_releases_pins_when_the_next_turn_runs():
    p = InterceptWastePolicy(prefill_tokens_per_s=1000.0, prior_ttl_s=0.5)
    assert p.retain([paused("A0", 10, session="A")], state(free=900)).actions["A0"].action is RetentionAction.PROTECT
    p.on_event(ev(EventKind.TOOL_CALL_ENDED, "A", 1, t=1000.4))
    p.on_event(ev(EventKind.SCHEDULED, "A", 1, t=1000.4))
    resumed = paused("A0", 10, session="A", pinned=1000.5)
    resumed.owner_state = OwnerState.RUNNING
    dec = p.retain([resumed], state(now=1000.4))
    assert set(dec.release) == {"A0"} and not dec.actions


# --------------------------------------------------------------- working set
def admitted(policy, waiting, st):
    dec = policy.admit(waiting, st)
    return (list(dec.order), set(dec.hold)) if dec is not None else None


def test_working_set_holds_a_new_session_exactly_when_it_would_not_fit():
    ws = WorkingSetAdmissionPolicy(target_fraction=0.5, growth_prior=2.0)
    st = state(total=100)  # budget 50 blocks
    # nothing active: A (20 blocks expected: 10-block prompt x 2) and B (20) fit, C (20) would not
    waiting = [cand("C0", "C", arrival=3.0), cand("A0", "A", arrival=1.0), cand("B0", "B", arrival=2.0)]
    assert admitted(ws, waiting, st) == (["A0", "B0"], {"C0"})
    for s in ("A", "B"):
        ws.on_event(ev(EventKind.SCHEDULED, s, 0, prompt=BS * 10))
    # A and B active (10 blocks each): C's 20 fits beside them (40 <= 50), D's after it does not
    waiting = [cand("C0", "C", arrival=3.0), cand("D0", "D", arrival=4.0)]
    assert admitted(ws, waiting, st) == (["C0"], {"D0"})
    ws.on_event(ev(EventKind.SCHEDULED, "C", 0, prompt=BS * 10))
    # A paused on a tool with a 30-block context: it stays in the working set, D is held
    ws.on_event(ev(EventKind.FINISHED, "A", 0, prompt=BS * 10, out=BS * 20, reason="tool_call"))
    assert ws.active_blocks(BS) == 50
    assert admitted(ws, [cand("D0", "D", arrival=4.0)], st) == ([], {"D0"})
    # B finishes its last turn: 40 blocks active, D's 20 still does not fit; C finishes too: it does
    ws.on_event(ev(EventKind.FINISHED, "B", 0, prompt=BS * 10, out=0, reason="stop"))
    assert admitted(ws, [cand("D0", "D", arrival=4.0)], st) == ([], {"D0"})
    ws.on_event(ev(EventKind.FINISHED, "C", 0, prompt=BS * 10, out=0, reason="abort"))
    assert admitted(ws, [cand("D0", "D", arrival=4.0)], st) == (["D0"], set())


def test_working_set_never_holds_everything_and_never_holds_returning_turns():
    ws = WorkingSetAdmissionPolicy(target_fraction=0.5, growth_prior=4.0)
    st = state(total=100)
    # nothing active: the first new session goes in though its 80 blocks exceed the 50-block budget
    assert admitted(ws, [cand("B0", "B", arrival=2.0), cand("A0", "A", arrival=1.0)], st) == (["A0"], {"B0"})
    ws.on_event(ev(EventKind.SCHEDULED, "A", 0, prompt=BS * 60))
    ws.on_event(ev(EventKind.FINISHED, "A", 0, prompt=BS * 60, out=BS * 10, reason="tool_call"))
    # A's next turn, a request without a session and a later turn of a session not seen are never held
    waiting = [cand("N", None), cand("B0", "B"), cand("A1", "A", 1, prompt=BS * 71), cand("Z3", "Z", 3)]
    assert admitted(ws, waiting, st) == (["N", "A1", "Z3"], {"B0"})
    assert admitted(ws, [cand("A1", "A", 1)], st) is None


def test_working_set_learns_the_final_context_of_a_domain():
    ws = WorkingSetAdmissionPolicy(min_observations=2, growth_prior=1.0)
    assert ws.expected_blocks(cand("X0", "X", prompt=BS * 2), BS) == 2  # the prior: prompt x 1
    for i, final in enumerate((BS * 30, BS * 50)):
        ws.on_event(ev(EventKind.SCHEDULED, f"S{i}", 0, prompt=BS * 2, domain="swe"))
        ws.on_event(ev(EventKind.FINISHED, f"S{i}", 0, prompt=BS * 2, out=final - BS * 2, reason="stop",
                       domain="swe"))
    assert ws.expected_blocks(cand("X0", "X", prompt=BS * 2), BS) == 40  # other domains: the pooled mean
    assert ws.expected_blocks(cand("X0", "X", prompt=BS * 90), BS) == 90  # never below its own prompt


def test_working_set_pins_paused_sessions_or_offloads_what_would_not_fit():
    ws = WorkingSetAdmissionPolicy(prior_ttl_s=3.0)
    dec = ws.retain([paused("A0", 10, session="A"), paused("B0", 400, session="B")], state(total=1000, pinned=200))
    assert {k: (r.action, r.ttl_s) for k, r in dec.actions.items()} == {
        "A0": (RetentionAction.PROTECT, 3.0), "B0": (RetentionAction.PROTECT, 3.0)}
    off = create_policy("working-set-offload", prior_ttl_s=3.0)
    assert off.uses_offload and off.name == "working-set-offload"
    # 200 pinned + A's 10 fits under half of 1000; B's 400 on top would not: offloaded
    dec = off.retain([paused("A0", 10, session="A"), paused("B0", 400, session="B")], state(total=1000, pinned=200))
    assert {k: r.action for k, r in dec.actions.items()} == {"A0": RetentionAction.PROTECT,
                                                            "B0": RetentionAction.OFFLOAD}


# ------------------------------------------------------------------ registry
def test_registered_names_flags_and_options():
    for name in ("infercept", "infercept-offload", "working-set", "working-set-offload"):
        assert name in BASELINES
        p = create_policy(name)
        assert p.name == name and p.uses_retention and p.uses_events
        assert p.uses_offload is name.endswith("-offload")
    assert create_policy("working-set").uses_admission and not create_policy("infercept").uses_admission
    assert create_policy("infercept", offload=True).uses_offload
    for name, bad, match in (
        ("infercept", {"prefill_tokens_per_s": 0}, "prefill_tokens_per_s"),
        ("infercept", {"offload": "yes"}, "offload"),
        ("infercept", {"ttl_quantile": 1.5}, "ttl_quantile"),
        ("working-set", {"target_fraction": 1.2}, "target_fraction"),
        ("working-set", {"target_fraction": 0}, "target_fraction"),
        ("working-set", {"growth_prior": 0.5}, "growth_prior"),
        ("working-set", {"offload": 1}, "offload"),
        ("working-set", {"min_observations": 0}, "min_observations"),
    ):
        with pytest.raises(ValueError, match=match):
            create_policy(name, **bad)
    with pytest.raises(ValueError, match="bad options"):
        create_policy("working-set", nope=1)
