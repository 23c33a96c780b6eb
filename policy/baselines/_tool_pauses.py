"""Helpers shared by the baselines that act on tool pauses (Continuum, InferCept, working set), on top of the tool
latencies they learn (:mod:`policy.tool_latency`).

* :class:`SessionPins` remembers the prefixes a policy pinned for paused sessions and releases them once
  the session's next turn is scheduled (it has then taken its own references to the blocks it hit).
* :class:`PauseEventsMixin` feeds a policy's ``latencies`` and ``pins`` their events, and hands them (with the
  policy's own :attr:`PauseEventsMixin.session_fields`) to a successor of the same class at a hot swap.

Plain Python, no vLLM.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from typing import Optional

from policy.interface import CachedPrefix, Event, EventKind, Policy, PolicyState, StateMismatch
from policy.tool_latency import ToolLatencies

__all__ = ["SessionPins", "PauseEventsMixin"]

_STARTED, _ENDED = EventKind.TOOL_CALL_STARTED, EventKind.TOOL_CALL_ENDED  # (plain names: cheaper to read)


class SessionPins:
    """The prefixes a policy pinned for paused sessions, and when to release them.

    :meth:`on_scheduled` marks a session's pins for release when a later turn of it is scheduled;
    :meth:`settle` (at each ``retain()``) hands those releases over and forgets pins that ended otherwise
    (TTL, pressure: the hook no longer lists them as protected).
    """

    def __init__(self) -> None:
        self._pins: dict[str, tuple[Optional[str], int]] = {}  # prefix id -> (session, turn)
        self._session_pins: dict[str, set] = {}
        self._to_release: set = set()

    def __contains__(self, prefix_id: object) -> bool:
        return prefix_id in self._pins

    def add(self, prefix: CachedPrefix) -> None:
        """``prefix`` is being pinned."""
        sid = prefix.meta.session_id
        self._pins[prefix.prefix_id] = (sid, prefix.meta.turn or 0)
        if sid is not None:
            self._session_pins.setdefault(sid, set()).add(prefix.prefix_id)

    def forget(self, prefix_id: str) -> None:
        """``prefix_id`` is no longer pinned (or no longer ours to release)."""
        sid, _ = self._pins.pop(prefix_id, (None, 0))
        if sid is not None:
            s = self._session_pins.get(sid)
            if s is not None:
                s.discard(prefix_id)
                if not s:
                    del self._session_pins[sid]

    def on_scheduled(self, event: Event) -> None:
        """A ``SCHEDULED`` event: the pins of earlier turns of its session are to be released."""
        sid = event.meta.session_id
        pids = self._session_pins.get(sid) if sid is not None else None
        if pids:
            turn = event.meta.turn or 0
            for pid in pids:
                if self._pins.get(pid, (None, turn))[1] < turn:
                    self._to_release.add(pid)

    def settle(self, prefixes: Sequence[CachedPrefix], decided: Collection[str]) -> frozenset:
        """The pins to release now; forgets them, and the pins the hook no longer protects that are not in
        ``decided`` (the prefix ids this ``retain()`` answers for)."""
        release = frozenset(self._to_release)
        self._to_release.clear()
        for pid in release:
            self.forget(pid)
        live = {p.prefix_id for p in prefixes if p.protected_until_s is not None}
        for pid in [pid for pid in self._pins if pid not in live and pid not in decided]:
            self.forget(pid)
        return release


#: Layout version of :meth:`PauseEventsMixin.export_state`.
PAUSE_STATE_VERSION = 1


def _rewindow(value: object, window: int) -> object:
    """``value`` with every deque in it (a deque, or a dict of them) bounded by ``window``."""
    if isinstance(value, deque):
        return deque(value, maxlen=window)
    if isinstance(value, dict):
        return {k: _rewindow(v, window) for k, v in value.items()}
    return value


class PauseEventsMixin:
    """``on_event`` for a policy with ``latencies`` (:class:`ToolLatencies`) and ``pins`` (:class:`SessionPins`):
    tool-call events teach the latencies, a ``SCHEDULED`` next turn releases its session's pins.

    At a hot swap (:meth:`export_state` / :meth:`import_state`, between instances of one policy class) the
    paused sessions' clocks, the learned latencies, the pins to release and the attributes named in
    :attr:`session_fields` carry over; deques take the successor's ``window``."""

    latencies: ToolLatencies
    pins: SessionPins
    #: The policy's own per-session attributes that carry over at a hot swap.
    session_fields: tuple[str, ...] = ()

    def _state_kind(self) -> str:
        return f"{type(self).__module__}.{type(self).__qualname__}"

    def export_state(self) -> PolicyState:
        lat, pins = self.latencies, self.pins
        data = {"latencies": (lat._lat, lat._all, lat._paused),
                "pins": (pins._pins, pins._session_pins, pins._to_release),
                "fields": {f: getattr(self, f) for f in self.session_fields}}
        return PolicyState(self._state_kind(), PAUSE_STATE_VERSION, data)

    def import_state(self, state: PolicyState) -> None:
        data = Policy.state_data(state, self._state_kind(), PAUSE_STATE_VERSION)
        if set(data.get("fields", ())) != set(self.session_fields):
            raise StateMismatch(f"{self._state_kind()}: the state's fields {sorted(data.get('fields', ()))} are not "
                                f"{sorted(self.session_fields)}")
        lat, pins, w = self.latencies, self.pins, self.latencies.window
        per_tool, pooled, paused = data["latencies"]
        lat._lat = {k: deque(v, maxlen=w) for k, v in per_tool.items()}
        lat._all = deque(pooled, maxlen=w)
        lat._paused = paused
        lat._stats.clear()
        pins._pins, pins._session_pins, pins._to_release = data["pins"]
        for f, v in data["fields"].items():
            setattr(self, f, _rewindow(v, w))

    def on_event(self, event: Event) -> None:
        if event.meta.session_id is None:
            return
        self.latencies.on_event(event)
        if event.kind is EventKind.SCHEDULED:
            self.pins.on_scheduled(event)
