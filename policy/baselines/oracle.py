"""The hindsight oracle: true lengths for admission, Belady for eviction. A reference, not deployable.

**Idea and source.** An upper reference built from what a simulator knows
in hindsight: every request's true output length, and when each cached
prefix will be needed again. Belady's MIN rule (evict the entry whose next
use is furthest in the future) is the optimal eviction for unit-size entries;
shortest-remaining-processing-time first (SRPT) is the classic hindsight
admission rule for mean completion time. "Tail-aware scheduling" (arXiv
2606.18431) shows that even perfect lengths lose at p99 once memory pressure
couples decode dynamics; kvpilot's learned policy is measured against this
reference, and can imitate it offline.

**Mechanism as implemented.** Built from the simulated ``workload`` (the
registry passes it; without one the factory fails):

* *Admission* (``admission``): ``"srpt"`` (default) orders waiting requests
  by true remaining output (``output_tokens - generated``, from
  :class:`policy.predictors.OracleLengthPredictor`), shortest first, ties by
  arrival; ``"lpt"`` longest first (the classic makespan heuristic for a
  synchronous RL step); ``"fcfs"`` keeps vLLM's order (isolates the cache
  levers). SRPT is the default because it is the hindsight rule the field
  compares against; which rule gives the best makespan on a given workload is
  an empirical question for the simulator runs: compare ``srpt`` and ``lpt``
  there and report the better one as the reference.
* *Eviction*: Belady. Every cached prefix is a candidate; its next use comes
  from :class:`policy.predictors.OracleReusePredictor` (the first future
  request sharing its leading block, timed from the workload's tool
  latencies and the observed finish times; see there for what is estimated),
  and the order is furthest first, never-used-again first, ties by LRU.
* *Retention*: a prefix whose owner paused on a tool is pinned when its next
  use (the session's next turn: owner finish + the tool's true latency) falls
  within ``max_ttl_s``; the TTL is the time to that use plus
  ``ttl_margin_s``. A pinned prefix is released as soon as its next use is
  beyond ``max_ttl_s`` (typically: the next turn was scheduled and took its
  own references) and renewed if its next use moved later. With
  ``demote_unused=True``, a freed prefix that nothing will use again is
  demoted at once (evicted first).

**Simplified.** Next-use times of requests that have not arrived are
estimated without generation and queueing time (they depend on the
schedule): far uses look nearer than they are. Belady is optimal for
equal-size entries only; prefixes here differ in size and share blocks.
Preemption is left to vLLM. Deterministic (propensity 1.0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

from policy.baselines._common import resolve_length_predictor
from policy.baselines._eviction import furthest_first, resolve_reuse_predictor
from policy.interface import (
    AdmissionDecision,
    CachedPrefix,
    CandidateRequest,
    EngineState,
    Event,
    EvictionDecision,
    OwnerState,
    Policy,
    Retention,
    RetentionAction,
    RetentionDecision,
)

ADMISSION_RULES = ("srpt", "lpt", "fcfs")


class HindsightOraclePolicy(Policy):
    """True lengths for admission (SRPT), Belady's next use for eviction, pins for known returns."""

    name = "oracle"
    version = "1"
    uses_admission = True
    uses_retention = True
    uses_eviction = True
    uses_events = True
    #: A reference, not deployable: its look-ups may take longer than a serving
    #: policy's (an overrun would silently turn it into LRU for that step). The
    #: simulator charges engine time by its cost model, not by wall time.
    decision_budget_s = 0.1

    def __init__(
        self,
        admission: str = "srpt",
        max_ttl_s: float = 60.0,
        ttl_margin_s: float = 0.5,
        demote_unused: bool = False,
        length_predictor: Any = "oracle",
        reuse_predictor: Any = "oracle",
        workload: Any = None,
    ) -> None:
        if admission not in ADMISSION_RULES:
            raise ValueError(f"option admission must be one of {', '.join(ADMISSION_RULES)}, got {admission!r}")
        for name, v in (("max_ttl_s", max_ttl_s), ("ttl_margin_s", ttl_margin_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"option {name} must be a finite number >= 0, got {v!r}")
        self.admission = admission
        self.uses_admission = admission != "fcfs"
        self.max_ttl_s = float(max_ttl_s)
        self.ttl_margin_s = float(ttl_margin_s)
        self.demote_unused = bool(demote_unused)
        self.lengths = resolve_length_predictor(length_predictor, workload, policy=type(self).__name__)
        self.reuse = resolve_reuse_predictor(reuse_predictor, workload, policy=type(self).__name__)

    # ------------------------------------------------------------ admission
    def remaining(self, waiting: Sequence[CandidateRequest]) -> list[float]:
        """True remaining output tokens (inf when the workload does not know the request)."""
        preds = self.lengths.predict(waiting)
        return [max(0.0, float(p[0]) - c.num_output_tokens) for c, p in zip(waiting, preds)]

    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        if self.admission == "fcfs" or not waiting:
            return None
        rem = self.remaining(waiting)
        if self.admission == "lpt":
            # longest first; unknown lengths (inf) go last, in arrival order
            keys = [(0 if math.isfinite(r) else 1, -r if math.isfinite(r) else 0.0, c.arrival_s, i)
                    for i, (c, r) in enumerate(zip(waiting, rem))]
        else:
            keys = [(0, r, c.arrival_s, i) for i, (c, r) in enumerate(zip(waiting, rem))]
        keys.sort()
        return AdmissionDecision(order=[waiting[k[-1]].request_id for k in keys])

    # ------------------------------------------------------------ retention
    def retain(self, prefixes: Sequence[CachedPrefix], state: EngineState) -> Optional[RetentionDecision]:
        if not prefixes:
            return None
        now = state.time_s
        nxt = self.reuse.next_use_s(prefixes, now)
        actions: dict[str, Retention] = {}
        release = []
        for p, t in zip(prefixes, nxt):
            dt = t - now
            if p.protected_until_s is not None:
                if not dt <= self.max_ttl_s:
                    release.append(p.prefix_id)
                elif t + self.ttl_margin_s > p.protected_until_s:
                    actions[p.prefix_id] = Retention(RetentionAction.PROTECT, ttl_s=max(dt, 0.0) + self.ttl_margin_s)
                continue
            if p.owner_state is OwnerState.PAUSED_TOOL and dt <= self.max_ttl_s:
                actions[p.prefix_id] = Retention(RetentionAction.PROTECT, ttl_s=max(dt, 0.0) + self.ttl_margin_s)
            elif self.demote_unused and math.isinf(t):
                actions[p.prefix_id] = Retention(RetentionAction.DEMOTE)
        if not actions and not release:
            return None
        return RetentionDecision(actions=actions, release=frozenset(release))

    # ------------------------------------------------------------- eviction
    def evict(self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int, state: EngineState):
        if not prefixes:
            return None
        return EvictionDecision(order=furthest_first(prefixes, self.reuse.next_use_s(prefixes, state.time_s)))

    def on_event(self, event: Event) -> None:
        self.reuse.observe(event)
        obs = getattr(self.lengths, "observe", None)
        if obs is not None:
            obs(event)
