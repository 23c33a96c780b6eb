"""kvpilot's rollout width (policy/group_width.py): the logged prior of session contexts, its online refinement,
the rule that starts a group only while the predicted working set fits, and the engine's holds."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from policy.group_width import PRIOR_WEIGHT, SessionContexts, WidthHolds, fit_session_contexts, working_set_admits
from policy.interface import EngineState, Event, EventKind, RequestMeta


def _requests(rows: list[tuple]) -> pa.Table:
    names = ["session_id", "domain", "prompt_tokens", "output_tokens"]
    return pa.table({n: [r[i] for r in rows] for i, n in enumerate(names)},
                    schema=pa.schema([("session_id", pa.string()), ("domain", pa.string()),
                                      ("prompt_tokens", pa.int32()), ("output_tokens", pa.int32())]))


def test_fit_takes_each_sessions_peak_context_and_averages_by_domain() -> None:
    t = _requests([("a", "swe", 1000, 200), ("a", "swe", 3000, 500), ("b", "swe", 2000, 0),  # peaks 3500, 2000
                   ("c", "math", 400, 100),  # 500
                   (None, "math", 90_000, 10), ("d", None, 90_000, 10)])  # no session / no domain: left out
    fit = fit_session_contexts(t)
    assert fit == {"swe": {"mean_peak": 2750.0, "sessions": 2.0}, "math": {"mean_peak": 500.0, "sessions": 1.0}}
    assert fit_session_contexts(_requests([(None, "swe", 1, 1)])) == {}


def test_prediction_starts_at_the_prior_and_moves_with_sessions_that_end() -> None:
    c = SessionContexts({"swe": {"mean_peak": 20_000, "sessions": 64}, "search": {"mean_peak": 4_000, "sessions": 64}},
                        fallback=65_536)
    assert c.predict("swe") == 20_000
    assert c.predict("math") == 12_000  # a domain the logs lack: their mean over sessions
    c.observe("swe", 30_000)
    assert c.predict("swe") == pytest.approx((20_000 * PRIOR_WEIGHT + 30_000) / (PRIOR_WEIGHT + 1))
    c.observe("math", 1_000)
    assert c.predict("math") == 1_000  # from then on, what this run saw
    bare = SessionContexts(None, fallback=65_536)
    assert bare.predict("swe") == 65_536  # no prior: the largest request
    bare.observe("swe", 5_000)
    assert bare.predict("swe") == 5_000


def test_a_group_starts_only_while_the_working_set_fits() -> None:
    assert working_set_admits(300, 200, 500, groups_in_flight=2)
    assert not working_set_admits(301, 200, 500, groups_in_flight=2)
    assert working_set_admits(0, 10_000, 500, groups_in_flight=0)  # one group always may


def _event(kind: str, rid: str, group: str, version: int | None = 0, prompt: int = 0, output: int = 0,
           reason: str | None = None) -> Event:
    meta = RequestMeta(group_id=group, session_id=rid.rsplit("-t", 1)[0], weight_version=version)
    return Event(EventKind(kind), 0.0, rid, meta, num_prompt_tokens=prompt, num_output_tokens=output,
                 finish_reason=reason)


def _engine(gpu_blocks: int, tier_blocks: int = 0) -> EngineState:
    return EngineState(time_s=0.0, engine_step=1, num_running=0, num_waiting=0, num_free_blocks=gpu_blocks,
                       num_total_blocks=gpu_blocks, num_pinned_blocks=0, kv_usage=0.0, block_size=16,
                       max_num_running=256, max_num_batched_tokens=8192, num_offload_blocks=tier_blocks)


def test_the_engines_width_holds_a_younger_groups_turn_while_the_older_contexts_do_not_fit() -> None:
    """Two groups of two sessions in 1,024 tokens of KV (no tier): while the older group's two contexts and the
    younger group's do not fit, a younger turn waits; the older group's never does, nor a running session's. A
    session's end makes room; requests without a group are never held nor counted."""
    w = WidthHolds()
    for rid, g in (("a0-t0", "a"), ("a1-t0", "a"), ("b0-t0", "b"), ("b1-t0", "b")):
        w.on_event(_event("arrived", rid, g, prompt=200))
    assert w.holds(["a0-t0", "a1-t0", "b0-t0", "b1-t0"], _engine(64)) == frozenset()  # 800 tokens fit in 1,024
    for rid in ("a0-t0", "a1-t0", "b0-t0", "b1-t0"):
        w.on_event(_event("scheduled", rid, rid[0]))
        w.on_event(_event("finished", rid, rid[0], prompt=200, output=100, reason="tool_call"))
    # each paused at 300 tokens; the next turns arrive with 350-token prompts: 1,400 tokens in flight
    for rid in ("b0-t1", "a0-t1", "a1-t1", "b1-t1"):
        w.on_event(_event("arrived", rid, rid[0], prompt=350))
    waiting = ["b0-t1", "a0-t1", "a1-t1", "b1-t1", "x-t0"]
    w.on_event(Event(EventKind.ARRIVED, 0.0, "x-t0", RequestMeta(session_id="x"), num_prompt_tokens=5000))  # no group
    assert w.holds(waiting, _engine(64)) == {"b0-t1", "b1-t1"}  # a's 700 run, then b's 350 + 700 + 700 > 1,024
    assert w.holds(waiting, _engine(128)) == frozenset()  # 2,048 tokens: everything fits
    # with a tier, a running context counts twice (its host copy): 1,400 + 1,400 fit in 1,024 + 2,048, not 1,024 x 2
    assert w.holds(waiting, _engine(64, tier_blocks=128)) == frozenset()
    assert w.holds(waiting, _engine(64, tier_blocks=64)) == {"b0-t1", "b1-t1"}
    w.on_event(_event("scheduled", "b0-t1", "b"))  # released by the hook's starvation bound: it runs now
    assert w.holds(waiting, _engine(64)) == {"b1-t1"}
    w.on_event(_event("scheduled", "a0-t1", "a"))
    w.on_event(_event("finished", "a0-t1", "a", prompt=350, output=50, reason="stop"))  # a0 ends: 350 freed
    w.on_event(_event("scheduled", "a1-t1", "a"))
    w.on_event(_event("finished", "a1-t1", "a", prompt=350, output=50, reason="stop"))  # group a ends
    assert w.holds(["b1-t1"], _engine(64)) == frozenset()  # b is the oldest group now
    w.on_event(_event("finished", "b0-t1", "b", prompt=350, output=10, reason="abort"))  # a weight update's abort
    assert "b0" in w.sessions and not w.sessions["b0"].live  # comes back: still in flight, paused


