"""Tool latencies learned online from tool-call events, and what they say of a paused session (:class:`ToolLatencies`).

``TOOL_CALL_STARTED`` (a turn with tool metadata finished) starts a clock for its session, ``TOOL_CALL_ENDED`` (the
session's next turn arrived) stops it. The last ``window`` latencies of each tool (and of all tools together) are
kept; with fewer than ``min_observations`` for a tool the pooled ones stand in, and with fewer than that too, the
prior ``prior_ttl_s``. From them it gives a pin's TTL (the ``ttl_quantile``, clamped to ``[min_ttl_s, max_ttl_s]``),
the chance the tool returns within it, the expected hold, and the expected (remaining) pause; and each tool's mean
over every latency seen (:meth:`ToolLatencies.mean_s`). Read by the baselines that act on tool pauses and by the
learned policy's CPU-tier order (:mod:`policy.session_reuse`). Plain Python, no vLLM.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from policy.interface import Event, EventKind
from policy.options import check_count, check_number

__all__ = ["MAX_SESSIONS", "quantile", "ToolStats", "ToolLatencies"]

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
