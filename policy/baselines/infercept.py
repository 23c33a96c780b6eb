"""Preserve, swap or discard a paused request's KV by the least memory waste, after InferCept.

**Idea and source.** InferCept (Abhyankar et al., ICML 2024, "InferCept: Efficient Intercept Support for
Augmented LLM Inference") observes that when a request is intercepted (it pauses on a tool, another model
or a human), the engine either discards its KV (and recomputes it on return), preserves it in GPU memory
or swaps it to CPU memory, and that each wastes GPU memory over time differently. For every intercepted
request it picks the option with the least waste (GPU memory x time), from the expected interception
length and the context size, and re-evaluates the preserved requests at every iteration.

**Mechanism as implemented** (wastes in block-seconds, per freed prefix whose owner paused on a tool):

* *preserve*: ``E[pause_s] x blocks`` (the context's memory held idle for the pause);
* *discard*: ``blocks x block_size / prefill_tokens_per_s x max(blocks, in use)`` with ``in use =
  num_total_blocks - num_free_blocks``: the running batch stalls while the context is recomputed;
* *swap* (only when the engine has a CPU offload tier, ``num_offload_blocks > 0``, large enough for the
  context): ``blocks x offload_load_s_per_block x blocks`` (the context waits for its load).

Preserve answers ``PROTECT`` with a TTL (the ``ttl_quantile`` of the tool's learned latency, clamped:
continuum's, :mod:`policy.tool_latency`), discard ``DEMOTE`` (first in line for eviction), swap
``OFFLOAD`` (the GPU copy goes first; the return loads from the tier). Ties go to preserve, then swap. The
expected pause is the **mean** of the tool's learned latencies (the tool's, else all tools', else the
prior ``prior_ttl_s``).

*Re-evaluation.* At each ``retain()`` call, every prefix this policy still pins whose owner is still
paused is decided again with the *remaining* expected pause: the mean residual of the learned latencies
past the time already paused (``inf`` once it outlasted all of them; the prior, taken as memoryless,
does not shrink). When preserve is no longer the least waste, the pin becomes ``OFFLOAD`` or ``DEMOTE``
(the hook unpins and applies it). Pins are released once the session's next turn is scheduled, as
continuum does.

**Differs / simplified.** InferCept budgets its swap-out and swap-in to overlap with compute; here the
tier is vLLM's native KV offloading, whose store is write-through and asynchronous (no stall) and whose
load is asynchronous (only the returning request waits), so the swap waste is the load time times the
context alone, with no stall of the batch. Re-evaluation happens at the hook's ``retain()`` calls (a step
in which some request's blocks were freed), not at every iteration. Costs are the block-count model above,
not InferCept's profiled forward times; preserved memory is capped by the hook's
``KVPILOT_MAX_PINNED_FRACTION``. The ``offload`` option only declares that the policy wants the tier
(``uses_offload``: the simulator builds its engines with offloading; ``infercept-offload`` sets it); the
swap choice follows the tier the engine reports. Deterministic (propensity 1.0).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Optional

from policy.baselines._tool_pauses import PauseEventsMixin, SessionPins
from policy.interface import (
    CachedPrefix,
    EngineState,
    OwnerState,
    Policy,
    Retention,
    RetentionAction,
    RetentionDecision,
)
from policy.options import check_number
from policy.tool_latency import ToolLatencies

__all__ = ["Choice", "InterceptWastePolicy", "InterceptWasteOffloadPolicy"]


class Choice(str, enum.Enum):
    """InferCept's three options for an intercepted request's KV."""

    PRESERVE = "preserve"
    SWAP = "swap"
    DISCARD = "discard"


#: The retention action of a choice other than preserve (preserve is PROTECT with a TTL).
_ACTION = {Choice.SWAP: RetentionAction.OFFLOAD, Choice.DISCARD: RetentionAction.DEMOTE}


class InterceptWastePolicy(PauseEventsMixin, Policy):
    """Per paused prefix, the least-waste choice of preserve (pin), swap (offload) and discard (demote).

    ``latency_options`` (``ttl_quantile``, ``prior_ttl_s``, ``min_observations``, ``window``, ``min_ttl_s``,
    ``max_ttl_s``) configure the learned tool latencies (:class:`policy.tool_latency.ToolLatencies`).
    """

    name = "infercept"
    version = "1"
    uses_retention = True
    uses_events = True

    def __init__(self, prefill_tokens_per_s: float = 40000.0, offload: bool = False, **latency_options: Any) -> None:
        self.latencies = ToolLatencies(**latency_options)
        self.prefill_tokens_per_s = check_number("prefill_tokens_per_s", prefill_tokens_per_s)
        if not isinstance(offload, bool):
            raise ValueError(f"option offload must be true or false, got {offload!r}")
        self.uses_offload = offload
        self.pins = SessionPins()

    def wastes(self, num_blocks: int, pause_s: float, state: EngineState) -> dict[Choice, float]:
        """Each available choice's GPU memory waste (block-seconds) for a context of ``num_blocks`` paused for
        ``pause_s`` more seconds (module docstring), in the tie order: preserve, swap, discard."""
        out = {Choice.PRESERVE: pause_s * num_blocks}
        if state.num_offload_blocks >= num_blocks > 0:
            out[Choice.SWAP] = num_blocks * state.offload_load_s_per_block * num_blocks
        recompute_s = num_blocks * state.block_size / self.prefill_tokens_per_s
        out[Choice.DISCARD] = recompute_s * max(num_blocks, state.num_total_blocks - state.num_free_blocks)
        return out

    def choose(self, num_blocks: int, pause_s: float, state: EngineState) -> Choice:
        """The least-waste choice (ties: the first in :meth:`wastes`' order)."""
        w = self.wastes(num_blocks, pause_s, state)
        return min(w, key=w.__getitem__)

    def retain(self, prefixes: Sequence[CachedPrefix], state: EngineState) -> Optional[RetentionDecision]:
        actions: dict[str, Retention] = {}
        for p in prefixes:
            if p.owner_state is not OwnerState.PAUSED_TOOL:
                continue
            if p.protected_until_s is None:
                ret: Optional[Retention] = self._intercepted(p, state)
            elif p.prefix_id in self.pins:
                ret = self._reevaluated(p, state)
            else:
                continue
            if ret is not None:
                actions[p.prefix_id] = ret
        release = self.pins.settle(prefixes, actions)
        if not actions and not release:
            return None
        return RetentionDecision(actions=actions, release=release)

    def _intercepted(self, p: CachedPrefix, state: EngineState) -> Retention:
        """A prefix just freed by a paused turn: the least-waste choice for the expected (mean) pause."""
        st = self.latencies.stats(p.meta.tool)
        choice = self.choose(p.num_blocks, st.mean_s, state)
        if choice is Choice.PRESERVE:
            self.pins.add(p)
            return Retention(RetentionAction.PROTECT, ttl_s=st.ttl_s)
        return Retention(_ACTION[choice])

    def _reevaluated(self, p: CachedPrefix, state: EngineState) -> Optional[Retention]:
        """A prefix this policy preserves: ``None`` while preserve is still the least waste for the rest of the
        pause, else the better choice (and the pin is forgotten)."""
        since = self.latencies.paused_since_s(p.meta.session_id)
        elapsed = state.time_s - (since if since is not None else p.last_used_s)
        choice = self.choose(p.num_blocks, self.latencies.expected_remaining_s(p.meta.tool, elapsed), state)
        if choice is Choice.PRESERVE:
            return None
        self.pins.forget(p.prefix_id)
        return Retention(_ACTION[choice])


class InterceptWasteOffloadPolicy(InterceptWastePolicy):
    """``infercept`` with the CPU offload tier (``offload=True``): its engines are built with vLLM's offloading."""

    name = "infercept-offload"

    def __init__(self, **options: Any) -> None:
        super().__init__(offload=True, **options)
