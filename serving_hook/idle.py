"""Waiting out an engine step in which every waiting request is held back and nothing runs.

vLLM's engine loop (``EngineCoreProc.run_busy_loop``, ``v1/engine/core.py``) steps as long as the scheduler
has requests, so an engine whose only requests are held by the admission lever would run empty steps back to
back (~500/s here), and every step wakes the model workers, which then busy-poll their message queue for a
second. Instead the hook waits inside ``schedule()`` until something can change what the policy decides:

* a new input to the engine: a request, an abort, a utility call, or the shutdown signal's wake-up. The
  engine process receives them on ``EngineCoreProc.input_queue`` (a ``queue.Queue`` its input thread fills);
  the hook waits on that queue's condition and takes nothing from it;
* the first hold's release by the starvation bound (``max_hold_s``), never later.

The queue is found when the scheduler is built: ``EngineCoreProc.__init__`` sets ``self.input_queue`` before
``EngineCore.__init__`` builds the scheduler (vLLM 0.32 and 0.33), so the constructing frame holds it. An
in-process engine has no such queue: the hook then waits a short, growing interval (``fallback_s``).
"""

from __future__ import annotations

import queue
import sys
import time
from typing import Any, Optional

#: Frames above the scheduler's constructor searched for the engine process (mixin, Scheduler, EngineCore).
_MAX_FRAMES = 12


def engine_input_queue() -> Optional[queue.Queue]:
    """The input queue of the engine process constructing the calling scheduler, or None (in-process engines)."""
    frame: Any = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        q = getattr(frame.f_locals.get("self"), "input_queue", None)
        if isinstance(q, queue.Queue):
            return q
        frame = frame.f_back
    return None


def wait_for_input(inputs: queue.Queue, timeout_s: float) -> bool:
    """Block until ``inputs`` holds an item or ``timeout_s`` passed; takes nothing. True if an input is there."""
    deadline = time.monotonic() + timeout_s
    with inputs.not_empty:  # its lock is the queue's mutex: read the deque directly (qsize() would take it again)
        while not inputs.queue:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            inputs.not_empty.wait(left)
    return True
