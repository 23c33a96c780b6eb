"""The replicas: kvpilot-hooked vLLM schedulers, each with its own clock, stepped on the event clock.

Each replica is :class:`serving_hook.KVPilotScheduler` with the run's policy,
built by :mod:`simulator.engine` on the CPU, and request metadata reaches the
hook as ``kvpilot_*`` ``extra_args``, as in production.

Time
----
Each replica has its own clock (:attr:`Replica.now`), which is the hook's
``kvpilot_clock``: an engine step starts at the replica's clock with
``schedule()``, lasts the fake runner's price of what it scheduled
(:mod:`simulator.runner`), and ends with ``update_from_output()`` at the later
time, so telemetry and policies see simulated time and each ``steps`` row
covers ``[time_s, time_s + duration_s]``. Requests that arrive during a step
are added at its end (vLLM's engine core adds requests between steps); an idle
replica starts a step at the arrival time, after every other event of that
instant (:mod:`simulator.clock`). A step that schedules nothing (every waiting
request held back or blocked) still takes ``idle_step_s``, so TTLs run out; a
replica that makes no progress for ``stall_steps`` such steps while nothing
else can happen (no event pending but other stalled replicas' steps) is an
error.

Routing
-------
With ``sticky_sessions`` (default) a session's later turns and its scoring
requests go to the replica of its first turn (told to the router through
``on_routed``); otherwise every request is routed. A session-aware router
(``Router.session_aware``) is asked for every turn instead, with the session's
replica as ``RouteRequest.home``, and may move the session: each move is
counted (``session_moves``) with the context it leaves behind
(``session_move_tokens``), which the new replica prefills again at the cost
model's rate unless it holds that prefix itself. The router hears of each
trajectory's end (``Router.on_session_end``). A router sees a request's
vLLM block hashes (its prompt's full blocks, as signed int64) and each
replica's KV events (``Router.on_kv_event``, from the hook's event listener at
every step's end), so the ``kv-aware`` router's index is built from the
replicas' own events, as llm-d builds it from vLLM's event stream.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from policy.interface import Policy
from simulator import engine
from simulator.clock import KICK, STEP_END, EventClock
from simulator.config import SimConfig, SimulationError
from simulator.offload import OffloadWorker
from simulator.routers import ReplicaLoad, Router, RouteRequest
from simulator.runner import ScriptedRunner
from simulator.tokens import VLLM_BLOCK_SIZE
from simulator.workload import PreparedWorkload

__all__ = ["Fleet", "Replica", "build_replicas"]


class Replica:
    """One simulated engine: the hooked scheduler, its clock, and the step in flight."""

    __slots__ = (
        "aborts",
        "busy",
        "engine",
        "idle_steps",
        "in_flight",
        "index",
        "kicked",
        "kv_blocks",
        "now",
        "offload",
        "pause_action",
        "paused_until",
        "pending",
        "_pool",
        "reset_pending",
        "reset_retry",
        "sched",
        "steps",
    )

    def __init__(self, index: int, sched: Any, offload: OffloadWorker | None = None) -> None:
        self.index = index
        self.offload = offload  # the CPU offload tier's host link (None: no tier)
        self.sched = sched  # the kvpilot hook's scheduler (its kvpilot_* attributes)
        self._pool = sched.kv_cache_manager.block_pool
        self.kv_blocks = self._pool.num_gpu_blocks - 1  # vLLM's null block left out
        self.engine = engine.Engine(sched)
        self.now = 0.0
        self.busy = False
        self.kicked = False
        self.pending: list[tuple[str, Any]] = []  # (id, request) that arrived during a step, added at its end
        self.aborts: set[str] = set()  # request ids to abort at the next step boundary
        self.in_flight: tuple[Any, list[str], list[list[int]]] | None = None  # scheduled step, its sampled tokens
        self.idle_steps = 0
        self.steps = 0
        self.reset_pending = False  # a weight sync's prefix-cache reset, for when its last requests are gone
        self.paused_until = 0.0  # a weight update pauses generation until then (the asynchronous driver)
        self.reset_retry: bool | None = None  # a weight update's refused reset, retried before each step
        self.pause_action: Callable[[Replica, float], None] | None = None  # its action, at the next step boundary

    def clock(self) -> float:
        """The replica's simulated time (the hook's ``kvpilot_clock``)."""
        return self.now

    def free_blocks(self) -> int:
        """KV blocks free or holding only evictable cached prefixes (vLLM's free queue)."""
        return self._pool.get_num_free_blocks()


def build_replicas(config: SimConfig, workload: PreparedWorkload, kv_blocks: int,
                   policy_factory: Callable[[], Policy], router: Router, writer: Any,
                   offload_blocks: int = 0, host_policy: bool = False) -> list[Replica]:
    """The run's replicas, each a hooked scheduler of ``kv_blocks`` blocks with a fresh policy, sharing ``writer``;
    with ``offload_blocks`` > 0 each has a CPU offload tier of that many blocks (vLLM's native offloading), whose
    cache policy is kvpilot's with ``host_policy`` (:mod:`serving_hook.host_tier`), else vLLM's LRU."""
    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig

    max_model_len = max(workload.largest_request + VLLM_BLOCK_SIZE, 1024)  # the longest context a request reaches
    block_bytes = config.cost.kv_block_bytes(VLLM_BLOCK_SIZE) if offload_blocks else 0
    reps = []
    for i in range(config.replicas):
        kw: dict[str, Any] = {"replica": i}
        if offload_blocks:  # the policies price and telemetry counts the simulated model's blocks on its host link
            kw["kv_block_bytes"] = block_bytes
            kw["host_link_gbps"] = config.cost.host_link_bytes_per_s / 1e9
        if config.decision_budget_s is not None:
            kw["decision_budget_s"] = config.decision_budget_s
        cls = with_policy(KVPilotScheduler, policy_factory, HookConfig(**kw), name=f"SimReplica{i}",
                          shared_writer=writer)
        cfg = engine.make_vllm_config(
            num_blocks=kv_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens * config.decode_stride,  # see simulator.runner
            max_model_len=max_model_len,
            offload_blocks=offload_blocks,
            host_policy=host_policy,
        )
        sched = engine.make_scheduler(cls, num_blocks=kv_blocks, vllm_config=cfg)
        rep = Replica(i, sched, OffloadWorker(config.cost, block_bytes) if offload_blocks else None)
        sched.kvpilot_clock = rep.clock
        sched.kvpilot_decode_stride = config.decode_stride
        if config.replicas > 1:
            sched.kvpilot_set_kv_event_listener(functools.partial(router.on_kv_event, i))
        reps.append(rep)
    return reps


class Fleet:
    """The replicas behind the router: routing, engine steps on the event clock, aborts.

    :attr:`on_finished` (set by the run, to its driver's) hears of each request an engine finished, at its
    step's end.
    """

    def __init__(self, replicas: list[Replica], router: Router, clock: EventClock, runner: ScriptedRunner,
                 config: SimConfig) -> None:
        self.replicas = replicas
        self.router = router
        self.clock = clock
        self.runner = runner
        self.sticky = config.sticky_sessions
        self.idle_step_s = config.idle_step_s
        self.stall_steps = config.stall_steps
        self.on_finished: Callable[[str, float], None] | None = None  # (request id, time)
        self.engine_steps = 0
        self.cache_resets = 0  # prefix-cache resets done (weight syncs x replicas)
        self.cache_reset_retries = 0  # a weight update's reset refused and tried again (simulator.async_rl)
        self.router_s = 0.0  # wall time spent routing (:meth:`_route`, the router's calls included)
        self._replica_of: dict[str, Replica] = {}  # request id -> the replica it runs on, until it ends
        self._stream_replica: dict[str, int] = {}  # sticky sessions: stream -> its replica
        self.session_moves = 0  # turns a session-aware router sent away from their session's replica
        self.session_move_tokens = 0  # their prompt tokens: the context each left on its old replica

    # ------------------------------------------------------------------ requests
    def submit(self, request_id: str, request: Any, routed_id: str, prompt_tokens: int, session_id: str,
               stream: str, t: float) -> None:
        """Request ``request`` (vLLM's) arrives at ``t``: route it and add it, now or at its replica's step end.

        The router sees it as ``routed_id`` of ``session_id``; ``stream`` (its trajectory) pins sticky sessions.
        """
        t0 = time.perf_counter()
        rep = self._route(request, routed_id, prompt_tokens, session_id, stream)
        self.router_s += time.perf_counter() - t0
        self._replica_of[request_id] = rep
        if rep.busy or rep.reset_pending or t < rep.paused_until:  # during a step, before a weight sync's reset or
            # during a weight update: at the next step
            rep.pending.append((request_id, request))
            self._kick(rep, t)
        else:
            rep.now = max(rep.now, t)
            rep.engine.add(request)
            self._kick(rep, t)

    def _route(self, request: Any, routed_id: str, prompt_tokens: int, session_id: str, stream: str) -> Replica:
        """The replica for a request; its block hashes go to the router (the hash space of the replicas' KV
        events, see :class:`simulator.routers.KVAwareRouter`)."""
        reps = self.replicas
        if len(reps) == 1:
            return reps[0]
        hashes = engine.prompt_block_hashes(request, prompt_tokens // VLLM_BLOCK_SIZE)
        pinned = self._stream_replica.get(stream) if self.sticky else None
        router = self.router
        extra = request.sampling_params.extra_args or {}
        req = RouteRequest(routed_id, hashes, prompt_tokens, VLLM_BLOCK_SIZE, session_id, stream,
                           pinned if router.session_aware else None, extra.get("kvpilot_domain"))
        if pinned is not None and not router.session_aware:
            router.on_routed(req, pinned)
            return reps[pinned]
        loads = [ReplicaLoad(r.index, r.engine.load() + len(r.pending), r.kv_blocks, r.free_blocks()) for r in reps]
        chosen = router.route(req, loads)
        if pinned is not None and chosen != pinned:
            self.session_moves += 1
            self.session_move_tokens += prompt_tokens
        self._stream_replica[stream] = chosen
        return reps[chosen]

    def session_ended(self, stream: str) -> None:
        """Trajectory ``stream`` is done or aborted: its pin is dropped and the router told."""
        self._stream_replica.pop(stream, None)
        self.router.on_session_end(stream)

    def abort(self, request_id: str, t: float) -> None:
        """Abort a request: now if its replica is between steps, else at its step's end."""
        rep = self._replica_of.get(request_id)
        if rep is None:
            return
        rep.aborts.add(request_id)
        if not rep.busy:
            rep.now = max(rep.now, t)
            self._apply_aborts(rep)

    def _apply_aborts(self, rep: Replica) -> None:
        ids, rep.aborts = rep.aborts, set()
        rep.pending = [p for p in rep.pending if p[0] not in ids]
        # One id at a time, in a fixed order: vLLM frees the blocks of a set of ids in the set's order, which
        # depends on the process's string hash seed, and the free order decides later evictions.
        rep.engine.abort(sorted(ids))
        for rid in ids:
            self.runner.forget(rid)
            self._replica_of.pop(rid, None)

    def reset_prefix_caches(self) -> None:
        """Weight sync: every replica drops its prefix cache (vLLM's ``reset_prefix_cache``), now if it is idle
        and empty, else as soon as its last requests of the old weights (aborted ones) are gone; requests of the
        new weights wait for it (:meth:`start_step` adds them after the reset)."""
        for rep in self.replicas:
            if rep.busy or rep.engine.load():
                rep.reset_pending = True
            else:
                self._reset(rep)

    def reset_now(self, rep: Replica, running: bool = False) -> None:
        """Reset ``rep``'s prefix cache now (between its steps); ``running``: preempt its running requests first.

        vLLM refuses while blocks are held by transfers of the CPU offload tier still in flight (a store of a
        finished request, a load of a waiting one): the reset is then retried before each later step until it
        succeeds (``cache_reset_retries`` counts the retries)."""
        if not self._try_reset(rep, running):
            rep.reset_retry = running

    def _try_reset(self, rep: Replica, running: bool) -> bool:
        try:
            ok = rep.engine.reset_prefix_cache(running)
        except RuntimeError:  # vLLM: blocks still held after preempting every running request
            ok = False
        if ok:
            rep.reset_retry = None
            self.cache_resets += 1
        return ok

    def _reset(self, rep: Replica) -> None:
        rep.reset_pending = False
        if not rep.engine.reset_prefix_cache():
            raise SimulationError(f"replica {rep.index}: vLLM refused to reset its prefix cache with no request "
                                  "left (blocks still in use)")
        self.cache_resets += 1

    def pause(self, until: float, action: Callable[[Replica, float], None] | None, t: float) -> None:
        """A weight update at ``t``: every replica stops generating until ``until``; ``action`` (what the update does
        to its requests and cache) runs on each at its next step boundary (now if it is idle)."""
        for rep in self.replicas:
            rep.paused_until = until
            rep.pause_action = action
            if not rep.busy:
                rep.now = max(rep.now, t)
                self._run_pause_action(rep, rep.now)
            self._kick(rep, until)

    def _run_pause_action(self, rep: Replica, t: float) -> None:
        action, rep.pause_action = rep.pause_action, None
        if action is not None:
            if rep.aborts:
                self._apply_aborts(rep)
            action(rep, t)

    def live_requests(self, rep: Replica) -> list[str]:
        """Ids of the requests on ``rep`` that its engine holds (running or waiting), in a fixed order."""
        return sorted(rid for rid, r in self._replica_of.items() if r is rep and rid in rep.engine.requests)

    def abort_now(self, rep: Replica, request_ids: list[str]) -> None:
        """Abort requests of an idle replica at once (a weight update's abort)."""
        rep.aborts.update(request_ids)
        self._apply_aborts(rep)

    # ------------------------------------------------------------------ engine steps
    def _kick(self, rep: Replica, t: float) -> None:
        if not rep.busy and not rep.kicked:
            rep.kicked = True
            self.clock.push(t, KICK, rep)

    def kicked(self, rep: Replica, t: float) -> None:
        """A kick's time has come: an idle replica starts its next step."""
        rep.kicked = False
        if not rep.busy:
            self.start_step(rep, t)

    def start_step(self, rep: Replica, t: float) -> None:
        rep.now = t
        eng = rep.engine
        if rep.pause_action is not None:
            self._run_pause_action(rep, t)
        if t < rep.paused_until:  # a weight update: generation resumes at its end
            self._kick(rep, rep.paused_until)
            return
        if rep.reset_retry is not None:
            self.cache_reset_retries += 1
            self._try_reset(rep, rep.reset_retry)
        if rep.aborts:
            self._apply_aborts(rep)
        if rep.reset_pending and not eng.load():  # vLLM's finished-but-unflushed ids hold no block
            self._reset(rep)
        if rep.pending and not rep.reset_pending:
            pending, rep.pending = rep.pending, []
            for _, req in pending:
                eng.add(req)
        if not eng.has_requests():
            return
        scheduled, tokens = eng.schedule()
        req_ids, sampled, dt = self.runner.output(eng.requests, tokens)
        blocked = rep.offload.submit(scheduled, t) if rep.offload is not None else 0.0
        rep.in_flight = (scheduled, req_ids, sampled)
        if req_ids:
            rep.idle_steps = 0
            dt += blocked
        elif rep.offload is not None and rep.offload.busy:  # waiting on a transfer: not stalled
            dt = max(self.idle_step_s, blocked)
            rep.idle_steps = 0
        else:
            dt = self.idle_step_s
            rep.idle_steps += 1
            if rep.idle_steps >= self.stall_steps and all(  # nothing but other stalled replicas' idle steps left
                    kind in (STEP_END, KICK) and arg.idle_steps >= self.stall_steps
                    for kind, arg in self.clock.pending()):
                raise SimulationError(
                    f"replica {rep.index} stalled: {eng.waiting()} request(s) waiting, none schedulable for "
                    f"{rep.idle_steps} steps and nothing else pending (KV cache too small, or a policy holds "
                    "everything back)")
        rep.busy = True
        rep.steps += 1
        self.engine_steps += 1
        self.clock.push(t + dt, STEP_END, rep)

    def end_step(self, rep: Replica, t: float) -> None:
        rep.now = t
        scheduled, req_ids, sampled = rep.in_flight
        kv_out = rep.offload.finished(t) if rep.offload is not None else None
        finished = rep.engine.update(scheduled, req_ids, sampled, kv_out)
        rep.in_flight = None
        rep.busy = False
        for rid in finished:
            self.runner.forget(rid)
            self._replica_of.pop(rid, None)
            self.on_finished(rid, t)
        if rep.aborts:
            self._apply_aborts(rep)
        if rep.pause_action is not None:
            self._run_pause_action(rep, t)
        if rep.pending or rep.engine.has_requests():
            self._kick(rep, max(t, rep.paused_until))

    # ------------------------------------------------------------------ the end
    @property
    def scheduler_s(self) -> float:
        """Wall time inside the schedulers, all replicas."""
        return sum(r.engine.scheduler_s for r in self.replicas)

    def close(self) -> float:
        """Close the hooks; returns their own share of :attr:`scheduler_s`."""
        hook = sum(r.sched.kvpilot_stats.hook_time_s for r in self.replicas)
        for r in self.replicas:
            r.sched.kvpilot_close()
        return hook
