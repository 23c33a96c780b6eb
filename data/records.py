"""The plain records every layer shares: requests, cached prefixes, engine state and events.

Dataclasses and enums only, never a vLLM type. The serving hook builds them from vLLM's scheduler state;
policies decide from them (:mod:`policy.interface`); predictors featurize them (:mod:`predictors`); the
telemetry logs their feature vectors. They live here, in the lowest layer, so that every layer above
imports them downward.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Optional

__all__ = [
    "RequestStatus",
    "OwnerState",
    "EventKind",
    "RequestMeta",
    "CandidateRequest",
    "CachedPrefix",
    "EngineState",
    "Event",
    "CANDIDATE_FEATURES",
    "PREFIX_FEATURES",
    "FEATURE_NAMES",
    "tail_starts",
]


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
    WAITING = "waiting"  # the owner's session has a request in the waiting queue (CPU-tier owners only)


class EventKind(str, enum.Enum):
    ARRIVED = "arrived"
    SCHEDULED = "scheduled"  # first scheduled, or scheduled again after a preemption
    PREEMPTED = "preempted"
    FINISHED = "finished"
    TOOL_CALL_STARTED = "tool_call_started"  # a turn with ``tool`` metadata finished
    TOOL_CALL_ENDED = "tool_call_ended"  # the next turn of that session arrived


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """Per-request metadata passed by the RL framework (all optional).

    Read by the hook from ``SamplingParams.extra_args`` (``kvpilot_domain``,
    ``kvpilot_paradigm``, ``kvpilot_group_id``, ``kvpilot_group_size``,
    ``kvpilot_session_id``, ``kvpilot_turn``, ``kvpilot_tool``, ``kvpilot_step``,
    ``kvpilot_prompt_id``, ``kvpilot_expected_pause_s``, ``kvpilot_weight_version``, ``kvpilot_max_tokens``).
    ``prompt_id`` names the
    dataset prompt, stable across RL steps when the prompt recurs. The session identity (``session_id``,
    ``turn``, ``tool``, ``expected_pause_s``) may also come from vLLM's typed ``Request.session_id``, a kvpilot
    KV-hint action, or
    (session and turn) the block-hash chain (``docs/session-identity.md``).
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
    #: Seconds the orchestrator expects the tool call after this turn to take (a hint, not a promise).
    expected_pause_s: Optional[float] = None
    #: The weight version the request's group started at (asynchronous RL; its prefix cache is salted by it).
    weight_version: Optional[int] = None
    #: The ``max_tokens`` the rollout asks for, where the request's own says something else: ``kvpilot replay``
    #: forces each output's length through ``max_tokens`` (random weights never stop), and names the workload's
    #: here, so that features and telemetry see what a rollout server sees, not the answer.
    max_tokens: Optional[int] = None


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
    priority: int = 0  # vLLM's ``Request.priority`` (the ``priority`` field or header): lower goes first there
    group_finished: int = 0  # requests (turns) of its group (same group_id) finished so far
    group_running: int = 0  # requests of its group currently running (one per session at most)
    sibling_output_tokens: tuple[int, ...] = ()  # output lengths of finished siblings

    @property
    def turn(self) -> int:
        return self.meta.turn or 0

    def features(self, predictions: Optional[Mapping[str, float]] = None) -> list[float]:
        """Feature vector in :data:`CANDIDATE_FEATURES` order (for telemetry).

        ``predictions`` are what the deciding policy predicted for this request (``len_p50``, ``len_p90``),
        as its decision returned them; NaN without.
        """
        p = predictions or {}
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
    tier_blocks: int = 0  # blocks held in the CPU offload tier (host-tier eviction candidates only)
    #: WAITING owners: their request's place in the waiting queue as the policy ordered it (0: admitted next)
    queue_position: Optional[int] = None

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def features(self, now_s: float, predictions: Optional[Mapping[str, float]] = None) -> list[float]:
        """Feature vector in :data:`PREFIX_FEATURES` order (for telemetry); ``predictions`` as for requests
        (``reuse_p``)."""
        p = predictions or {}
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
    #: The CPU offload tier (vLLM's native KV offloading): its capacity in blocks (0: no tier) and the seconds
    #: one block takes to load back into GPU memory over the host link.
    num_offload_blocks: int = 0
    offload_load_s_per_block: float = 0.0


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


def tail_starts(prefixes: Sequence[CachedPrefix]) -> list[int]:
    """Per prefix, the index of its first block after the deepest one another prefix shares (its own tail).

    A block another prefix holds comes with the blocks before it (a prefix hit takes the whole chain up to
    it), so the shared blocks lead each chain and a binary search finds where they end.
    """
    count = Counter(chain.from_iterable(p.block_ids for p in prefixes))
    out = []
    for p in prefixes:
        ids = p.block_ids
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if count[ids[mid]] > 1:
                lo = mid + 1
            else:
                hi = mid
        out.append(lo)
    return out
