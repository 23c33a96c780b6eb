"""kvpilot's decision interface: what a policy sees and what it answers.

Everything here is plain Python (dataclasses and enums), never a vLLM type, so a
policy can be written, unit-tested, trained and evaluated without vLLM. The
records a policy sees (requests, prefixes, engine state, events) live in
:mod:`data.records`, shared with the predictors, and are re-exported here; the
decisions it answers with are defined here. The serving hook
(:mod:`serving_hook`) is the only code that translates between vLLM's
scheduler state and these objects.

Each engine step a policy may answer three questions:

* **admission** (:meth:`Policy.admit`): an order over the waiting requests, and
  which of them to hold back for this step;
* **preemption** (:meth:`Policy.preempt`): which running request loses its KV
  when blocks run out;
* **retention** (:meth:`Policy.retain`): for the cached blocks freed by a
  finished request, or by a turn that paused on a tool, whether to protect them
  for a while (a pin with a TTL), demote them (evict them first), offload them
  (with a CPU offload tier: the GPU copy goes first and the tier's copy serves
  the return) or leave them to LRU;
* **eviction** (:meth:`Policy.evict`): when an allocation is about to evict
  cached blocks, which cached prefixes (among all whose blocks are free and
  still cached) go first. Retention decides once, when blocks are freed;
  eviction compares every cached prefix at the moment space is needed
  (KVFlow, Marconi, LRB, Belady);
* **host-tier eviction** (:meth:`Policy.evict_host`): when vLLM's CPU offload tier is full and must make
  room for a store, whose blocks leave host memory first, one candidate per session (or per request
  without a session), the storing request's among them: listing the storer before the room is found skips
  that store (:mod:`serving_hook.host_tier`, vLLM's ``CachePolicy`` seam).

It also receives :class:`Event` objects (arrived, scheduled, preempted,
finished, tool call started, tool call ended) to keep its own state.

An admission decision may hold back every waiting request, even with free
blocks (so that paused sessions' cached context survives until their tools
return); the hook's starvation bound (``KVPILOT_MAX_HOLD_S``) admits a request
that has waited that long whatever the policy holds. A policy that wants the CPU
offload tier sets :attr:`Policy.uses_offload` (the simulator then builds its
engines with vLLM's native KV offloading); :class:`EngineState` tells every
policy the tier's size and load price.

Returning ``None`` from any decision method means "vLLM's own behaviour".

**Zero-cost default path.** A policy declares which levers it uses with the
class flags :attr:`Policy.uses_admission`, :attr:`Policy.uses_preemption`,
:attr:`Policy.uses_retention`, :attr:`Policy.uses_eviction` and
:attr:`Policy.uses_events`. The hook builds candidates and calls a method only for
the levers a policy declares; with all five ``False`` (as :class:`policy.vllm_default.VllmDefaultPolicy` does) the hook
adds nothing to vLLM's scheduler step but a few attribute reads.

**Candidates on demand.** A policy that keeps its own per-request state (a feature table refreshed on
events, as the learned policy's :class:`policy.learned.table.FeatureTable`) sets
:attr:`Policy.lazy_candidates`: the hook then passes a :class:`CandidateView` instead of a list, whose
:attr:`CandidateView.request_ids` lists the candidates without building them, and which builds a
:class:`CandidateRequest` only when the policy reads it (by index or by iterating). Its candidates are the
ones the list would hold, so a decision does not depend on the flag.

**Hot swap.** When the serving hook replaces a policy while serving (a new registry version,
:mod:`serving_hook.model_source`), it hands the old policy's :meth:`Policy.export_state` (the per-session
state learned from events: phases, clocks, paused sessions, per-request rows) to the new one's
:meth:`Policy.import_state`, between two engine steps. A :class:`PolicyState` names its ``kind`` and layout
``version``; a policy that cannot take it raises :class:`StateMismatch` without changing itself, and the hook
then drops the state (one log line, counted). The defaults carry nothing.

**Time budget.** :attr:`Policy.decision_budget_s` bounds the time of all the
policy calls of one engine step. The hook measures every call; a call that
raises, or one that returns after the step's budget is spent, is discarded and
that step falls back to vLLM's own behaviour (see :mod:`serving_hook.scheduler`).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from data.records import (
    CANDIDATE_FEATURES,
    FEATURE_NAMES,
    PREFIX_FEATURES,
    CachedPrefix,
    CandidateRequest,
    EngineState,
    Event,
    EventKind,
    OwnerState,
    RequestMeta,
    RequestStatus,
)

__all__ = [
    "RequestStatus",
    "OwnerState",
    "EventKind",
    "RetentionAction",
    "RequestMeta",
    "CandidateRequest",
    "CachedPrefix",
    "EngineState",
    "Event",
    "AdmissionDecision",
    "PreemptionDecision",
    "Retention",
    "RetentionDecision",
    "EvictionDecision",
    "Policy",
    "CandidateView",
    "PolicyState",
    "StateMismatch",
    "CANDIDATE_FEATURES",
    "PREFIX_FEATURES",
    "FEATURE_NAMES",
    "DEFAULT_DECISION_BUDGET_S",
]

#: Default per-step budget for all policy calls of one engine step (seconds).
DEFAULT_DECISION_BUDGET_S = 0.005


class RetentionAction(str, enum.Enum):
    PROTECT = "protect"  # pin the blocks for ``ttl_s`` seconds
    DEMOTE = "demote"  # put the blocks first in line for eviction
    KEEP = "keep"  # leave them to vLLM's LRU
    #: Let the GPU copy go first (free-list head) and serve the return from the CPU offload tier, which holds
    #: every full block vLLM's native offloading stored. Without a tier it acts as KEEP (counted).
    OFFLOAD = "offload"


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """An order over the waiting requests, and who is held back this step.

    ``order`` lists request ids, first to be admitted first. Waiting requests it
    does not list keep vLLM's order, after those it lists; unknown ids are
    ignored. ``None`` keeps vLLM's order. Requests in ``hold`` are not
    considered this step at all (they keep their place and come back next
    step). Requests that already hold KV blocks (vLLM's
    ``kv_holding_waiting``) are not candidates.
    """

    order: Optional[Sequence[str]] = None
    hold: Collection[str] = frozenset()
    propensity: float = 1.0
    #: The longest these holds may last, in seconds since a request's arrival: None, the hook's starvation bound
    #: (``KVPILOT_MAX_HOLD_S``); a policy whose holds cannot stall the engine may set a longer one.
    hold_bound_s: Optional[float] = None
    #: What the policy predicted for the candidates it decided over (request id -> e.g. ``{"len_p50": ..}``),
    #: logged with the decision's features; ``None``: nothing predicted.
    predictions: Optional[Mapping[str, Mapping[str, float]]] = None


@dataclass(frozen=True, slots=True)
class PreemptionDecision:
    """The running request to preempt when blocks run out.

    ``victim`` is a request id from the candidates, or ``None`` for vLLM's own
    choice (the tail of the running list). If blocks are still short after the
    victim is preempted, the policy is asked again for the next one.
    """

    victim: Optional[str]
    propensity: float = 1.0
    #: What the policy predicted for the candidates it decided over (request id -> e.g. ``{"len_p50": ..}``),
    #: logged with the decision's features; ``None``: nothing predicted.
    predictions: Optional[Mapping[str, Mapping[str, float]]] = None


@dataclass(frozen=True, slots=True)
class Retention:
    """What to do with one prefix's blocks."""

    action: RetentionAction
    ttl_s: Optional[float] = None  # PROTECT only; required there
    propensity: float = 1.0

    def __post_init__(self) -> None:
        if self.action is RetentionAction.PROTECT and (self.ttl_s is None or not self.ttl_s > 0):
            raise ValueError("Retention(PROTECT) needs ttl_s > 0")


