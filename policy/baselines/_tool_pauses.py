"""Helpers shared by the policies that act on tool pauses (Continuum, InferCept, working set; the learned policy's
CPU-tier order, :mod:`policy.session_reuse`).

* :class:`ToolLatencies` learns tool latencies online: ``TOOL_CALL_STARTED`` (a turn with tool metadata
  finished) starts a clock for its session, ``TOOL_CALL_ENDED`` (the session's next turn arrived) stops
  it. The last ``window`` latencies of each tool (and of all tools together) are kept; with fewer than
  ``min_observations`` for a tool the pooled ones stand in, and with fewer than that too, the prior
  ``prior_ttl_s``. From them it gives a pin's TTL (the ``ttl_quantile``, clamped to
  ``[min_ttl_s, max_ttl_s]``), the chance the tool returns within it, the expected hold, and the
  expected (remaining) pause; and each tool's mean over every latency seen (:meth:`ToolLatencies.mean_s`).
* :class:`SessionPins` remembers the prefixes a policy pinned for paused sessions and releases them once
  the session's next turn is scheduled (it has then taken its own references to the blocks it hit).
* :class:`PauseEventsMixin` feeds a policy's ``latencies`` and ``pins`` their events, and hands them (with the
  policy's own :attr:`PauseEventsMixin.session_fields`) to a successor of the same class at a hot swap.
* :func:`quantile`: an empirical quantile.

Plain Python, no vLLM.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Optional

from policy.baselines._eviction import check_count, check_number
from policy.interface import CachedPrefix, Event, EventKind, Policy, PolicyState, StateMismatch

__all__ = ["MAX_SESSIONS", "quantile", "ToolStats", "ToolLatencies", "SessionPins", "PauseEventsMixin"]

#: Bound on per-session records (the oldest goes first), so a policy stays small without finish events.
MAX_SESSIONS = 1 << 17
_STARTED, _ENDED = EventKind.TOOL_CALL_STARTED, EventKind.TOOL_CALL_ENDED  # (plain names: cheaper to read)


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear interpolation between order statistics)."""
    s = sorted(xs)
    if not s:
        raise ValueError("quantile of nothing")
    pos = q * (len(s) - 1)
    i = int(math.floor(pos))
    j = min(i + 1, len(s) - 1)
    return s[i] + (s[j] - s[i]) * (pos - i)


@dataclass(frozen=True, slots=True)
class ToolStats:
    """What the learned latencies say of a pause on one tool."""

    ttl_s: float  # the pin's TTL: the latencies' ttl_quantile, clamped
    p_return: float  # share of the latencies within the TTL (ttl_quantile under the prior)
    hold_s: float  # mean of min(latency, TTL): how long a pin is expected to hold (the TTL under the prior)
    mean_s: float  # mean latency: the expected pause (the TTL under the prior)


