"""The simulation's clock: one heap of timed events that drives every replica and driver.

Time
----
A heap of ``(time, priority, seq, event)`` drives all replicas; ``seq`` (the
push order) breaks ties, so a run is deterministic. Each replica also keeps
its own clock (:class:`simulator.replica.Replica`), which engine steps advance.
At equal time, arrivals and step ends come before the start of an idle
replica's next step (a kick), so same-instant requests join one step.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["ARRIVE", "FOLLOW_UP", "KICK", "RELEASE", "STEP_END", "SYNC_END", "TRAIN_END", "VERIFIED", "EventClock"]

#: Event kinds: a request arrives (its workload row), a replica's engine step ends or its next one may start
#: (the replica), a verification or scoring parse ends (the trajectory), an RL step is released (its index);
#: the asynchronous driver's trainer ends a training step, or a weight update ends (:mod:`simulator.async_rl`);
#: the client has a finished request's response, a round trip after the engine finished it (its trajectory, row).
ARRIVE, STEP_END, VERIFIED, RELEASE, KICK, TRAIN_END, SYNC_END, FOLLOW_UP = range(8)
_PRIORITY = (0, 0, 0, 0, 1, 0, 0, 0)  # by kind: lower first at equal time


class EventClock:
    """The event heap; :meth:`run` pops events in time order and hands each to its kind's handler."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0

    def push(self, t: float, kind: int, arg: Any) -> None:
        """Schedule event ``kind`` with ``arg`` at time ``t``."""
        self._seq += 1
        heapq.heappush(self._heap, (t, _PRIORITY[kind], self._seq, kind, arg))

    def pending(self) -> Iterator[tuple[int, Any]]:
        """(kind, arg) of every event not yet run, in no particular order."""
        return ((e[3], e[4]) for e in self._heap)

    def run(self, handlers: Sequence[Callable[[Any, float], None]]) -> None:
        """Run events until none is left: ``handlers[kind](arg, t)``; handlers may push more."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            t, _, _, kind, arg = pop(heap)
            handlers[kind](arg, t)
