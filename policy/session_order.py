"""Program order: each session's first arrival, shared by ``continuum``'s admission and the learned policy's
``sessions`` order.

A waiting request ranks by its session's first arrival (a request without a session by its own), then by the order
its session was first seen, then by its own arrival: a returning turn keeps its program's place, so a session is
served to its end before a later one takes memory. The order first seen breaks ties of one arrival stamp (a client
that sends a batch at once, a simulator that releases a step at one instant), so the order is session by session
either way. State is bounded: beyond ``max_sessions`` the session first seen earliest is forgotten.
"""

from __future__ import annotations

from collections.abc import Sequence

from policy.interface import CandidateRequest
from policy.tool_latency import MAX_SESSIONS


class SessionArrivals:
    """Each session's (first arrival, the order it was first seen in)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        #: session_id -> (first arrival, the order first seen), the earliest seen first
        self.first: dict[str, tuple[float, int]] = {}
        self.seen = 0

    def key(self, c: CandidateRequest) -> tuple[float, int, float]:
        """``c``'s place in program order (ascending): its session's (first arrival, order first seen), its own
        arrival. A request without a session ranks by its own arrival."""
        sid = c.meta.session_id
        if sid is None:
            return c.arrival_s, -1, c.arrival_s
        first = self.first
        got = first.get(sid)
        if got is None:
            if len(first) >= self.max_sessions:
                del first[next(iter(first))]
            first[sid] = got = (c.arrival_s, self.seen)
            self.seen += 1
        elif c.arrival_s < got[0]:  # an earlier turn seen late: the session's arrival moves back
            first[sid] = got = (c.arrival_s, got[1])
        return got[0], got[1], c.arrival_s

    def order(self, waiting: Sequence[CandidateRequest]) -> list[int]:
        """Positions of ``waiting`` in program order (the module docstring), ties in position order."""
        keys = [self.key(c) for c in waiting]
        return sorted(range(len(keys)), key=keys.__getitem__)