class ToolLatencies:
    """Tool latencies learned online from tool-call events (see the module docstring)."""

    def __init__(
        self,
        *,
        ttl_quantile: float = 0.9,
        prior_ttl_s: float = 2.0,
        min_observations: int = 5,
        window: int = 256,
        min_ttl_s: float = 0.05,
        max_ttl_s: float = 60.0,
    ) -> None:
        self.ttl_quantile = check_number("ttl_quantile", ttl_quantile, hi=1.0)
        self.prior_ttl_s = check_number("prior_ttl_s", prior_ttl_s)
        self.min_observations = check_count("min_observations", min_observations)
        self.window = check_count("window", window)
        self.min_ttl_s = check_number("min_ttl_s", min_ttl_s)
        self.max_ttl_s = check_number("max_ttl_s", max_ttl_s)
        if self.max_ttl_s < self.min_ttl_s:
            raise ValueError("option max_ttl_s must be >= min_ttl_s")
        self._lat: dict[Optional[str], deque] = {}
        self._all: deque = deque(maxlen=self.window)
        self._stats: dict[Optional[str], ToolStats] = {}
        self._mean: dict[Optional[str], tuple[float, int]] = {}  # tool -> (mean of every latency, latencies seen)
        self._paused: dict[str, tuple[Optional[str], float]] = {}  # session -> (tool, started at)

    def on_event(self, event: Event) -> None:
        """Start a session's clock at ``TOOL_CALL_STARTED``, stop it (one observation) at ``TOOL_CALL_ENDED``."""
        sid = event.meta.session_id
        if sid is None:
            return
        kind = event.kind
        if kind is _STARTED:
            if len(self._paused) >= MAX_SESSIONS:
                del self._paused[next(iter(self._paused))]
            self._paused[sid] = (event.meta.tool, event.time_s)
        elif kind is _ENDED:
            p = self._paused.pop(sid, None)
            if p is not None:
                self.observe(p[0], event.time_s - p[1])

    def observe(self, tool: Optional[str], latency_s: float) -> None:
        """One latency of ``tool`` (negative or non-finite ones are ignored)."""
        if not (latency_s >= 0.0 and math.isfinite(latency_s)):
            return
        d = self._lat.get(tool)
        if d is None:
            d = self._lat[tool] = deque(maxlen=self.window)
        d.append(latency_s)
        self._all.append(latency_s)
        self._stats.clear()
        mean, n = self._mean.get(tool, (0.0, 0))
        n += 1
        self._mean[tool] = (mean + (latency_s - mean) / n, n)

    def mean_s(self, tool: Optional[str]) -> Optional[float]:
        """The mean of every latency of ``tool`` seen so far (not only the window's); ``None`` before one."""
        m = self._mean.get(tool)
        return m[0] if m is not None else None

    def paused_since_s(self, session_id: Optional[str]) -> Optional[float]:
        """When the session's current tool call started; ``None`` when it is not paused (as far as we saw)."""
        p = self._paused.get(session_id) if session_id is not None else None
        return p[1] if p is not None else None

    def samples(self, tool: Optional[str]) -> Optional[Sequence[float]]:
        """The latencies that stand for ``tool``: its own, else the pooled ones; ``None`` under the prior."""
        obs = self._lat.get(tool)
        if obs is None or len(obs) < self.min_observations:
            obs = self._all if len(self._all) >= self.min_observations else None
        return obs

    def stats(self, tool: Optional[str]) -> ToolStats:
        """TTL, return chance, expected hold and expected pause of a pause on ``tool`` (cached until the next
        observation)."""
        st = self._stats.get(tool)
        if st is not None:
            return st
        obs = self.samples(tool)
        if obs is None:
            ttl = min(max(self.prior_ttl_s, self.min_ttl_s), self.max_ttl_s)
            st = ToolStats(ttl, self.ttl_quantile, ttl, ttl)
        else:
            xs = list(obs)
            ttl = min(max(quantile(xs, self.ttl_quantile), self.min_ttl_s), self.max_ttl_s)
            p = sum(1 for x in xs if x <= ttl) / len(xs)
            hold = sum(min(x, ttl) for x in xs) / len(xs)
            st = ToolStats(ttl, p, hold, sum(xs) / len(xs))
        self._stats[tool] = st
        return st

    def expected_remaining_s(self, tool: Optional[str], elapsed_s: float) -> float:
        """Expected rest of a pause on ``tool`` that has lasted ``elapsed_s``: the mean of ``x - elapsed`` over
        the learned latencies ``x >= elapsed`` (the mean residual life; the mean at 0), ``inf`` when the
        pause outlasted every one of them. Under the prior the pause is taken as memoryless: the prior, however
        long it has lasted."""
        obs = self.samples(tool)
        if obs is None or elapsed_s <= 0.0:
            return self.stats(tool).mean_s
        rest = [x - elapsed_s for x in obs if x >= elapsed_s]
        return sum(rest) / len(rest) if rest else math.inf


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