@dataclass(frozen=True, slots=True)
class RetentionDecision:
    """Retention actions for freed prefixes, and releases of protected ones.

    ``actions`` maps ``prefix_id`` to a :class:`Retention`; prefixes it does
    not name are kept (LRU). ``PROTECT`` on an already-protected prefix
    renews its TTL. ``release`` names protected prefixes to unpin now.
    """

    actions: Mapping[str, Retention] = field(default_factory=dict)
    release: Collection[str] = frozenset()
    #: What the policy predicted for the candidates it decided over (prefix id -> e.g. ``{"reuse_p": ..}``),
    #: logged with the decision's features; ``None``: nothing predicted.
    predictions: Optional[Mapping[str, Mapping[str, float]]] = None


@dataclass(frozen=True, slots=True)
class EvictionDecision:
    """Which cached prefixes to evict first, when an allocation needs cached blocks.

    ``order`` lists ``prefix_id`` values, first to be evicted first. The hook
    moves each listed prefix's free cached blocks to the head of vLLM's free
    list (deepest block first, so a prefix loses its tail before its head),
    behind only the free blocks that hold no cache at all. Prefixes it does not
    list keep vLLM's LRU order behind the listed ones; unknown ids are ignored.
    ``None`` (instead of a decision) keeps LRU. The order holds for the rest of
    the engine step: the policy is asked at most once per step.

    Logged to telemetry as a ``decisions`` row of kind ``"retain"`` with action
    ``"evict"`` (the schema's kinds are admit / preempt / retain): the
    candidates are all the prefixes offered, with :data:`PREFIX_FEATURES`, and
    ``chosen`` is the index of the first prefix listed (-1 for none).
    """

    order: Sequence[str] = ()
    propensity: float = 1.0
    #: What the policy predicted for the candidates it decided over (prefix id -> e.g. ``{"reuse_p": ..}``),
    #: logged with the decision's features; ``None``: nothing predicted.
    predictions: Optional[Mapping[str, Mapping[str, float]]] = None


