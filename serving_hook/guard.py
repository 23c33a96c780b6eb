"""Failure isolation of the hook: the step's time budget, fallback to vLLM's behaviour, counting, log-once.

Every policy call of the hook goes through one :class:`Guard` per scheduler. A decision call
(:meth:`Guard.decide`: admit, preempt, retain, evict) is timed against the step's budget. An exception,
a call that returns after the budget is spent, or an answer of the wrong type is discarded: that
decision, and the rest of the step's decisions, fall back to vLLM's behaviour; the failure kind is logged
once (logger ``kvpilot.hook``), counted in :class:`HookStats` (``fallbacks``) and flagged in the step's
``steps`` telemetry row (``hook_fallback``). Events (:meth:`Guard.notify`) cannot be discarded, but their
time counts against the budget. Internal errors of the hook itself (:meth:`Guard.internal_error`) are
handled the same way. Nothing here raises into vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from policy.interface import Event, Policy

logger = logging.getLogger("kvpilot.hook")

_perf = time.perf_counter

D = TypeVar("D")


@dataclass
class HookStats:
    """Counters the hook keeps for tests, benchmarks and telemetry."""

    steps: int = 0
    fallback_steps: int = 0
    fallbacks: dict = field(default_factory=dict)  # "method:kind" -> count
    #: steps whose events after their last decision (scheduled, finished) overran the budget: nothing fell back
    late_event_overruns: int = 0
    policy_calls: int = 0
    preemptions: int = 0
    policy_victims: int = 0  # preemptions whose victim the policy moved
    admission_reorders: int = 0
    held: int = 0  # requests held back, summed over steps
    hold_overridden: int = 0  # holds the starvation bound (max_hold_s) refused
    idle_held_steps: int = 0  # steps that ran nothing because every waiting request was held
    idle_wait_s: float = 0.0  # time the engine waited after such steps instead of spinning
    offloaded: int = 0  # prefixes the policy sent to the CPU tier (OFFLOAD)
    offload_unavailable: int = 0  # OFFLOAD answers without a tier (applied as KEEP)
    protected: int = 0
    demoted_blocks: int = 0
    eviction_calls: int = 0  # evict() asked (at most once per step, only when LRU would evict)
    eviction_orders: int = 0  # evict() answers that moved blocks
    evict_first_blocks: int = 0  # blocks moved to the head of the free list by evict()
    host_evict_calls: int = 0  # evict_host() asked (the CPU tier full, at most once per step)
    host_evicted_listed: int = 0  # host-tier chunks evicted in the policy's order (the rest: LRU)
    host_bypassed: int = 0  # stores skipped: the storer came first in the policy's host-tier order
    prefix_queries: int = 0
    prefix_hits: int = 0
    hook_time_s: float = 0.0  # the hook's own time in its schedule() (telemetry-enabled or policy mode)
    last_hook_time_s: float = 0.0
    #: the hook's own time elsewhere on the engine thread: arrivals, events, finishes, frees, preemptions and the
    #: CPU tier's store misses and reuses (with hook_time_s: kvpilot's time in the engine, but for the tier's
    #: per-chunk insert / remove bookkeeping, not timed there: benchmarks/bench_host_tier.py measures it)
    side_time_s: float = 0.0
    model_version: Optional[str] = None  # policy ``registry``: the registry version served (None: none yet)
    model_swaps: int = 0  # policy ``registry``: versions swapped in after start-up
    model_failures: int = 0  # policy ``registry``: model loads and polls that failed (each logged once per model)
    state_carried: int = 0  # swaps that handed the old model's session state to the new one
    state_dropped: int = 0  # swaps whose state the new model could not take (logged; it started afresh)
    #: requests by where their session came from: typed, kv_hints, extra_args, chain (continued), new (opened)
    session_sources: dict = field(default_factory=dict)


class Guard:
    """The engine step's context: its number, time budget and fallback flag; every policy call passes here."""

    def __init__(self, policy: Policy, stats: HookStats, budget_s: float) -> None:
        self.policy = policy
        self.stats = stats
        self.budget_s = budget_s  # the policy's time per step (set again after a model swap)
        self.budget_left = budget_s
        self.step_no = 0
        self.fallback = False  # this step falls back to vLLM's behaviour (no further policy decision)
        self.decided = False  # vLLM's schedule() has returned: the step takes no further decision
        self._late = False  # this step's late event overrun is counted
        self.inner_s = 0.0  # the hook's time inside vLLM's schedule() this step (allocate wrapper, eviction)
        self._logged: set[str] = set()

    def begin_step(self) -> None:
        """A new engine step: next number, full budget, no fallback yet."""
        self.step_no += 1
        self.fallback = self.decided = self._late = False
        self.budget_left = self.budget_s

    def decide(self, what: str, fn: Callable[..., Any], kind: type[D], *args: Any) -> Optional[D]:
        """``fn(*args)`` under the step's budget: its decision, or None to keep vLLM's behaviour.

        None when the step has already fallen back, when the call raises, overruns the budget or
        returns something other than a ``kind`` (the step falls back), or when it returns None.
        """
        if self.fallback:
            return None
        self.stats.policy_calls += 1
        t = _perf()
        try:
            dec = fn(*args)
        except Exception as e:
            self.fail(what, "exception", e)
            return None
        finally:
            dt = _perf() - t
            self.budget_left -= dt
        if self.budget_left < 0:
            self.fail(what, "overrun", f"{dt * 1e3:.2f} ms; step budget {self.budget_s * 1e3:.2f} ms")
            return None
        if dec is None or isinstance(dec, kind):
            return dec
        self.fail(what, "exception", TypeError(f"{what}() returned {type(dec).__name__}"))
        return None

    def notify(self, ev: Event, budgeted: bool = True) -> None:
        """Give the policy an event; ``budgeted``: its time counts against the step's budget."""
        t = _perf()
        try:
            self.policy.on_event(ev)
        except Exception as e:
            self.fail("on_event", "exception", e)
        if not budgeted:  # arrivals come between engine steps
            return
        # Events cannot be discarded, but their time counts against the step's budget.
        self.budget_left -= _perf() - t
        if self.budget_left < 0 and not self.fallback and not self._late:
            if not self.decided:
                self.fail("on_event", "overrun", f"step budget {self.budget_s * 1e3:.2f} ms")
                return
            # after the step's last decision nothing is left to fall back: counted, and logged once
            self._late = True
            self.stats.late_event_overruns += 1
            if "on_event:late" not in self._logged:
                self._logged.add("on_event:late")
                logger.warning("kvpilot: policy %s's events after the step's decisions overran its time budget "
                               "(step budget %.2f ms); the step's decisions stand. Logged once; further overruns "
                               "are counted (late_event_overruns).", self.policy.name, self.budget_s * 1e3)

    def skip(self, key: str) -> None:
        """Fall back for this step without a failure to log (counted under ``key``)."""
        st = self.stats
        st.fallbacks[key] = st.fallbacks.get(key, 0) + 1
        self.fallback = True

    def _first(self, key: str) -> bool:
        """Count ``key`` and fall back; whether it is the first time (to log)."""
        self.skip(key)
        if key in self._logged:
            return False
        self._logged.add(key)
        return True

    def fail(self, what: str, kind: str, detail: Any) -> None:
        """The policy failed in ``what`` (``kind``: exception or overrun): fall back, count, log once."""
        if self._first(f"{what}:{kind}"):
            logger.warning(
                "kvpilot: policy %s %s in %s (%s); this step falls back to vLLM's behaviour. "
                "Logged once per served policy; further failures are only counted.",
                self.policy.name,
                "raised" if kind == "exception" else "overran its time budget",
                what,
                detail if kind != "exception" else repr(detail),
            )

    def new_policy(self) -> None:
        """Another policy decides from now on (a hot swap): its failures are logged once again."""
        self._logged = {k for k in self._logged if k.startswith("hook:")}

    def internal_error(self, where: str, e: BaseException) -> None:
        """The hook itself failed in ``where``: fall back, count, log once (with the traceback)."""
        if self._first(f"hook:{where}"):
            logger.exception("kvpilot: internal error in %s; falling back to vLLM's behaviour (logged once)", where)
