"""How far each trajectory has come: heddle's progress score, shared by ``heddle`` and the learned policy's
``progress`` admission order.

A session's progress, in tokens, is ``turn_weight_tokens * turn + output tokens of its finished turns + this turn's
output so far``, where ``turn`` is the larger of the request's ``turn`` metadata and the session's turns seen
finishing (from ``FINISHED`` events). State is bounded: beyond ``max_sessions`` the least recently updated session
is forgotten first.
"""

from __future__ import annotations

from collections.abc import Sequence

from policy.interface import CandidateRequest, Event, EventKind

#: Heddle's default weight of a turn, in tokens.
TURN_WEIGHT_TOKENS = 512.0


class SessionProgress:
    """Each session's (turns finished, output tokens of finished turns), kept from ``FINISHED`` events."""

    def __init__(self, turn_weight_tokens: float = TURN_WEIGHT_TOKENS, max_sessions: int = 1 << 16) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"option max_sessions must be an integer >= 1, got {max_sessions!r}")
        self.turn_weight_tokens = float(turn_weight_tokens)
        self.max_sessions = max_sessions
        #: session_id -> [turns finished, output tokens of finished turns], least recently updated first
        self.sessions: dict[str, list] = {}

    def observe(self, event: Event) -> None:
        """Count a finished turn (an aborted one does not count)."""
        if event.kind is not EventKind.FINISHED:
            return
        sid = event.meta.session_id
        if sid is None or event.finish_reason == "abort":
            return
        s = self.sessions.pop(sid, None)  # re-inserted last: the least recently updated go first
        if s is None:
            if len(self.sessions) >= self.max_sessions:
                del self.sessions[next(iter(self.sessions))]
            s = [0, 0]
        s[0] = max(s[0], (event.meta.turn or 0) + 1)
        s[1] += event.num_output_tokens
        self.sessions[sid] = s

    def get(self, session_id: str) -> tuple[int, int]:
        """(turns finished, output tokens of finished turns) seen for a session."""
        s = self.sessions.get(session_id)
        return (s[0], s[1]) if s is not None else (0, 0)

    def score(self, c: CandidateRequest) -> float:
        """The candidate's trajectory's progress in tokens (see the module docstring)."""
        return self.scores([c])[0]

    def scores(self, cands: Sequence[CandidateRequest]) -> list[float]:
        """:meth:`score` of each candidate, in one pass (this runs for every waiting request of a decision)."""
        sessions, w = self.sessions, self.turn_weight_tokens
        out = []
        for c in cands:
            m = c.meta
            turn = m.turn or 0
            tokens = c.num_output_tokens
            sid = m.session_id
            if sid is not None:
                st = sessions.get(sid)
                if st is not None:
                    if st[0] > turn:
                        turn = st[0]
                    tokens += st[1]
            out.append(w * turn + tokens)
        return out
