"""vLLM's requests as kvpilot's plain records: what the policy sees is never a vLLM object.

:class:`Translator` keeps what the hook knows of each live request (:class:`ReqInfo`: its
:class:`RequestMeta`, resolved once by :mod:`serving_hook.identity` from vLLM's session id, KV hints and
``SamplingParams.extra_args`` or the block-hash chain, and its times), the progress of GRPO groups and of
sessions paused on a tool, and builds from them the records of
:mod:`policy.interface` (:mod:`data.records`): :class:`CandidateRequest` (one object per request, refreshed in
place each time it is offered; for a policy with ``lazy_candidates``, :class:`LazyCandidates` builds them only
when the policy reads them), :class:`EngineState` and :class:`Event`. A finished request's cached blocks
become a :class:`Freed` record, from which the retention and eviction levers build their
:class:`CachedPrefix` candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from vllm.v1.core.kv_cache_utils import get_block_hash
from vllm.v1.request import RequestStatus as VRS

from policy.common import shifted, to_front
from policy.interface import (
    CandidateRequest,
    CandidateView,
    EngineState,
    Event,
    EventKind,
    OwnerState,
    RequestMeta,
    RequestStatus,
)
from serving_hook.events import hash_to_int64
from serving_hook.guard import Guard
from serving_hook.identity import SessionIdentity

_MAX_GROUPS = 1 << 16
#: Groups whose sessions all ended, kept this many (the oldest go first) so that a late request of one (a reward
#: model's scoring request) continues its counters instead of restarting them at 0.
_MAX_ENDED_GROUPS = 1 << 12
#: Sessions kept as paused on a tool; beyond it the longest-paused is taken for finished (its next turn never came).
_MAX_PAUSED = 1 << 16


class EngineView(Protocol):
    """What the hook's parts read of the vLLM scheduler they serve (the scheduler itself).

    Read through this view at each use, never copied: vLLM re-binds ``running``, and the simulator
    replaces ``kvpilot_clock`` after construction.
    """

    running: list
    waiting: Any  # RequestQueue (a deque for FCFS)
    kv_holding_waiting: Any
    requests: dict
    kv_cache_manager: Any
    connector: Any
    block_size: int
    hash_block_size: int
    max_num_running_reqs: int
    max_num_active_reqs: int
    max_num_scheduled_tokens: int
    num_waiting_for_streaming_input: int
    kvpilot_clock: Callable[[], float]
    kvpilot_decode_stride: int

    @property
    def kvpilot_pinned_blocks(self) -> int: ...


@dataclass(slots=True)
class ReqInfo:
    """What the hook keeps per live request (metadata cached at add_request)."""

    meta: RequestMeta
    arrival_s: float
    first_scheduled_s: Optional[float] = None
    first_token_s: Optional[float] = None
    running: bool = False  # admitted and not preempted or finished since
    cached_tokens: int = -1
    computed_tokens: int = 0  # scheduled tokens summed over steps (counted with telemetry on)
    held_s: float = 0.0  # seconds the policy held it back in the waiting queue (ended holds)
    held_at: Optional[float] = None  # when the hold under way began
    cand: Optional[CandidateRequest] = None  # reused across steps, refreshed per call


@dataclass(slots=True)
class Freed:
    """A finished request's cached blocks, waiting for the retention decision."""

    request_id: str
    meta: RequestMeta
    owner_state: OwnerState
    blocks: list
    hashes: list  # the blocks' BlockHashWithGroupId at free time
    time_s: float
    hashes64: Optional[tuple] = None  # int64 hashes, computed once when first offered to evict()


def owner(meta: RequestMeta, request_id: str) -> str:
    """Who a request's KV belongs to across its turns: its session, else the request itself."""
    return meta.session_id if meta.session_id is not None else request_id


def plain_hash(h: Any) -> Any:
    """The plain block hash of a ``BlockHashWithGroupId`` (vLLM packs the group id in)."""
    return get_block_hash(h)


def hashes64(held: Any) -> tuple:
    """``held``'s block hashes as int64 (the interface's convention), converted once and kept.

    ``held``: a :class:`Freed` or a pin's record (``hashes`` and a ``hashes64`` slot).
    """
    h64 = held.hashes64
    if h64 is None:
        h64 = held.hashes64 = tuple(hash_to_int64(plain_hash(h)) for h in held.hashes)
    return h64


