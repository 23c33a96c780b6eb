"""Admit a new agent session only when the active sessions' working sets leave room for it, after Denning.

**Idea and source.** Denning's working-set principle (P. J. Denning, "The working set model for program
behavior", CACM 1968; "Thrashing: its causes and prevention", AFIPS 1968): a program runs efficiently only
with its working set resident, and a system thrashes when the working sets of the programs it runs exceed
memory. The cure is load control: admit a program only when its working set fits beside those already
active. For agent sessions the working set is the session's KV context, held from its first turn to its
last, including its tool pauses (the next turn reads it all again).

**Mechanism as implemented.**

* *Sessions, from events.* A session is active from its first ``SCHEDULED`` (admitted) until a
  ``FINISHED`` whose ``finish_reason`` is not ``tool_call`` (a turn that ended in a tool call pauses the
  session, which will return; ``abort`` ends it too). Its working set is its latest context, prompt plus
  output tokens of its latest event, in blocks.
* *Expected working set of a new session* (the first turn of a session not active): the mean final
  context of the last ``window`` finished sessions of its domain (all domains' with fewer than
  ``min_observations`` of its own), and with fewer than that too, its prompt times ``growth_prior``; never
  less than its own prompt.
* *Admission.* Returning turns (of an active session, or a later turn of a session not seen) and requests
  without a session are never held and come first, in vLLM's order. New sessions follow in arrival
  order, each admitted while ``active + admitted + its expected working set <= target_fraction x
  num_total_blocks``; the first that does not fit and all after it are held (no overtaking, so a large
  session is not starved by smaller ones). ``active`` is the larger of the active sessions' working sets and
  the blocks in use now (``num_total_blocks - num_free_blocks``, which covers requests without a session).
  With no session active and none admitted yet, the first new session is admitted even if it does not fit,
  so the policy never holds everything (liveness does not rest on the hook's maximum hold time).
* *Retention.* A paused session's blocks are part of its working set: ``PROTECT`` with a TTL learned as
  continuum does (:mod:`policy.tool_latency`), released once its next turn is scheduled. With
  ``offload`` (``working-set-offload``), a paused prefix whose pin would take the pinned blocks past half
  of the KV cache is ``OFFLOAD`` ed instead (its return loads from the CPU tier).

**Simplified.** Denning measures a working set over a recent reference window; here it is the whole
context (every turn re-reads it). A running turn's context is counted as of its latest event (its prompt
while it decodes). The paused sessions' memory is protected only up to the hook's
``KVPILOT_MAX_PINNED_FRACTION``. Deterministic (propensity 1.0).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any, Optional

from policy.baselines._tool_pauses import PauseEventsMixin, SessionPins
from policy.interface import (
    AdmissionDecision,
    CachedPrefix,
    CandidateRequest,
    EngineState,
    Event,
    EventKind,
    OwnerState,
    Policy,
    Retention,
    RetentionAction,
    RetentionDecision,
)
from policy.options import check_number
from policy.tool_latency import MAX_SESSIONS, ToolLatencies

__all__ = ["WorkingSetAdmissionPolicy", "WorkingSetOffloadPolicy"]


class WorkingSetAdmissionPolicy(PauseEventsMixin, Policy):
    """Hold new sessions whose expected working set does not fit beside the active ones; pin paused sessions.

    ``latency_options`` (``ttl_quantile``, ``prior_ttl_s``, ``min_observations``, ``window``, ``min_ttl_s``,
    ``max_ttl_s``) configure the learned tool latencies (:class:`policy.tool_latency.ToolLatencies`);
    ``min_observations`` and ``window`` also apply to the learned final contexts.
    """

    name = "working-set"
    version = "1"
    uses_admission = True
    uses_retention = True
    uses_events = True
    session_fields = ("_active", "_final", "_final_all")  # carried over at a hot swap (PauseEventsMixin)

    def __init__(
        self, target_fraction: float = 0.9, growth_prior: float = 4.0, offload: bool = False, **latency_options: Any
    ) -> None:
        self.latencies = ToolLatencies(**latency_options)
        self.target_fraction = check_number("target_fraction", target_fraction, hi=1.0)
        self.growth_prior = check_number("growth_prior", growth_prior, lo=1.0, allow_lo=True)
        if not isinstance(offload, bool):
            raise ValueError(f"option offload must be true or false, got {offload!r}")
        self.uses_offload = offload
        self.pins = SessionPins()
        self._active: dict[str, int] = {}  # session -> latest context (tokens)
        self._final: dict[Optional[str], deque] = {}  # domain -> final contexts (tokens) of finished sessions
        self._final_all: deque = deque(maxlen=self.latencies.window)

    # ------------------------------------------------------ working sets
    def active_blocks(self, block_size: int) -> int:
        """The active sessions' working sets, in blocks."""
        return sum(math.ceil(t / block_size) for t in self._active.values())

    def expected_blocks(self, c: CandidateRequest, block_size: int) -> int:
        """A new session's expected working set in blocks (module docstring)."""
        obs = self._final.get(c.meta.domain)
        if obs is None or len(obs) < self.latencies.min_observations:
            obs = self._final_all if len(self._final_all) >= self.latencies.min_observations else None
        tokens = sum(obs) / len(obs) if obs is not None else c.num_prompt_tokens * self.growth_prior
        return math.ceil(max(c.num_prompt_tokens, tokens) / block_size)

    # ------------------------------------------------------------- levers
    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        bs = state.block_size
        order: list[str] = []
        new: list[CandidateRequest] = []
        for c in waiting:
            sid = c.meta.session_id
            if sid is None or sid in self._active or c.turn > 0:
                order.append(c.request_id)
            else:
                new.append(c)
        if not new:
            return None
        new.sort(key=lambda c: c.arrival_s)
        budget = self.target_fraction * state.num_total_blocks
        load = max(self.active_blocks(bs), state.num_total_blocks - state.num_free_blocks)
        hold: list[str] = []
        first = not self._active  # nothing active: the first new session goes in even if it does not fit
        for c in new:
            need = self.expected_blocks(c, bs)
            if not hold and (first or load + need <= budget):
                order.append(c.request_id)
                load += need
                first = False
            else:
                hold.append(c.request_id)
        return AdmissionDecision(order=order, hold=frozenset(hold))

    def retain(self, prefixes: Sequence[CachedPrefix], state: EngineState) -> Optional[RetentionDecision]:
        actions: dict[str, Retention] = {}
        pinned = state.num_pinned_blocks
        for p in prefixes:
            if p.protected_until_s is not None or p.owner_state is not OwnerState.PAUSED_TOOL:
                continue
            if self.uses_offload and pinned + p.num_blocks > state.num_total_blocks / 2:
                actions[p.prefix_id] = Retention(RetentionAction.OFFLOAD)
                continue
            actions[p.prefix_id] = Retention(RetentionAction.PROTECT, ttl_s=self.latencies.stats(p.meta.tool).ttl_s)
            self.pins.add(p)
            pinned += p.num_blocks
        release = self.pins.settle(prefixes, actions)
        if not actions and not release:
            return None
        return RetentionDecision(actions=actions, release=release)

    def on_event(self, event: Event) -> None:
        super().on_event(event)
        sid = event.meta.session_id
        if sid is None:
            return
        tokens = event.num_prompt_tokens + event.num_output_tokens
        if sid not in self._active:
            if event.kind is EventKind.SCHEDULED:
                if len(self._active) >= MAX_SESSIONS:
                    del self._active[next(iter(self._active))]
                self._active[sid] = tokens
        elif event.kind is EventKind.FINISHED and event.finish_reason != "tool_call":
            del self._active[sid]
            self._observe_final(event.meta.domain, tokens)
        else:
            self._active[sid] = max(self._active[sid], tokens)

    def _observe_final(self, domain: Optional[str], tokens: int) -> None:
        d = self._final.get(domain)
        if d is None:
            d = self._final[domain] = deque(maxlen=self.latencies.window)
        d.append(tokens)
        self._final_all.append(tokens)


class WorkingSetOffloadPolicy(WorkingSetAdmissionPolicy):
    """``working-set`` with the CPU offload tier (``offload=True``): its engines are built with vLLM's offloading."""

    name = "working-set-offload"

    def __init__(self, **options: Any) -> None:
        super().__init__(offload=True, **options)
