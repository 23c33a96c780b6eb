"""The learned policy's default tier order: each owner's next use from its session's state."""

from __future__ import annotations

import math

import pytest

from policy.common import furthest_first
from policy.interface import CachedPrefix, Event, EventKind, OwnerState, RequestMeta
from policy.session_reuse import RATE_WINDOW, SessionStateNextUse


def _ev(kind: EventKind, t: float, sid: str | None = None, tool: str | None = None) -> Event:
    return Event(kind=kind, time_s=t, request_id=f"{sid}-{t}", meta=RequestMeta(session_id=sid, tool=tool))


def _owner(sid: str, state: OwnerState, tool: str | None = "bash", last: float = 0.0, pos: int | None = None,
           hint: float | None = None) -> CachedPrefix:
    meta = RequestMeta(session_id=sid, tool=tool, expected_pause_s=hint)
    return CachedPrefix(sid, sid, state, meta, (), (), last, tier_blocks=4, queue_position=pos)


def test_next_use_follows_each_sessions_state() -> None:
    p = SessionStateNextUse(default_latency_s=1.0)
    for i in range(5):  # five admissions over 4 s: 1 per second
        p.observe(_ev(EventKind.SCHEDULED, 96.0 + i))
    # two bash pauses seen: 2 s and 4 s, mean 3 s; "s-paused" paused at 99 s
    p.observe(_ev(EventKind.TOOL_CALL_STARTED, 10.0, "x", "bash"))
    p.observe(_ev(EventKind.TOOL_CALL_ENDED, 12.0, "x"))
    p.observe(_ev(EventKind.TOOL_CALL_STARTED, 20.0, "y", "bash"))
    p.observe(_ev(EventKind.TOOL_CALL_ENDED, 24.0, "y"))
    p.observe(_ev(EventKind.TOOL_CALL_STARTED, 99.0, "s-paused", "bash"))
    p.observe(_ev(EventKind.TOOL_CALL_STARTED, 90.0, "s-overdue", "bash"))
    now = 100.0
    owners = [
        _owner("s-waiting-next", OwnerState.WAITING, pos=0),
        _owner("s-waiting-5th", OwnerState.WAITING, pos=5),
        _owner("s-paused", OwnerState.PAUSED_TOOL),
        _owner("s-overdue", OwnerState.PAUSED_TOOL),
        _owner("s-hinted", OwnerState.PAUSED_TOOL, last=98.0, hint=30.0),  # no pause seen: its last use, + hint
        _owner("s-running", OwnerState.RUNNING),
        _owner("s-unknown-tool", OwnerState.RUNNING, tool="search"),  # no search pause seen: the default
        _owner("s-last-turn", OwnerState.RUNNING, tool=None),
        _owner("s-done", OwnerState.FINISHED, tool=None),
    ]
    got = dict(zip((o.prefix_id for o in owners), p.next_use_s(owners, now)))
    assert got["s-waiting-next"] == now and got["s-waiting-5th"] == pytest.approx(now + 5.0)
    assert got["s-paused"] == pytest.approx(99.0 + 3.0) and got["s-overdue"] == now
    assert got["s-hinted"] == pytest.approx(98.0 + 30.0)
    assert got["s-running"] == pytest.approx(now + 3.0) and got["s-unknown-tool"] == pytest.approx(now + 1.0)
    assert got["s-last-turn"] == math.inf and got["s-done"] == math.inf
    # Belady over those: the sessions that never come back leave first, the queue's head last
    order = furthest_first(owners, [got[o.prefix_id] for o in owners])
    assert set(order[:2]) == {"s-last-turn", "s-done"}
    assert order[-2:] == ["s-overdue", "s-waiting-next"] or order[-2:] == ["s-waiting-next", "s-overdue"]
    assert order.index("s-hinted") < order.index("s-waiting-5th") < order.index("s-running") < order.index("s-paused")


def test_before_any_admission_a_queued_turn_is_needed_now_and_the_rate_is_the_recent_one() -> None:
    p = SessionStateNextUse()
    assert p.admission_rate(5.0) is None
    assert p.next_use_s([_owner("w", OwnerState.WAITING, pos=7)], 5.0) == [5.0]
    for i in range(RATE_WINDOW):  # a burst: 10 admissions a second
        p.observe(_ev(EventKind.SCHEDULED, 0.1 * i))
    for i in range(RATE_WINDOW):  # then one a second: the rate follows the last RATE_WINDOW admissions
        p.observe(_ev(EventKind.SCHEDULED, 1000.0 + i))
    assert p.admission_rate(1000.0 + RATE_WINDOW - 1) == pytest.approx(1.0)
    # a tool's latency is the mean of its pauses
    for i, lat in enumerate((1.0, 2.0, 6.0)):
        p.observe(_ev(EventKind.TOOL_CALL_STARTED, 10.0 * i, "s", "bash"))
        p.observe(_ev(EventKind.TOOL_CALL_ENDED, 10.0 * i + lat, "s"))
    assert p.latency_s(RequestMeta(tool="bash")) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="default_latency_s"):
        SessionStateNextUse(default_latency_s=-1.0)