class LazyCandidates(CandidateView):
    """One decision's candidates for ``reqs``, each built (refreshed, :meth:`Translator.candidates`) on first read.

    Read within the policy call it is made for (the requests' state is that of the call). Iterating builds all
    of them in one pass.
    """

    __slots__ = ("_tr", "_reqs", "_now", "_ids", "_one", "_all")

    def __init__(self, tr: "Translator", reqs: list, now: float, ids: Optional[tuple] = None) -> None:
        self._tr, self._reqs, self._now = tr, reqs, now
        self._ids = ids
        self._one: dict[int, CandidateRequest] = {}
        self._all: Optional[list] = None

    @property
    def request_ids(self) -> tuple:
        """The ids, in order (a tuple: the same object in consecutive decisions over the same requests)."""
        if self._ids is None:
            self._ids = tuple([r.request_id for r in self._reqs])
        return self._ids

    def __len__(self) -> int:
        return len(self._reqs)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._reqs)))]
        if self._all is not None:
            return self._all[i]
        i = range(len(self._reqs))[i]  # IndexError when out of range; negative indices
        c = self._one.get(i)
        if c is None:
            c = self._one[i] = self._tr.candidates([self._reqs[i]], self._now)[0]
        return c

    def __iter__(self) -> Any:
        if self._all is None:
            self._all = self._tr.candidates(self._reqs, self._now)
        return iter(self._all)

    def take(self, positions: Sequence[int]) -> list[CandidateRequest]:
        """The candidates at ``positions`` (non-negative), those not read yet built in one pass."""
        if self._all is not None:
            return [self._all[i] for i in positions]
        one = self._one
        new = [i for i in positions if i not in one]
        if new:
            one.update(zip(new, self._tr.candidates([self._reqs[i] for i in new], self._now)))
        return [one[i] for i in positions]