class CandidateView(Sequence[CandidateRequest]):
    """The candidates of one decision, built on demand (for a policy with :attr:`Policy.lazy_candidates`).

    Indexing or iterating gives the same :class:`CandidateRequest` objects, with the same values, as the list the
    hook would otherwise pass; :attr:`request_ids` gives their ids in order without building any.
    """

    @property
    @abc.abstractmethod
    def request_ids(self) -> Sequence[str]:
        """The candidates' request ids, in order."""

    def take(self, positions: Sequence[int]) -> list[CandidateRequest]:
        """The candidates at ``positions`` (a view may build them in one pass)."""
        return [self[i] for i in positions]


@dataclass(frozen=True, slots=True)
class PolicyState:
    """A policy's per-session state (:meth:`Policy.export_state`), for its successor at a hot swap.

    ``kind`` names the policies that can read ``data`` (e.g. one policy class and its versions) and
    ``version`` the layout of ``data``.
    """

    kind: str
    version: int
    data: Any


class StateMismatch(ValueError):
    """:meth:`Policy.import_state` got a state it cannot take (another kind of policy, another layout version)."""


class Policy:
    """Base class of every kvpilot policy.

    Subclasses override the decision methods for the levers they use and set
    the matching ``uses_*`` flag; the hook never calls a method whose flag is
    ``False`` (vLLM's own behaviour is used for that lever). The default
    implementations answer ``None``: vLLM's behaviour.
    """

    #: Registry name and version; both are logged with every decision.
    name: str = "base"
    version: str = "0"

    #: Which levers the hook must consult (see the module docstring).
    uses_admission: bool = False
    uses_preemption: bool = False
    uses_retention: bool = False
    uses_eviction: bool = False
    uses_events: bool = False
    #: Needs the CPU offload tier: the simulator builds this policy's engines with vLLM's native KV
    #: offloading (serving: ``--kv-offloading-size``); see :mod:`simulator.offload`.
    uses_offload: bool = False
    #: Decides the CPU offload tier's eviction order (:meth:`evict_host`), through kvpilot's ``CachePolicy``
    #: (:mod:`serving_hook.host_tier`); without it the tier is vLLM's LRU.
    uses_host_eviction: bool = False
    #: Per domain, the mean peak context of logged sessions (:func:`policy.group_width.fit_session_contexts`):
    #: the prior of the asynchronous rollout's ``working-set`` admission; ``None``: none.
    session_contexts: Optional[Mapping[str, Mapping[str, float]]] = None

    #: Eviction lever: offer :meth:`evict` at most this many candidates, the
    #: least recently freed first (LRU order); ``None`` offers all of them.
    max_eviction_candidates: Optional[int] = None

    #: Time budget (seconds) for all this policy's calls in one engine step;
    #: ``None`` takes the hook's configured default (KVPILOT_DECISION_BUDGET_MS).
    decision_budget_s: Optional[float] = None

    #: A policy that also changes how RL steps are driven (which prompts run when), not only what one
    #: engine does: an object with a ``kind`` the simulator knows (``"tail-batching"``:
    #: :class:`policy.baselines.rollpacker.TailBatchingSpec`). ``None``: plain synchronous steps. Serving
    #: ignores it; the RL framework drives steps there.
    step_driver: Optional[Any] = None

    #: The hook may pass a :class:`CandidateView` (candidates built only when read) instead of a list: for a
    #: policy that reads only the request ids of most candidates (see the module docstring).
    lazy_candidates: bool = False

    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        """Order (and hold back) the waiting requests, given in vLLM's current order.

        Called at the start of a step in which vLLM could admit someone (the
        running set is not full) and the waiting queue is not empty.
        """
        return None

    def preempt(self, running: Sequence[CandidateRequest], state: EngineState) -> Optional[PreemptionDecision]:
        """Choose the victim when a running request cannot get the blocks it needs.

        ``running`` holds the running requests vLLM has not scheduled yet in
        this step, in vLLM's running order: the request whose allocation failed
        first, then those after it (requests already scheduled this step cannot
        be preempted without undoing vLLM's step). vLLM's own choice is the last.
        """
        return None

    def retain(self, prefixes: Sequence[CachedPrefix], state: EngineState) -> Optional[RetentionDecision]:
        """Decide about freed prefixes (and currently protected ones).

        Called in a step in which some request's cached blocks were freed.
        ``prefixes`` holds those freed prefixes first, then the prefixes the
        hook currently protects (``protected_until_s`` set), so the policy
        can renew or release them.
        """
        return None

    def evict(
        self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int, state: EngineState
    ) -> Optional[EvictionDecision]:
        """Order cached prefixes for eviction (only called when :attr:`uses_eviction` is set).

        Called at most once per engine step, inside vLLM's block allocation,
        when the blocks about to be handed out include cached ones (LRU would
        evict now). ``prefixes`` are the cached prefixes that have at least one
        free block still cached, the least recently freed first (at most
        :attr:`max_eviction_candidates` of them); ``block_ids`` /
        ``block_hashes`` are each prefix's blocks still cached, in prefix
        order (some of them may be in use by running requests: those are not
        evicted). ``num_blocks_needed`` is the size of the allocation that
        triggered the call (later allocations in the same step reuse the order).
        """
        return None

    def evict_host(
        self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int, state: EngineState
    ) -> Optional[EvictionDecision]:
        """Order the CPU offload tier's contents for eviction (only called when :attr:`uses_host_eviction` is set).

        Called when a store needs ``num_blocks_needed`` blocks more than the full tier has free, at most once
        per engine step and storing owner (later stores of the step reuse the order when it ranks their owner).
        ``prefixes`` has one entry per owner of host blocks (a session, or a request without one: the last
        request that stored or reused them) and one for the storing owner when it has none there yet, with
        ``tier_blocks`` its blocks in the tier, ``block_ids`` empty,
        ``owner_state`` RUNNING / WAITING (its session's next request is queued, at ``queue_position``) /
        PAUSED_TOOL / FINISHED and ``last_used_s`` the last time one of its requests used the tier. The listed
        owners' blocks go first (deepest block first), the rest in vLLM's LRU order; a store whose own owner is
        listed before enough room is found is skipped (Belady's bypass: the tier keeps what it holds). ``None``:
        vLLM's LRU.
        """
        return None

    def on_event(self, event: Event) -> None:
        """Observe an event (only called when :attr:`uses_events` is set)."""
        return None

    def export_state(self) -> Optional[PolicyState]:
        """The per-session state this policy learned from events, for a successor (``None``: nothing to carry).

        Called by the serving hook between engine steps, just before this policy is replaced; the successor may
        take the state's objects over (this policy is not used again).
        """
        return None

    def import_state(self, state: PolicyState) -> None:
        """Take over a predecessor's :meth:`export_state` (called before this policy's first decision).

        Raises :class:`StateMismatch`, changing nothing, when ``state`` is not one this policy reads. The
        default keeps no session state.
        """
        raise StateMismatch(f"{type(self).__name__} keeps no session state (got a {state.kind!r} state)")

    @staticmethod
    def state_data(state: PolicyState, kind: str, version: int) -> Any:
        """``state.data`` when ``state`` is of ``kind`` and layout ``version``; else :class:`StateMismatch`."""
        if not isinstance(state, PolicyState) or state.kind != kind or state.version != version:
            got = f"{state.kind!r} v{state.version}" if isinstance(state, PolicyState) else type(state).__name__
            raise StateMismatch(f"expected a {kind!r} v{version} state, got {got}")
        return state.data

    @property
    def is_vllm_default(self) -> bool:
        """True when the policy uses no lever at all (the hook short-circuits)."""
        return not (
            self.uses_admission or self.uses_preemption or self.uses_retention or self.uses_eviction or self.uses_events
            or self.uses_host_eviction
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, version={self.version!r})"
