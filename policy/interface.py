"""kvpilot's decision interface: what a policy sees and what it answers.

Everything here is plain Python (dataclasses and enums), never a vLLM type, so a
policy can be written, unit-tested, trained and evaluated without vLLM. The
serving hook (:mod:`serving_hook`) is the only code that translates between
vLLM's scheduler state and these objects.

Each engine step a policy may answer three questions:

* **admission** (:meth:`Policy.admit`): an order over the waiting requests, and
  which of them to hold back for this step;
* **preemption** (:meth:`Policy.preempt`): which running request loses its KV
  when blocks run out;
* **retention** (:meth:`Policy.retain`): for the cached blocks freed by a
  finished request, or by a turn that paused on a tool, whether to protect them
  for a while (a pin with a TTL), demote them (evict them first) or leave them
  to LRU;
* **eviction** (:meth:`Policy.evict`): when an allocation is about to evict
  cached blocks, which cached prefixes (among all whose blocks are free and
  still cached) go first. Retention decides once, when blocks are freed;
  eviction compares every cached prefix at the moment space is needed
  (KVFlow, Marconi, LRB, Belady).

It also receives :class:`Event` objects (arrived, scheduled, preempted,
finished, tool call started, tool call ended) to keep its own state.

Returning ``None`` from any decision method means "vLLM's own behaviour".

**Zero-cost default path.** A policy declares which levers it uses with the
class flags :attr:`Policy.uses_admission`, :attr:`Policy.uses_preemption`,
:attr:`Policy.uses_retention` and :attr:`Policy.uses_events`. The hook builds
candidates and calls a method only for the levers a policy declares; with all
four ``False`` (as :class:`policy.vllm_default.VllmDefaultPolicy` does) the hook
adds nothing to vLLM's scheduler step but a few attribute reads.

**Time budget.** :attr:`Policy.decision_budget_s` bounds the time of all the
policy calls of one engine step. The hook measures every call; a call that
raises, or one that returns after the step's budget is spent, is discarded and
that step falls back to vLLM's own behaviour (see :mod:`serving_hook.scheduler`).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

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
    "CANDIDATE_FEATURES",
    "PREFIX_FEATURES",
    "FEATURE_NAMES",
    "DEFAULT_DECISION_BUDGET_S",
]

#: Default per-step budget for all policy calls of one engine step (seconds).
DEFAULT_DECISION_BUDGET_S = 0.005


class RequestStatus(str, enum.Enum):
    """Where a candidate request stands in the engine."""

    WAITING = "waiting"  # never scheduled yet
    PREEMPTED = "preempted"  # scheduled before, lost its KV, waiting again
    RUNNING = "running"


class OwnerState(str, enum.Enum):
    """State of the request that owns a cached prefix."""

    RUNNING = "running"
    FINISHED = "finished"
    PAUSED_TOOL = "paused_tool"  # the turn ended in a tool call; the next turn will come back


class EventKind(str, enum.Enum):
    ARRIVED = "arrived"
    SCHEDULED = "scheduled"  # first scheduled, or scheduled again after a preemption
    PREEMPTED = "preempted"
    FINISHED = "finished"
    TOOL_CALL_STARTED = "tool_call_started"  # a turn with ``tool`` metadata finished
    TOOL_CALL_ENDED = "tool_call_ended"  # the next turn of that session arrived


class RetentionAction(str, enum.Enum):
    PROTECT = "protect"  # pin the blocks for ``ttl_s`` seconds
    DEMOTE = "demote"  # put the blocks first in line for eviction
    KEEP = "keep"  # leave them to vLLM's LRU


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """Per-request metadata passed by the RL framework (all optional).

    Read by the hook from ``SamplingParams.extra_args`` (``kvpilot_domain``,
    ``kvpilot_paradigm``, ``kvpilot_group_id``, ``kvpilot_group_size``,
    ``kvpilot_session_id``, ``kvpilot_turn``, ``kvpilot_tool``, ``kvpilot_step``,
    ``kvpilot_prompt_id``). ``prompt_id`` names the dataset prompt, stable
    across RL steps when the prompt recurs.
    """

    domain: Optional[str] = None
    paradigm: Optional[str] = None
    group_id: Optional[str] = None
    group_size: Optional[int] = None
    session_id: Optional[str] = None
    turn: Optional[int] = None
    tool: Optional[str] = None
    step: Optional[int] = None
    prompt_id: Optional[str] = None


#: Names of :meth:`CandidateRequest.features`, in order.
CANDIDATE_FEATURES: tuple[str, ...] = (
    "prompt_tokens",
    "cached_tokens",
    "computed_tokens",
    "output_tokens",
    "max_tokens",
    "turn",
    "group_size",
    "group_finished",
    "group_running",
    "wait_s",
    "preemptions",
    "is_running",
    "pred_len_p50",
    "pred_len_p90",
)


@dataclass(slots=True)
class CandidateRequest:
    """One request a policy may admit, hold back or preempt.

    Built by the hook from vLLM's request; never holds a vLLM object. The hook
    reuses one object per request and refreshes it before each call, so its
    values hold for the duration of a call: copy what a policy keeps.
    ``prompt_token_ids`` is the engine's own list, shared, not copied: treat it
    as read-only.
    """

    request_id: str
    meta: RequestMeta
    status: RequestStatus
    prompt_token_ids: Sequence[int]
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix-cache hit on first scheduling; -1 before
    num_computed_tokens: int
    num_output_tokens: int  # tokens generated so far
    max_tokens: int
    arrival_s: float
    wait_s: float  # now - arrival for waiting requests; 0 once running
    num_preemptions: int = 0
    priority: int = 0
    group_finished: int = 0  # siblings (same group_id) finished so far
    group_running: int = 0  # siblings currently running
    sibling_output_tokens: tuple[int, ...] = ()  # output lengths of finished siblings
    #: Predictor outputs when a predictor ran, e.g. ``{"len_p50": .., "len_p90": ..}``.
    predictions: Optional[Mapping[str, float]] = None

    @property
    def turn(self) -> int:
        return self.meta.turn or 0

    def features(self) -> list[float]:
        """Feature vector in :data:`CANDIDATE_FEATURES` order (for telemetry)."""
        p = self.predictions or {}
        nan = float("nan")
        return [
            float(self.num_prompt_tokens),
            float(self.num_cached_tokens),
            float(self.num_computed_tokens),
            float(self.num_output_tokens),
            float(self.max_tokens),
            float(self.meta.turn) if self.meta.turn is not None else nan,
            float(self.meta.group_size) if self.meta.group_size is not None else nan,
            float(self.group_finished),
            float(self.group_running),
            float(self.wait_s),
            float(self.num_preemptions),
            1.0 if self.status is RequestStatus.RUNNING else 0.0,
            float(p.get("len_p50", nan)),
            float(p.get("len_p90", nan)),
        ]


#: Names of :meth:`CachedPrefix.features`, in order.
PREFIX_FEATURES: tuple[str, ...] = (
    "num_blocks",
    "idle_s",
    "hits",
    "owner_finished",
    "owner_paused_tool",
    "turn",
    "group_size",
    "group_pending",
    "protected",
    "pred_reuse_p",
)


@dataclass(slots=True)
class CachedPrefix:
    """The hashed blocks a request leaves in the prefix cache.

    ``prefix_id`` is the id of the owning request. ``block_hashes`` are the
    blocks' hashes as signed 64-bit integers (the telemetry convention, see
    :func:`serving_hook.events.hash_to_int64`), in prefix order.
    """

    prefix_id: str
    owner_request_id: str
    owner_state: OwnerState
    meta: RequestMeta
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    last_used_s: float
    hits: int = 0  # admissions that hit this prefix (its first block) while it was protected
    protected_until_s: Optional[float] = None  # set while the hook pins the blocks
    group_pending: int = 0  # siblings of the owner not finished yet
    predictions: Optional[Mapping[str, float]] = None

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def features(self, now_s: float) -> list[float]:
        """Feature vector in :data:`PREFIX_FEATURES` order (for telemetry)."""
        p = self.predictions or {}
        nan = float("nan")
        return [
            float(len(self.block_ids)),
            float(now_s - self.last_used_s),
            float(self.hits),
            1.0 if self.owner_state is OwnerState.FINISHED else 0.0,
            1.0 if self.owner_state is OwnerState.PAUSED_TOOL else 0.0,
            float(self.meta.turn) if self.meta.turn is not None else nan,
            float(self.meta.group_size) if self.meta.group_size is not None else nan,
            float(self.group_pending),
            1.0 if self.protected_until_s is not None else 0.0,
            float(p.get("reuse_p", nan)),
        ]


FEATURE_NAMES: dict[str, tuple[str, ...]] = {
    "admit": CANDIDATE_FEATURES,
    "preempt": CANDIDATE_FEATURES,
    "retain": PREFIX_FEATURES,
}


@dataclass(frozen=True, slots=True)
class EngineState:
    """A summary of the engine at the start of a scheduler step."""

    time_s: float
    engine_step: int
    num_running: int
    num_waiting: int
    num_free_blocks: int  # blocks vLLM can allocate (includes evictable cached blocks)
    num_total_blocks: int
    num_pinned_blocks: int  # blocks the hook holds for protected prefixes
    kv_usage: float  # 0..1, vLLM's own measure
    block_size: int
    max_num_running: int  # vLLM's max_num_seqs
    max_num_batched_tokens: int
    last_step_duration_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened to a request; delivered to :meth:`Policy.on_event`."""

    kind: EventKind
    time_s: float
    request_id: str
    meta: RequestMeta
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: Optional[str] = None  # FINISHED only: stop / length / abort / tool_call


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


@dataclass(frozen=True, slots=True)
class PreemptionDecision:
    """The running request to preempt when blocks run out.

    ``victim`` is a request id from the candidates, or ``None`` for vLLM's own
    choice (the tail of the running list). If blocks are still short after the
    victim is preempted, the policy is asked again for the next one.
    """

    victim: Optional[str]
    propensity: float = 1.0


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

    #: Eviction lever: offer :meth:`evict` at most this many candidates, the
    #: least recently freed first (LRU order); ``None`` offers all of them.
    max_eviction_candidates: Optional[int] = None

    #: Time budget (seconds) for all this policy's calls in one engine step;
    #: ``None`` takes the hook's configured default (KVPILOT_DECISION_BUDGET_MS).
    decision_budget_s: Optional[float] = None

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

    def on_event(self, event: Event) -> None:
        """Observe an event (only called when :attr:`uses_events` is set)."""
        return None

    @property
    def is_vllm_default(self) -> bool:
        """True when the policy uses no lever at all (the hook short-circuits)."""
        return not (
            self.uses_admission or self.uses_preemption or self.uses_retention or self.uses_eviction or self.uses_events
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, version={self.version!r})"
