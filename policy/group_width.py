"""kvpilot's rollout width: keep GRPO groups in flight while their predicted working set fits in memory.

Where memory binds, the asynchronous rollout's width decides throughput: too few groups leave the engine
idle behind one group's tools, too many evict each other's paused contexts and pay for it in recompute.
AReaL's staleness rule sizes the width from the trainer's batch alone, and prime-rl's KV-pressure controller
from KV use, which stays near full whenever memory binds. kvpilot sizes it from what each session will hold:

* :class:`SessionContexts` predicts a session's peak context (prompt plus output of its last turn) by
  domain, from a prior fitted on logged sessions (:func:`fit_session_contexts`, stored in the learned
  policy's bundle) and refined online by every session that ends;
* :func:`working_set_admits` starts the next group only while the predicted working set of the sessions in
  flight (each at the larger of its context now and its predicted peak) plus the next group's fits in the
  replicas' GPU KV plus their host tier. One group is always allowed, so the rollout never stalls.
* :func:`working_set_holds` then keeps the width right while the groups run: a predicted peak is a domain's
  mean, and a group of long sessions outgrows it. A session's next turn waits while the sessions in flight of
  its own group and every older one do not fit in GPU KV plus the host tier, the oldest group's turns never.
  vLLM's CPU tier writes every block the GPU computes through to host memory, so a running context takes its
  room twice (on the GPU and its host copy, up to the tier's size) and a paused one once. Without the hold the
  youngest group's turns evict the older groups' paused contexts, which return and are recomputed while the
  trainer waits for exactly those older groups. A held turn goes as soon as a session's end makes room.
* :class:`WidthHolds` runs that rule inside the engine, and holds nothing while the oldest group's contexts alone
  outgrow GPU KV plus the tier (on vLLM's CPU server one group can): they evict each other whether or not a younger
  turn waits, so a hold keeps nothing and only idles the engine (in the simulator calibrated on that server the
  hook's width ran 0.77x no holds at 200 blocks, 0.85x with this check; docs/results).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from policy.interface import EngineState, Event, EventKind
from policy.learned.group_age import GroupAges

__all__ = ["WIDTH_HOLD_BOUND_S", "SessionContexts", "WidthHolds", "fit_session_contexts", "working_set_admits",
           "working_set_holds"]

#: How many ended sessions the logged prior weighs as (online updates move it from there).
PRIOR_WEIGHT = 8.0
#: The longest :class:`WidthHolds` keeps a turn since its arrival (its decisions' ``hold_bound_s``), far above the
#: hook's 30 s default: its holds cannot stall the engine (the oldest group is never held, an idle engine takes a
#: held turn). At H200-32B they last minutes (under a 30 s bound AReaL's rule with the width ran 0.80x the width
#: without it), and in a synchronous step a young group's first turns wait, from the step's start, for the older
#: groups' whole sessions: on a 128-session step at H200-32B a 600 s bound released them in a flood and ran 1.5-3.4%
#: slower than no bound (docs/results/2026-12-07-width-in-synchronous-steps.md). A group that never ends (a client
#: that left) holds younger turns at most this long.
WIDTH_HOLD_BOUND_S = 3600.0


def fit_session_contexts(requests: pa.Table) -> dict[str, dict[str, float]]:
    """Per domain, the mean peak context of the logged sessions and their count, from a telemetry ``requests``
    table (``session_id``, ``domain``, ``prompt_tokens``, ``output_tokens``); requests without a session or a
    domain are left out."""
    t = requests.select(["session_id", "domain", "prompt_tokens", "output_tokens"])
    t = t.filter(pc.and_(pc.is_valid(t["session_id"]), pc.is_valid(t["domain"])))
    if t.num_rows == 0:
        return {}
    ctx = pc.add(t["prompt_tokens"].cast(pa.int64()), t["output_tokens"].cast(pa.int64()))
    t = t.append_column("context", ctx)
    peaks = t.group_by(["session_id", "domain"]).aggregate([("context", "max")])
    by_domain = peaks.group_by("domain").aggregate([("context_max", "mean"), ("context_max", "count")])
    return {d: {"mean_peak": float(m), "sessions": float(n)}
            for d, m, n in zip(by_domain["domain"].to_pylist(), by_domain["context_max_mean"].to_pylist(),
                               by_domain["context_max_count"].to_pylist())}


class SessionContexts:
    """A session's predicted peak context (tokens) by domain: the logged prior, refined by ended sessions.

    ``prior``: :func:`fit_session_contexts`'s output (may be empty); a domain it does not know is predicted at
    the prior's mean over its sessions until sessions of it end, and with no prior at all at ``fallback`` (e.g.
    the largest context a request may reach).
    """

    def __init__(self, prior: Mapping[str, Mapping[str, Any]] | None, fallback: float) -> None:
        prior = prior or {}
        logged = sum(float(s["sessions"]) for s in prior.values())
        self.fallback = (sum(float(s["mean_peak"]) * float(s["sessions"]) for s in prior.values()) / logged
                         if logged else float(fallback))
        self._sum: dict[str, float] = {}
        self._n: dict[str, float] = {}
        for domain, s in prior.items():
            n = min(float(s["sessions"]), PRIOR_WEIGHT)
            self._sum[domain], self._n[domain] = float(s["mean_peak"]) * n, n

    def predict(self, domain: str) -> float:
        """The predicted peak context of a session of ``domain``."""
        n = self._n.get(domain)
        return self._sum[domain] / n if n else self.fallback

    def observe(self, domain: str, peak: int) -> None:
        """A session of ``domain`` ended at ``peak`` tokens of context."""
        self._sum[domain] = self._sum.get(domain, 0.0) + peak
        self._n[domain] = self._n.get(domain, 0.0) + 1.0


def working_set_admits(in_flight_tokens: float, next_tokens: float, capacity_tokens: float,
                       groups_in_flight: int) -> bool:
    """Whether the next group may start: its predicted working set and that of the groups in flight fit in
    ``capacity_tokens`` (GPU KV plus host tier), or no group is in flight."""
    return groups_in_flight == 0 or in_flight_tokens + next_tokens <= capacity_tokens


def working_set_holds(contexts: float, running: float, gpu_kv_tokens: int, tier_tokens: int, oldest: bool) -> bool:
    """Whether a session's next turn waits: the sessions in flight of its group and every older group, with
    ``contexts`` tokens of context now, ``running`` of them in sessions on the engine (the turn to send
    included), do not fit in ``gpu_kv_tokens`` plus ``tier_tokens`` (a running context's host copy counts too,
    up to the tier's size), and its group is not the oldest in flight."""
    return not oldest and contexts + min(running, tier_tokens) > gpu_kv_tokens + tier_tokens


class _Session:
    """A session in flight as :class:`WidthHolds` sees it: its group's rank, its context now, whether it runs."""

    __slots__ = ("context", "live", "rank")

    def __init__(self, rank: int) -> None:
        self.rank, self.context, self.live = rank, 0, False


class WidthHolds:
    """The width inside the engine: :func:`working_set_holds` from the engine's own events, for the serving hook.

    Every request with a group and a session counts, synchronous or not: a session is in flight from its first
    request until a turn ends other than in a tool call or an abort (an aborted request comes back at a weight
    update); its context now is its latest prompt (its prompt plus output while it waits on a tool), and it runs from
    its request's first scheduling to that request's end. Groups rank in the order their first request arrived
    (under asynchronous RL, their weight versions' order; in a synchronous step, the order the framework sent them).
    :meth:`holds` names the waiting turns to keep in vLLM's queue this step: taken oldest group first, a turn waits
    while the sessions in flight of its group and every older one do not fit in GPU KV plus the host tier (the turns
    let go before it in this pass counted as running), the oldest group's never, nor a turn of a running session (a
    preempted one), nor any turn while the oldest group's contexts alone do not fit (a hold would keep nothing). So
    in a synchronous step a younger group's sessions start as the older ones end, instead of all at once, evicting
    each other's paused contexts. It is work-conserving: where nothing runs and nothing else waits, the first held
    turn goes (on vLLM's CPU server, holding while the older groups waited on their tools idled the engine:
    docs/results). Requests without a group or a session are neither held nor counted. A framework's own concurrency
    cap keeps working: a hold only delays a turn, and the hook's starvation bound releases one held too long. Beyond
    ``max_sessions`` in flight (sessions that never ended), the oldest groups' are forgotten.
    """

    def __init__(self, max_sessions: int = 1 << 16) -> None:
        self.max_sessions = max_sessions
        self.sessions: dict[str, _Session] = {}
        self.ages = GroupAges(versioned_only=False)  # each group's rank in arrival order
        self._session_of: dict[str, str] = {}  # a request from its arrival to its end -> its session
        self._sums: tuple[dict[int, int], dict[int, int], int] | None = None  # per rank, cumulative (see _cumulative)

    def on_event(self, event: Event) -> None:
        """Follow the sessions in flight."""
        meta = event.meta
        sid, gid = meta.session_id, meta.group_id
        if sid is None or gid is None:
            return
        kind, sessions = event.kind, self.sessions
        if kind is EventKind.ARRIVED:
            s = sessions.get(sid)
            if s is None:
                if len(sessions) >= self.max_sessions:
                    self._forget_oldest()
                s = sessions[sid] = _Session(self.ages.rank(meta))
            s.context = event.num_prompt_tokens
            self._session_of[event.request_id] = sid
        elif kind is EventKind.SCHEDULED:
            s = sessions.get(sid)
            if s is None or s.live:
                return
            s.live = True
        elif kind is EventKind.FINISHED:
            self._session_of.pop(event.request_id, None)
            s = sessions.get(sid)
            if s is None:
                return
            if event.finish_reason in ("tool_call", "abort"):
                s.live = False
                s.context = event.num_prompt_tokens + event.num_output_tokens
            else:
                del sessions[sid]
        else:
            return
        self._sums = None

    def _forget_oldest(self) -> None:
        """Drop the sessions of the older half of the groups in flight."""
        ranks = sorted({s.rank for s in self.sessions.values()})
        cut = ranks[len(ranks) // 2] if len(ranks) > 1 else ranks[-1] + 1
        self.sessions = {k: s for k, s in self.sessions.items() if s.rank >= cut}

    def _cumulative(self) -> tuple[dict[int, int], dict[int, int], int]:
        """Per group rank in flight, the contexts of the sessions of it and every older group, and the part of them
        running; and the oldest rank. Kept until the next event that changes a session."""
        if self._sums is None:
            tokens: dict[int, int] = defaultdict(int)
            running: dict[int, int] = defaultdict(int)
            for s in self.sessions.values():
                tokens[s.rank] += s.context
                if s.live:
                    running[s.rank] += s.context
            cum_tokens, cum_running, t, r = {}, {}, 0, 0
            for k in sorted(tokens):
                t += tokens[k]
                r += running[k]
                cum_tokens[k], cum_running[k] = t, r
            self._sums = cum_tokens, cum_running, min(tokens)
        return self._sums

    def holds(self, request_ids: Sequence[str], state: EngineState) -> frozenset[str]:
        """Of the waiting requests ``request_ids``, those to hold this step."""
        sessions = self.sessions
        if not sessions:
            return frozenset()
        session_of = self._session_of
        turns = []
        for i, rid in enumerate(request_ids):
            s = sessions.get(session_of.get(rid, ""))
            if s is not None and not s.live:
                turns.append((s.rank, i, s.context, rid))
        if not turns:
            return frozenset()
        cum_tokens, cum_running, oldest = self._cumulative()
        gpu = state.num_total_blocks * state.block_size
        tier = state.num_offload_blocks * state.block_size
        if cum_tokens[oldest] > gpu + tier:
            return frozenset()  # the oldest group alone outgrows memory: holding a younger turn keeps nothing
        held, sent = [], 0
        for rank, _, context, rid in sorted(turns):
            if rank != oldest and working_set_holds(cum_tokens[rank], cum_running[rank] + sent + context, gpu, tier,
                                                    False):
                held.append(rid)
            else:
                sent += context
        if held and not sent and state.num_running == 0 and len(turns) == len(request_ids):
            del held[0]  # work-conserving: an idle engine takes the oldest group's turn held first
        return frozenset(held)