def test_the_width_holds_in_synchronous_steps_too_groups_ranked_in_arrival_order() -> None:
    """Without weight versions (a synchronous RL step: every group sent at once) the groups rank in the order their
    first request arrived: the first-sent group's sessions start, a later group's first turns wait while the contexts
    do not fit, and start as the older sessions end."""
    w = WidthHolds()
    first = [("c0-t0", "c"), ("c1-t0", "c"), ("a0-t0", "a"), ("a1-t0", "a")]  # c sent first: the oldest
    for rid, g in first:
        w.on_event(_event("arrived", rid, g, version=None, prompt=400))
    ids = [rid for rid, _ in first]
    assert w.holds(ids, _engine(64)) == {"a0-t0", "a1-t0"}  # c's 800 run; then 400 + 800 + 800 > 1,024
    assert w.holds(ids, _engine(128)) == frozenset()  # 2,048 tokens: everything fits
    for rid in ("c0-t0", "c1-t0"):
        w.on_event(_event("scheduled", rid, "c", version=None))
        w.on_event(_event("finished", rid, "c", version=None, prompt=400, output=100, reason="stop"))
    assert w.holds(["a0-t0", "a1-t0"], _engine(64)) == frozenset()  # c ended: a is the oldest now


def test_the_engines_width_is_work_conserving() -> None:
    """Where nothing runs and only held turns wait, the first of them goes: the width never idles the engine; with a
    request running, or another request waiting, the holds stand."""
    w = WidthHolds()
    for rid, g, prompt in (("a0-t0", "a", 500), ("b0-t0", "b", 200), ("b1-t0", "b", 200)):
        w.on_event(_event("arrived", rid, g, prompt=prompt))
        w.on_event(_event("scheduled", rid, g))
        w.on_event(_event("finished", rid, g, prompt=prompt, output=100, reason="tool_call"))
    for rid in ("b0-t1", "b1-t1"):  # a0 still on its tool at 600 tokens; b's turns bring 1,400 in 1,024 of KV
        w.on_event(_event("arrived", rid, "b", prompt=400))
    assert w.holds(["b0-t1", "b1-t1"], _engine(64)) == {"b1-t1"}  # idle engine: the first held turn goes
    busy = dataclasses.replace(_engine(64), num_running=1)
    assert w.holds(["b0-t1", "b1-t1"], busy) == {"b0-t1", "b1-t1"}
    w.on_event(Event(EventKind.ARRIVED, 0.0, "x-t0", RequestMeta(), num_prompt_tokens=10))  # no group, no session
    assert w.holds(["b0-t1", "b1-t1", "x-t0"], _engine(64)) == {"b0-t1", "b1-t1"}  # x runs


def test_the_engines_width_holds_nothing_while_the_oldest_group_alone_does_not_fit() -> None:
    """A hold keeps the older groups' contexts: where the oldest group's alone outgrow GPU KV plus the tier (one
    group's contexts can outgrow a small KV), they evict each other anyway and a hold would only idle the engine, so
    the younger turn goes; with room for the oldest group, the same turn waits."""
    w = WidthHolds()
    for rid, g in (("a0-t0", "a"), ("a1-t0", "a"), ("b0-t0", "b")):
        w.on_event(_event("arrived", rid, g, prompt=600))
        w.on_event(_event("scheduled", rid, g))
        w.on_event(_event("finished", rid, g, prompt=600, output=100, reason="tool_call"))
    w.on_event(_event("arrived", "b0-t1", "b", prompt=800))  # a's two contexts: 1,400 tokens, paused
    busy = dataclasses.replace(_engine(64), num_running=1)
    assert w.holds(["b0-t1"], busy) == frozenset()  # 1,400 > 1,024: a does not fit, holding b keeps nothing
    more = dataclasses.replace(_engine(96), num_running=1)
    assert w.holds(["b0-t1"], more) == {"b0-t1"}  # a fits in 1,536, a and b do not: b waits
    assert w.holds(["b0-t1"], dataclasses.replace(_engine(64, tier_blocks=32), num_running=1)) == {"b0-t1"}