class Translator:
    """The hook's per-request bookkeeping, and the plain records built from it."""

    def __init__(self, sched: EngineView, guard: Guard, events: bool, tier: Any = None) -> None:
        self.sched = sched
        self.offload_blocks = tier.blocks if tier is not None else 0  # the CPU offload tier (OffloadTier)
        self.offload_load_s = tier.load_s_per_block if tier is not None else 0.0
        self.guard = guard
        self.events = events  # the policy gets events (Policy.uses_events)
        pool = sched.kv_cache_manager.block_pool
        self.pool = pool
        self.num_blocks = pool.num_gpu_blocks - 1  # minus vLLM's null block
        self.infos: dict[str, ReqInfo] = {}
        #: group_id -> [turns finished, requests running, (finished turns' output lens,), requests known,
        #: sessions finished]
        self.groups: dict[str, list] = {}
        self.ended_groups: dict[str, list] = {}  # group_id -> the record of a group that ended (_MAX_ENDED_GROUPS)
        self.sessions: dict[str, int] = {}  # session_id -> last turn seen finishing with a tool
        self.session_request: dict[str, str] = {}  # session_id -> the id of its live request (its latest)
        #: owner (session id, else request id) -> the meta of its running request, for the requests noted running
        #: (:meth:`scheduled` notes a step's admissions after vLLM's ``schedule()``; see :meth:`running_owners`)
        self._running_owners: dict[str, RequestMeta] = {}
        #: each request's session identity, from the sources frameworks send or the block-hash chain
        self.identity = SessionIdentity(sched.hash_block_size, guard.stats.session_sources)
        self.prefilling: set[str] = set()  # scheduled, first token not seen yet
        self._last_step_time: Optional[float] = None
        self._last_duration = 0.0
        self._offered: tuple[list, Optional[tuple]] = ([], None)  # the last lazy offer's requests and their ids

    # ------------------------------------------------------------ records
    def state(self, now: float) -> EngineState:
        """The engine-state summary a policy call gets."""
        s = self.sched
        pool = self.pool
        free = pool.get_num_free_blocks()
        return EngineState(
            time_s=now,
            engine_step=self.guard.step_no,
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(s.kv_holding_waiting),
            num_free_blocks=free,
            num_total_blocks=self.num_blocks,
            num_pinned_blocks=s.kvpilot_pinned_blocks,
            kv_usage=pool.get_usage(),
            block_size=s.block_size,
            max_num_running=s.max_num_running_reqs,
            max_num_batched_tokens=s.max_num_scheduled_tokens,
            last_step_duration_s=self._last_duration,
            num_offload_blocks=self.offload_blocks,
            offload_load_s_per_block=self.offload_load_s,
        )

    def step_started(self, now: float) -> None:
        """Note a step's start time (``EngineState.last_step_duration_s`` is the time since the last one)."""
        if self._last_step_time is not None:
            self._last_duration = max(0.0, now - self._last_step_time)
        self._last_step_time = now

    def offer(self, reqs: list, now: float, lazy: bool) -> Sequence[CandidateRequest]:
        """The candidates of a decision over ``reqs``: built now, or (``lazy``) on read (:class:`LazyCandidates`)."""
        if not lazy:
            return self.candidates(reqs, now)
        last, ids = self._offered
        if ids is None or last != reqs:  # (the same request objects in the same order: a pointer comparison)
            # the usual change: admitted requests left the head, arrivals joined the end: only theirs are read
            k = shifted(last, reqs) if ids is not None else -1
            if k >= 0:
                ids = ids[k:] + tuple([r.request_id for r in reqs[len(last) - k:]])
            else:
                ids = tuple([r.request_id for r in reqs])
            self._offered = (list(reqs), ids)  # a copy: ``reqs`` may change after the decision
        return LazyCandidates(self, reqs, now, ids)

    def moved(self, picked: list[int]) -> None:
        """The hook moved the last offer's requests at places ``picked`` to the queue's front (an admission order):
        the next offer compares with the queue as it is now."""
        last, ids = self._offered
        if ids is not None:
            self._offered = (to_front(last, picked), to_front(ids, picked))

    def candidates(self, reqs: list, now: float) -> list[CandidateRequest]:
        """The candidates for ``reqs``: one object per request, built once and refreshed in place.

        One inlined loop (no call per request): this runs over every waiting
        request in each step in which vLLM could admit.
        """
        infos = self.infos
        groups = self.groups
        v_running, v_preempted = VRS.RUNNING, VRS.PREEMPTED
        running, preempted, waiting = RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.WAITING
        out: list[CandidateRequest] = []
        append = out.append
        for r in reqs:
            info = infos.get(r.request_id)
            if info is None:
                info = infos[r.request_id] = ReqInfo(self.identity.meta(r), r.arrival_time)
            c = info.cand
            if c is None:
                append(self._new_candidate(r, info, now))
                continue
            s = r.status
            if s is v_running:
                c.status = running
                c.wait_s = 0.0
            else:
                c.status = preempted if s is v_preempted else waiting
                w = now - r.arrival_time
                c.wait_s = w if w > 0.0 else 0.0
            c.num_cached_tokens = info.cached_tokens
            c.num_computed_tokens = r.num_computed_tokens
            c.num_output_tokens = r.num_output_tokens
            c.num_preemptions = r.num_preemptions
            gid = info.meta.group_id
            if gid is not None:
                g = groups.get(gid)
                if g is not None:
                    c.group_finished, c.group_running, c.sibling_output_tokens = g[0], g[1], g[2]
                else:  # (as a fresh candidate: the group's record ended with its last session)
                    c.group_finished = c.group_running = 0
                    c.sibling_output_tokens = ()
            append(c)
        return out

    def _new_candidate(self, r: Any, info: ReqInfo, now: float) -> CandidateRequest:
        meta = info.meta
        s = r.status
        if s == VRS.RUNNING:
            status = RequestStatus.RUNNING
            wait = 0.0
        else:
            status = RequestStatus.PREEMPTED if s == VRS.PREEMPTED else RequestStatus.WAITING
            wait = max(0.0, now - r.arrival_time)
        g = self.groups.get(meta.group_id) if meta.group_id is not None else None
        c = info.cand = CandidateRequest(
            request_id=r.request_id,
            meta=meta,
            status=status,
            prompt_token_ids=r.prompt_token_ids if r.prompt_token_ids is not None else (),
            num_prompt_tokens=r.num_prompt_tokens,
            num_cached_tokens=info.cached_tokens,
            num_computed_tokens=r.num_computed_tokens,
            num_output_tokens=r.num_output_tokens,
            max_tokens=r.max_tokens if meta.max_tokens is None else meta.max_tokens,
            arrival_s=r.arrival_time,
            wait_s=wait,
            num_preemptions=r.num_preemptions,
            priority=r.priority,
            group_finished=g[0] if g else 0,
            group_running=g[1] if g else 0,
            sibling_output_tokens=g[2] if g else (),
        )
        return c

    def freed(self, request: Any, blocks: list, hashes: list) -> Freed:
        """The record of a finished request's cached ``blocks`` (their ``hashes`` at free time)."""
        info = self.infos.get(request.request_id)
        meta = info.meta if info is not None else self.identity.meta(request)
        aborted = request.status == VRS.FINISHED_ABORTED
        state = OwnerState.PAUSED_TOOL if (meta.tool and not aborted) else OwnerState.FINISHED
        return Freed(request.request_id, meta, state, blocks, hashes, self.sched.kvpilot_clock())

    def emit(
        self, kind: EventKind, r: Any, meta: RequestMeta, finish_reason: Optional[str] = None, budgeted: bool = True
    ) -> None:
        """Give the policy the event ``kind`` of request ``r`` (under the step's budget unless not ``budgeted``)."""
        infos = self.infos
        ev = Event(
            kind=kind,
            time_s=self.sched.kvpilot_clock(),
            request_id=r.request_id,
            meta=meta,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens,
            num_cached_tokens=max(0, infos[r.request_id].cached_tokens) if r.request_id in infos else 0,
            finish_reason=finish_reason,
        )
        self.guard.notify(ev, budgeted)

    # ---------------------------------------------------- request lifecycle
    def group(self, meta: RequestMeta) -> Optional[list]:
        """The request's group record (made on first use), or None: ``[finished, running, (output lens,), live,
        sessions]``: its requests (turns) finished, its requests running, the output of each finished turn, its
        requests the engine still holds, and its sessions whose last turn finished (``group_size`` counts
        sessions). The record lives while a request lives or a session has not finished, so its counters never
        fall while the group runs."""
        gid = meta.group_id
        if gid is None:
            return None
        g = self.groups.get(gid)
        if g is None:
            if len(self.groups) >= _MAX_GROUPS:  # groups without a size never complete
                del self.groups[next(iter(self.groups))]
            g = self.groups[gid] = self.ended_groups.pop(gid, None) or [0, 0, (), 0, 0]
        return g

    def add(self, request: Any) -> Optional[str]:
        """A new request: note it; the session id when it is the next turn of a session paused on a tool."""
        rid = request.request_id
        if rid in self.infos:  # streaming update of an existing request
            return None
        meta = self.identity.meta(request)
        self.infos[rid] = ReqInfo(meta, request.arrival_time)
        g = self.group(meta)
        if g is not None:
            g[3] += 1
        sid = meta.session_id
        if sid is not None:
            self.session_request[sid] = rid
        # The next turn of a session whose last turn ended in a tool call: the tool returned.
        resumed = sid is not None and self.sessions.pop(sid, None) is not None
        if self.events:
            if resumed:
                self.emit(EventKind.TOOL_CALL_ENDED, request, meta, budgeted=False)
            self.emit(EventKind.ARRIVED, request, meta, budgeted=False)
        return sid if resumed else None

    def scheduled(self, out: Any, now: float, hit_heads: Optional[list]) -> tuple[list, int, int]:
        """Note the requests vLLM's step ``out`` admitted (new or resumed): ``(admitted ids, queries, hits)``.

        ``queries`` / ``hits``: their tokens and prefix-cache hit tokens. With ``hit_heads`` (a list),
        the first block hash of each admitted request that hit the cache is appended to it.
        """
        new_ids = [d.req_id for d in out.scheduled_new_reqs]
        resumed = out.scheduled_cached_reqs.resumed_req_ids
        nst = out.num_scheduled_tokens
        reqs = self.sched.requests
        infos = self.infos
        queries = hits = 0
        admitted = new_ids + [rid for rid in resumed if rid not in new_ids] if resumed else new_ids
        events = self.events
        for rid in admitted:
            r = reqs.get(rid)
            if r is None:
                continue
            hit = r.num_computed_tokens - nst.get(rid, 0)
            queries += r.num_tokens
            hits += hit
            info = infos.get(rid)
            if info is None:
                continue
            if info.first_scheduled_s is None:
                info.first_scheduled_s = now
                info.cached_tokens = hit
                self.prefilling.add(rid)
            if not info.running:
                info.running = True
                m = info.meta
                self._running_owners[owner(m, rid)] = m
                g = self.group(m)
                if g is not None:
                    g[1] += 1
            if hit > 0 and hit_heads is not None and r.block_hashes:
                hit_heads.append(r.block_hashes[0])
            if events:
                self.emit(EventKind.SCHEDULED, r, info.meta)
        st = self.guard.stats
        st.prefix_queries += queries
        st.prefix_hits += hits
        return admitted, queries, hits

    def count_computed(self, num_scheduled_tokens: dict) -> None:
        """Add a step's scheduled tokens to each request's ``computed_tokens`` (telemetry)."""
        infos = self.infos
        for rid, n in num_scheduled_tokens.items():
            info = infos.get(rid)
            if info is not None:
                info.computed_tokens += n

    def first_tokens(self) -> None:
        """After a step: stamp ``first_token_s`` of the prefilling requests that now have output."""
        now = None
        done = []
        reqs = self.sched.requests
        for rid in self.prefilling:
            r = reqs.get(rid)
            info = self.infos.get(rid)
            if r is None or info is None:
                done.append(rid)
                continue
            if r.num_output_tokens > 0:
                if now is None:
                    now = self.sched.kvpilot_clock()
                info.first_token_s = now
                done.append(rid)
        for rid in done:
            self.prefilling.discard(rid)

    def _not_running(self, rid: str, meta: RequestMeta) -> None:
        o = owner(meta, rid)
        if self._running_owners.get(o) is meta:
            del self._running_owners[o]

    def running_owners(self) -> dict[str, RequestMeta]:
        """Owner (session id, else request id) -> the meta of its running request, for each request in vLLM's
        ``running`` with a record; read-only.

        The same mapping as a pass over ``running`` (a test checks it through the real scheduler), without reading
        each running request: the requests noted running, plus the step's admissions that :meth:`scheduled` has not
        noted yet, which vLLM appends to ``running`` (read from its end)."""
        infos = self.infos
        new = None
        for r in reversed(self.sched.running):
            info = infos.get(r.request_id)
            if info is None:
                continue
            if info.running:
                break
            if new is None:
                new = []
            new.append((r.request_id, info.meta))
        if new is None:
            return self._running_owners
        out = dict(self._running_owners)
        for rid, m in reversed(new):
            out[owner(m, rid)] = m
        return out

    def preempted(self, request: Any) -> None:
        """vLLM preempted ``request``."""
        info = self.infos.get(request.request_id)
        if info is not None:
            if info.running:
                info.running = False
                self._not_running(request.request_id, info.meta)
                g = self.group(info.meta)
                if g is not None:
                    g[1] -= 1
            if self.events:
                self.emit(EventKind.PREEMPTED, request, info.meta)

    def finished(self, request: Any) -> Optional[tuple[ReqInfo, str]]:
        """vLLM freed ``request`` (finished or aborted): forget it; its record and finish reason, if known."""
        rid = request.request_id
        info = self.infos.pop(rid, None)
        self.prefilling.discard(rid)
        if info is None:
            return None
        meta = info.meta
        if meta.session_id is not None and self.session_request.get(meta.session_id) == rid:
            del self.session_request[meta.session_id]
        reason = request.get_finished_reason()
        rs = str(reason) if reason is not None else "abort"
        if rs not in ("stop", "length", "abort"):
            rs = "abort"  # vLLM's "error"
        if rs != "abort":
            self.identity.finished(request, meta)
        if meta.tool and rs != "abort":
            rs = "tool_call"
            if meta.session_id is not None:
                paused = self.sessions
                if len(paused) >= _MAX_PAUSED and meta.session_id not in paused:
                    del paused[next(iter(paused))]
                paused[meta.session_id] = meta.turn or 0
        if info.running:
            self._not_running(rid, meta)
        g = self.group(meta)
        if g is not None:
            g[0] += 1
            if rs == "stop" or rs == "length":  # a session's last turn (a tool call continues it; an abort is resent)
                g[4] += 1
            if info.running:
                g[1] -= 1
            g[2] = g[2] + (request.num_output_tokens,)
            g[3] -= 1
            if meta.group_size and g[4] >= meta.group_size and g[3] <= 0:
                ended = self.ended_groups
                if len(ended) >= _MAX_ENDED_GROUPS:
                    del ended[next(iter(ended))]
                ended[meta.group_id] = self.groups.pop(meta.group_id)
        if self.events:
            self.emit(EventKind.FINISHED, request, meta, finish_reason=rs)
            if rs == "tool_call":
                self.emit(EventKind.TOOL_CALL_STARTED, request, meta, finish_reason=rs)
        return info, rs
