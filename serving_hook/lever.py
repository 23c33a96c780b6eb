"""The base of kvpilot's levers: what the scheduler gives each one.

A lever is one module of ``serving_hook`` (:mod:`~serving_hook.admission`, :mod:`~serving_hook.preemption`,
:mod:`~serving_hook.retention`, :mod:`~serving_hook.eviction`) with one :class:`Lever` subclass that holds its
state. The scheduler (:mod:`serving_hook.scheduler`) builds it, only when the policy uses it, with the parts
all levers share, and calls it where vLLM decides. A lever depends on these parts, never on the scheduler
class.
"""

from __future__ import annotations

from policy.interface import Policy
from serving_hook.guard import Guard
from serving_hook.rows import Rows
from serving_hook.translate import EngineView, Translator


class Lever:
    """One lever's state, over the parts the scheduler shares among its levers."""

    def __init__(self, sched: EngineView, policy: Policy, guard: Guard, tr: Translator, rows: Rows) -> None:
        self.sched = sched  # the vLLM scheduler, read at each use (vLLM re-binds some of its attributes)
        self.policy = policy
        self.guard = guard  # every policy call goes through guard.decide (budget, type check, fallback)
        self.tr = tr  # requests as plain records
        self.rows = rows  # decision rows
        self.stats = guard.stats
