"""The event-driven rollout simulation: RL drivers and replicas around vLLM's real scheduler.

:func:`run_simulation` replays a WORKLOAD table (:data:`data.schemas.WORKLOAD`)
on ``replicas`` copies of the kvpilot-hooked vLLM v1 scheduler
(:class:`serving_hook.KVPilotScheduler`, built by :mod:`simulator.engine` on the
CPU), behind a router (:mod:`simulator.routers`), and returns the run's summary
(:func:`simulator.metrics.summarize`) with the hook's telemetry written under
``out_dir/telemetry``.

Engine
------
Each request's prompt is the workload's hash chain expanded into token ids
(:class:`simulator.tokens.WorkloadTokens`), so vLLM's own block hashing sees
exactly the workload's sharing. The fake runner emits the workload's own output
ids, ending a response that finishes ``stop`` / ``tool_call`` with an EOS (a stop
token) at its target length, and a ``length`` one at ``max_tokens``; the
request keeps the workload's ``max_tokens``, so a policy never sees the true
length. vLLM never computes the last sampled token, so the EOS changes no cached
block, and a next turn (previous prompt + output + tool tokens) hits the cache
exactly as in production. Request metadata reaches the hook as ``kvpilot_*``
``extra_args``, as in production.

Time
----
A heap of ``(time, priority, seq, event)`` drives all replicas. Each replica has
its own clock, which is the hook's ``kvpilot_clock``: an engine step starts at
the replica's clock with ``schedule()``, lasts the cost model's
:meth:`~simulator.cost_model.CostModel.step_time` of what it scheduled (prefill
tokens and their attention pairs, decode sequences and their context), and ends
with ``update_from_output()`` at the later time, so telemetry and policies see
simulated time and each ``steps`` row covers ``[time_s, time_s + duration_s]``.
Requests that arrive during a step are added at its end (vLLM's engine core
adds requests between steps); an idle replica starts a step at the arrival time,
after every other event of that instant. A step that schedules nothing (every
waiting request held back or blocked) still takes ``idle_step_s``, so TTLs run
out; a replica that makes no progress for ``stall_steps`` such steps while
nothing else can happen (no event pending but other stalled replicas' steps) is
an error.

Decode stride
-------------
With ``decode_stride`` k > 1 the fake runner returns up to k sampled tokens per
request per step (never past its script: the EOS or ``max_tokens``), as a model
runner does with accepted speculative tokens: vLLM's ``update_from_output``
appends them all and checks each for a stop, and the next ``schedule()`` gives
the request those k uncomputed tokens as one chunk, allocating their KV. One
simulated step so stands for k engine iterations, and a run makes about k times
fewer scheduler calls (the cost of a run is almost all vLLM's own
``schedule()`` / ``update_from_output()``, one call per decoded token at k = 1).

* Cost: :meth:`~simulator.cost_model.CostModel.strided_step_time`: the step's
  prefill once, plus one decode iteration per sampled token, each with its own
  context (:meth:`Simulation._strided_output`). A request of L output tokens is
  charged its prefill and L - 1 decode iterations, as at k = 1.
* Token budget: vLLM gets ``k x max_num_batched_tokens``. k iterations would
  each have had the budget, so prefill gets ``k x (budget - decoding
  sequences)`` tokens per step, the same admission rate per simulated second
  as at k = 1 (with the plain budget, k x the decode tokens would eat it and
  starve prefill). Policies see this budget in ``EngineState``.
* Telemetry: the hook's ``kvpilot_decode_stride`` is k, so ``steps`` rows
  count a decode chunk's tokens (not its sequences) in ``decode_tokens``.
* What is approximate: the scheduler (and a policy) decides once per k
  iterations, so preemption, admission and eviction happen at step
  granularity; a request's KV grows in chunks of k tokens; events inside a
  step (a finish, a tool's return, an arrival) take effect at its end, up to
  one step late instead of one iteration (k iterations; the default workload's
  iterations average 10.4 ms on H200-7B, so ~0.17 s per event at k = 16 and
  ~0.33 s at k = 32, against tool latencies of 0.17 s median and makespans of
  minutes); a request's last sampled batch (up to k tokens) is never computed,
  so a next turn's prompt can miss the one block holding it, and a preempted
  request's recompute is counted up to k - 1 tokens short.
  ``benchmarks/bench_stride.py`` measures the effect on makespan, preemptions,
  hit rate and policy ratios. ``simulate`` defaults to k = 1 (exact: a single
  run's numbers should not carry this approximation), ``evaluate`` to
  :data:`training.evaluate.DEFAULT_DECODE_STRIDE` (32: a grid of many runs; on
  the default workload vllm-default's makespan is within 0.2 % of the exact one,
  and five measured policy ratios to it within 1.7 % of theirs, 2.2 % at k = 16).

Drivers
-------
* **Synchronous RL steps** (every ``arrival_s`` null): step s is released when
  step s-1 ends, all its turn-0 requests at once; it ends when every trajectory
  of it and its verification are done.
* **Multi-turn sessions**: a turn that is not its session's last returns, after
  its ``tool_latency_s``, as the next turn (a new request whose prompt extends
  the context). Its chain shares the previous turn's blocks, so it hits the
  cache only if they were kept.
* **Verification and scoring**: when a trajectory's last turn ends, its verifier
  runs for that turn's ``verify_latency_s`` and its reward-model scoring
  requests (rows whose ``scores_session_id`` names it) are submitted; each
  scoring request is then verified (parsed) for its own ``verify_latency_s``.
  The trajectory ends when all of these are done.
* **Over-provisioning** (:class:`Overprovision`): a step ends as soon as its
  quota of trajectories is done; the rest are aborted (vLLM ``finish_requests``
  with ``FINISHED_ABORTED``) and their later turns never sent.
* **Tail batching** (a policy whose ``step_driver`` has ``kind == "tail-batching"``,
  e.g. :class:`policy.baselines.rollpacker.TailBatchingPolicy`): each step keeps
  the first ``ceil(G / eta)`` samples of its first ``ceil(L / eta)`` complete
  prompts, aborts the rest, queues the cut prompts, and re-runs them from
  scratch in dedicated long rounds (see :mod:`policy.baselines.rollpacker`).
* **Trace replay** (every ``arrival_s`` set): each request arrives at its own
  ``arrival_s``; a trajectory (session) ends at its last request's finish plus
  verification, and each ``step`` value is one window from its first arrival.

With ``sticky_sessions`` (default) a session's later turns and its scoring
requests go to the replica of its first turn (told to the router through
``on_routed``); otherwise every request is routed. A router sees a request's
vLLM block hashes (its prompt's full blocks, as signed int64) and each
replica's KV events (``Router.on_kv_event``, from the hook's event listener at
every step's end), so the ``kv-aware`` router's index is built from the
replicas' own events, as llm-d builds it from vLLM's event stream.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import heapq
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from policy.interface import Policy
from serving_hook.events import hashes_to_int64
from simulator import engine  # before vLLM: it silences vLLM's start-up noise
from simulator.cost_model import CostModel
from simulator.metrics import StepRecord, TrajectoryRecord, render_summary, summarize
from simulator.routers import ReplicaLoad, Router, RouteRequest, make_router
from simulator.sizing import blocks_for_fraction, min_blocks_for
from simulator.tokens import VLLM_BLOCK_SIZE, WorkloadTokens

__all__ = ["Overprovision", "SimResult", "Simulation", "SimulationError", "render_summary", "run_simulation"]

EOS_TOKEN_ID = 2  # the tiny model's eos id; workload token ids are never below 3

PolicySpec = str | Callable[[], Policy] | Policy

# Event kinds, and their priority at equal time (lower first): arrivals and step
# ends before the start of an idle replica's next step, so same-instant requests
# join one step.
_ARRIVE, _STEP_END, _VERIFIED, _RELEASE, _KICK = range(5)
_PRIORITY = {_ARRIVE: 0, _STEP_END: 0, _VERIFIED: 0, _RELEASE: 0, _KICK: 1}


#: The hook's per-step policy budget in simulation. The serving default (5 ms of
#: wall time) would make runs depend on this machine's load and GC pauses; a
#: simulation measures decisions in simulated time, and benchmarks/bench_hook.py
#: measures their wall-clock cost.
SIM_DECISION_BUDGET_S = 1.0


class SimulationError(ValueError):
    """A bad simulation configuration (raised before simulating) or a stalled run."""


@dataclass(frozen=True)
class Overprovision:
    """Stop each RL step at a quota of done trajectories and abort the rest (RollPacker / APRIL style).

    The workload itself holds the launched (over-provisioned) prompts; the quota is
    ``keep`` trajectories per step, or ``ceil(keep_fraction * launched)``.
    """

    keep_fraction: float = 1.0
    keep: int | None = None

    def __post_init__(self) -> None:
        if self.keep is not None and self.keep < 1:
            raise SimulationError(f"over-provisioning: keep must be >= 1, got {self.keep}")
        if not 0.0 < self.keep_fraction <= 1.0:
            raise SimulationError(f"over-provisioning: keep_fraction must be in (0, 1], got {self.keep_fraction}")

    def quota(self, launched: int) -> int:
        if self.keep is not None:
            return min(self.keep, launched)
        return max(1, min(launched, math.ceil(self.keep_fraction * launched - 1e-9)))


@dataclass
class SimResult:
    """What a run returns: the summary (also ``out_dir/summary.json``), where telemetry went, and timings."""

    summary: dict[str, Any]
    out_dir: Path | None
    requests: pa.Table  # the hook's requests telemetry
    steps: pa.Table  # the hook's steps telemetry
    trajectories: list[TrajectoryRecord] = field(default_factory=list)
    rl_steps: list[StepRecord] = field(default_factory=list)
    wall_s: float = 0.0  # the simulation loop (set-up and summary excluded)
    scheduler_s: float = 0.0  # inside schedule() + update_from_output(), hook included
    hook_s: float = 0.0  # the hook's own share of scheduler_s

    @property
    def overhead(self) -> float:
        """Simulator time outside the scheduler, over the time inside it."""
        return (self.wall_s - self.scheduler_s) / self.scheduler_s if self.scheduler_s > 0 else 0.0


class _Replica:
    __slots__ = (
        "aborts",
        "busy",
        "idle_steps",
        "index",
        "kicked",
        "mro",
        "now",
        "out",
        "pending",
        "requests",
        "sched",
        "steps",
    )

    def __init__(self, index: int, sched: Any) -> None:
        self.index = index
        self.sched = sched
        self.requests = sched.requests  # vLLM's dict: request id -> Request
        self.now = 0.0
        self.busy = False
        self.kicked = False
        self.pending: list = []  # requests that arrived during a step, added at its end
        self.aborts: set = set()  # request ids to abort at the next step boundary
        self.out = None
        self.mro = None
        self.idle_steps = 0
        self.steps = 0


class _Traj:
    """One trajectory (rollout session) as the driver tracks it."""

    __slots__ = (
        "aborted",
        "done",
        "end",
        "live",
        "next_turn",
        "outstanding",
        "scoring",
        "session",
        "start",
        "step",
        "turns",
        "waiting_row",
    )

    def __init__(self, session: str, step: int) -> None:
        self.session = session
        self.step = step
        self.turns: list[int] = []  # rows, by turn
        self.scoring: list[int] = []  # rows of requests scoring it
        self.next_turn = 0
        self.outstanding = 0
        self.start = 0.0
        self.end = 0.0
        self.aborted = False
        self.live: set = set()  # request ids of its requests submitted and not finished
        self.done = False
        self.waiting_row: int | None = None  # a next turn in flight (tool call), not yet submitted


class Simulation:
    """One configured run; :meth:`run` simulates it. See the module docstring and :func:`run_simulation`."""

    def __init__(
        self,
        workload: pa.Table,
        policy: PolicySpec = "vllm-default",
        *,
        policy_options: dict[str, Any] | None = None,
        replicas: int = 1,
        router: str | Router = "round-robin",
        kv_blocks: int | None = None,
        kv_fraction: float | None = None,
        preset: str = "H200-7B",
        out_dir: str | Path | None = None,
        overprovision: Overprovision | None = None,
        progress: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        sticky_sessions: bool = True,
        decision_budget_s: float | None = SIM_DECISION_BUDGET_S,
        idle_step_s: float = 0.004,
        stall_steps: int = 100_000,
        validate: bool = True,
        decode_stride: int = 1,
        decision_log: bool = True,
        kv_event_log: bool = True,
    ) -> None:
        t0 = time.perf_counter()
        # ---- configuration checks, all before anything runs
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise SimulationError(f"replicas must be an integer >= 1, got {replicas!r}")
        try:
            self.cost = CostModel.preset(preset)
        except ValueError as e:
            raise SimulationError(str(e)) from None
        if kv_blocks is not None and kv_fraction is not None:
            raise SimulationError("give at most one of kv_blocks and kv_fraction")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise SimulationError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not isinstance(decode_stride, int) or isinstance(decode_stride, bool) or decode_stride < 1:
            raise SimulationError(f"decode_stride must be an integer >= 1, got {decode_stride!r}")
        if workload.num_rows == 0:
            raise SimulationError("the workload has no requests")
        if validate:
            from data.errors import DataValidationError
            from data.schemas import WORKLOAD
            from data.validate import validate_table

            try:
                workload = validate_table(workload, WORKLOAD, "workload")
            except DataValidationError as e:
                raise SimulationError(f"bad workload: {e}") from None
        self.workload = workload
        arrival = workload.column("arrival_s")
        if 0 < arrival.null_count < workload.num_rows:
            raise SimulationError("arrival_s must be set on every row (trace replay) or on none (RL steps); "
                                  f"{arrival.null_count} of {workload.num_rows} rows have none")
        self.trace = arrival.null_count == 0
        if overprovision is not None and self.trace:
            raise SimulationError("over-provisioning applies to RL steps, not to a trace replay")
        output = workload.column("output_tokens").to_numpy()
        if (output < 1).any():
            r = int(np.argmax(output < 1))
            raise SimulationError(f"request {workload.column('request_id')[r]} has output_tokens "
                                  f"{output[r]}: vLLM generates at least one token per request")
        self.policy_factory = _policy_factory(policy, policy_options, replicas, workload)
        self.tail = getattr(self.policy_factory(), "step_driver", None)
        if self.tail is not None:
            if getattr(self.tail, "kind", None) != "tail-batching":
                raise SimulationError(f"unknown step driver {self.tail!r} on the policy")
            if self.trace:
                raise SimulationError("tail batching applies to RL steps, not to a trace replay")
            if overprovision is not None:
                raise SimulationError("give either over-provisioning or a tail-batching policy, not both")
        if isinstance(router, str):
            try:
                self.router = make_router(router)
            except ValueError as e:
                raise SimulationError(str(e)) from None
            self.router_name = router
        else:
            self.router, self.router_name = router, type(router).__name__
        try:
            self.tokens = WorkloadTokens(workload)
        except ValueError as e:
            raise SimulationError(f"bad workload: {e}") from None
        need = min_blocks_for(workload)
        if kv_fraction is not None:
            if not kv_fraction > 0:
                raise SimulationError(f"kv fraction must be > 0, got {kv_fraction}")
            kv_blocks = blocks_for_fraction(workload, kv_fraction)
        elif kv_blocks is None:
            kv_blocks = self.cost.max_kv_blocks(VLLM_BLOCK_SIZE)
        if kv_blocks < need:
            raise SimulationError(
                f"KV cache of {kv_blocks} blocks is smaller than the largest request, which needs {need} blocks "
                f"of {VLLM_BLOCK_SIZE} tokens (prompt + output, plus vLLM's null block)"
                + (f"; raise --kv-fraction above {kv_fraction * need / kv_blocks:.3g}" if kv_fraction else ""))
        self.kv_blocks = int(kv_blocks)
        self.kv_fraction = kv_fraction
        self.n_replicas = replicas
        self.preset = preset
        self.overprovision = overprovision
        self.progress = progress
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.sticky = sticky_sessions
        self.decision_budget_s = decision_budget_s
        self.idle_step_s = idle_step_s
        self.stall_steps = stall_steps
        self.stride = decode_stride
        #: Log the ``decisions`` table (every candidate's features at every decision): training needs it,
        #: an evaluation that only compares summaries does not.
        self.decision_log = decision_log
        #: Log the ``kv_events`` table (every block stored or removed); the routers get the events either way.
        self.kv_event_log = kv_event_log
        self.out_dir = Path(out_dir) if out_dir is not None else None
        # Longest context a request reaches, for vLLM's max_model_len.
        full = workload.column("prompt_tokens").to_numpy().astype(np.int64) + output
        self.max_model_len = max(int(full.max()) + VLLM_BLOCK_SIZE, 1024)
        self._prepare()
        self.setup_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ set-up
    def _prepare(self) -> None:
        """Workload columns as Python lists, trajectories, steps."""
        w = self.workload
        col = lambda name: w.column(name).to_pylist()
        self.rid = col("request_id")
        self.kind = col("kind")
        self.step = col("step")
        self.group = col("group_id")
        self.prompt_id = col("prompt_id")
        self.group_size = col("group_size")
        self.session = col("session_id")
        self.turn = col("turn")
        self.domain = col("domain")
        self.paradigm = col("paradigm")
        self.max_tokens = col("max_tokens")
        self.finish = col("finish_reason")
        self.tool = col("tool")
        self.tool_latency = col("tool_latency_s")
        self.verify_latency = col("verify_latency_s")
        self.scores = col("scores_session_id")
        self.arrival = col("arrival_s")
        self.prompt_len = self.tokens.prompt.tolist()
        self.output_len = self.tokens.output.tolist()
        self.row_of = {r: i for i, r in enumerate(self.rid)}
        trajs: dict[str, _Traj] = {}
        for i in range(w.num_rows):
            if self.kind[i] == "rollout":
                t = trajs.get(self.session[i])
                if t is None:
                    t = trajs[self.session[i]] = _Traj(self.session[i], self.step[i])
                t.turns.append(i)
        for i in range(w.num_rows):
            if self.kind[i] != "rollout":
                target = trajs.get(self.scores[i]) if self.scores[i] is not None else None
                if target is None:  # the workload validator rejects this; a defensive check when validate=False
                    raise SimulationError(f"request {self.rid[i]}: dangling reference to session {self.scores[i]!r}")
                target.scoring.append(i)
        for t in trajs.values():
            t.turns.sort(key=lambda r: self.turn[r])
            if [self.turn[r] for r in t.turns] != list(range(len(t.turns))):
                raise SimulationError(f"session {t.session}: turns must be 0..n-1, got "
                                      f"{[self.turn[r] for r in t.turns]}")
        self.trajs = trajs
        self.traj_of_row: list[_Traj | None] = [None] * w.num_rows
        for t in trajs.values():
            for r in t.turns + t.scoring:
                self.traj_of_row[r] = t
        self.steps_order = sorted({t.step for t in trajs.values()})
        self.step_trajs: dict[int, list[_Traj]] = {s: [] for s in self.steps_order}
        for t in trajs.values():
            self.step_trajs[t.step].append(t)

    def _build_replicas(self, writer: Any) -> list[_Replica]:
        from serving_hook import KVPilotScheduler, with_policy
        from serving_hook.config import HookConfig

        reps = []
        for i in range(self.n_replicas):
            kw: dict[str, Any] = {"replica": i}
            if self.decision_budget_s is not None:
                kw["decision_budget_s"] = self.decision_budget_s
            cls = with_policy(KVPilotScheduler, self.policy_factory, HookConfig(**kw),
                              name=f"SimReplica{i}", shared_writer=writer)
            cfg = engine.make_vllm_config(
                num_blocks=self.kv_blocks,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens * self.stride,
                max_model_len=self.max_model_len,
            )
            sched = engine.make_scheduler(cls, num_blocks=self.kv_blocks, vllm_config=cfg)
            rep = _Replica(i, sched)
            sched.kvpilot_clock = _clock_of(rep)
            sched.kvpilot_decode_stride = self.stride
            if self.n_replicas > 1:
                sched.kvpilot_set_kv_event_listener(functools.partial(self.router.on_kv_event, i))
            reps.append(rep)
        return reps

    # ------------------------------------------------------------------ events
    def _push(self, t: float, kind: int, arg: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, _PRIORITY[kind], self._seq, kind, arg))

    def _kick(self, rep: _Replica, t: float) -> None:
        if not rep.busy and not rep.kicked:
            rep.kicked = True
            self._push(t, _KICK, rep)

    # ------------------------------------------------------------------ requests
    def _route(self, row: int, request: Any) -> _Replica:
        """The replica for workload row ``row``; ``request`` is its vLLM request (its block hashes go to the router:
        the hash space of the replicas' KV events, see :class:`simulator.routers.KVAwareRouter`)."""
        reps = self._reps
        if len(reps) == 1:
            return reps[0]
        traj = self.traj_of_row[row]
        stream = traj.session if traj is not None else self.session[row]
        prompt_len = self.prompt_len[row]
        hashes = hashes_to_int64(request.block_hashes[: prompt_len // VLLM_BLOCK_SIZE])
        req = RouteRequest(self.rid[row], hashes, prompt_len, VLLM_BLOCK_SIZE, self.session[row])
        if self.sticky:
            pinned = self._stream_replica.get(stream)
            if pinned is not None:
                self.router.on_routed(req, pinned)
                return reps[pinned]
        loads = [ReplicaLoad(r.index, len(r.sched.running) + len(r.sched.waiting) + len(r.pending)) for r in reps]
        chosen = self.router.route(req, loads)
        self._stream_replica.setdefault(stream, chosen)
        return reps[chosen]

    def _submit(self, row: int, t: float) -> None:
        """Request ``row`` arrives at time ``t``: build it, route it, add it (now or at its replica's step end)."""
        if self._stale_arrivals.get(row):  # the next turn of an aborted attempt (tail batching)
            self._stale_arrivals[row] -= 1
            return
        rid = self._alias.get(row) or self.rid[row]
        traj = self.traj_of_row[row]
        if traj is not None and traj.aborted:
            return
        if traj is not None and traj.waiting_row == row:
            traj.waiting_row = None
        extra = {
            "kvpilot_domain": self.domain[row],
            "kvpilot_paradigm": self.paradigm[row],
            "kvpilot_group_id": self.group[row],
            "kvpilot_group_size": self.group_size[row],
            "kvpilot_session_id": self.session[row],
            "kvpilot_turn": self.turn[row],
            "kvpilot_step": self.step[row],
            "kvpilot_prompt_id": self.prompt_id[row],
        }
        if self.tool[row] is not None:
            extra["kvpilot_tool"] = self.tool[row]
        out = self.tokens.output_ids(row).tolist()
        if self.finish[row] != "length" or self.output_len[row] < self.max_tokens[row]:
            out[-1] = EOS_TOKEN_ID  # the model stops here
        self._scripts[rid] = out
        req = engine.make_request(rid, self.tokens.prompt_ids(row).tolist(), self.max_tokens[row], arrival_time=t,
                           extra_args=extra, stop_token_ids=(EOS_TOKEN_ID,))
        rep = self._route(row, req)
        self._replica_of[rid] = rep
        if traj is not None:
            traj.live.add(rid)
        self._submitted[row] += 1
        if rep.busy:
            rep.pending.append(req)
        else:
            rep.now = max(rep.now, t)
            self._add(rep, req)
            self._kick(rep, t)

    def _add(self, rep: _Replica, req: Any) -> None:
        t = time.perf_counter()
        rep.sched.add_request(req)
        self._sched_s += time.perf_counter() - t

    # ------------------------------------------------------------------ engine steps
    def _start_step(self, rep: _Replica, t: float) -> None:
        rep.now = t
        sched = rep.sched
        if rep.aborts:
            self._apply_aborts(rep)
        if rep.pending:
            pending, rep.pending = rep.pending, []
            for req in pending:
                self._add(rep, req)
        if not sched.has_requests():
            return
        t0 = time.perf_counter()
        out = sched.schedule()
        self._sched_s += time.perf_counter() - t0
        if self.stride > 1:
            req_ids, sampled, dt = self._strided_output(rep, out)
        else:
            req_ids, sampled, dt = self._output(rep, out)
        rep.out = out
        rep.mro = self._mro_cls(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        if req_ids:
            rep.idle_steps = 0
        else:
            dt = self.idle_step_s
            rep.idle_steps += 1
            if rep.idle_steps >= self.stall_steps and all(  # nothing but other stalled replicas' idle steps left
                    e[3] in (_STEP_END, _KICK) and e[4].idle_steps >= self.stall_steps for e in self._heap):
                raise SimulationError(
                    f"replica {rep.index} stalled: {len(sched.waiting)} request(s) waiting, none schedulable for "
                    f"{rep.idle_steps} steps and nothing else pending (KV cache too small, or a policy holds "
                    "everything back)")
        rep.busy = True
        rep.steps += 1
        self._engine_steps += 1
        self._push(t + dt, _STEP_END, rep)

    def _output(self, rep: _Replica, out: Any) -> tuple[list[str], list[list[int]], float]:
        """The fake model's output (one token per request) and the step's cost, in one pass."""
        requests = rep.requests
        scripts = self._scripts
        req_ids = []
        sampled = []
        prefill = pairs = decode = context = 0
        empty: list = []
        for rid, n in out.num_scheduled_tokens.items():
            req_ids.append(rid)
            r = requests[rid]
            computed = r.num_computed_tokens  # schedule() already advanced it by n
            before = computed - n
            if computed < r.num_tokens:  # inside a partial prefill chunk: no token
                prefill += n
                pairs += n * before + n * (n + 1) // 2
                sampled.append(empty)
                continue
            if n == 1 and before >= r.num_prompt_tokens:
                decode += 1
                context += computed
            else:
                prefill += n
                pairs += n * before + n * (n + 1) // 2
            sampled.append([scripts[rid][r.num_output_tokens]])
        return req_ids, sampled, self.cost.step_time(prefill, pairs, decode, context)

    def _strided_output(self, rep: _Replica, out: Any) -> tuple[list[str], list[list[int]], float]:
        """Decode stride k: up to k tokens per request (never past its script) and the k iterations' cost.

        A request whose scheduled chunk is at most k tokens past its prompt is decoding: it computes the
        tokens it sampled last step and samples e more, one per iteration. A prefill chunk that completes
        samples its first token in iteration 1 and decodes the other e - 1 in iterations 2 .. e. So a request
        of L output tokens is charged its prefill and L - 1 decode iterations, each reading the context it
        reads at k = 1 (a lone request takes exactly as long as at k = 1).
        """
        k = self.stride
        requests = rep.requests
        scripts = self._scripts
        req_ids = []
        sampled = []
        prefill = pairs = 0
        ends = [0] * (k + 1)  # requests decoding through iteration e
        bases = [0] * (k + 1)  # their context base: iteration j reads base + j
        late = late_base = 0  # prefill completers, which do not decode in iteration 1
        empty: list = []
        for rid, n in out.num_scheduled_tokens.items():
            req_ids.append(rid)
            r = requests[rid]
            computed = r.num_computed_tokens  # schedule() already advanced it by n
            before = computed - n
            if computed < r.num_tokens:  # inside a partial chunk: no token
                prefill += n
                pairs += n * before + n * (n + 1) // 2
                sampled.append(empty)
                continue
            script = scripts[rid]
            pos = r.num_output_tokens
            e = min(k, len(script) - pos)
            sampled.append(script[pos:pos + e])
            # Sampling output token m reads prompt + m - 1 tokens, as at k = 1: iteration j reads computed - 1 + j.
            ends[e] += 1
            bases[e] += computed - 1
            if n > k or before < r.num_prompt_tokens:  # a prefill chunk: its iteration 1 samples the first token
                prefill += n
                pairs += n * before + n * (n + 1) // 2
                late += 1
                late_base += computed - 1
        seqs = [0] * k
        ctx = [0] * k
        s = b = 0
        for j in range(k, 0, -1):
            s += ends[j]
            b += bases[j]
            seqs[j - 1] = s
            ctx[j - 1] = b + j * s
        seqs[0] -= late
        ctx[0] -= late_base + late
        return req_ids, sampled, self.cost.strided_step_time(prefill, pairs, seqs, ctx)

    def _end_step(self, rep: _Replica, t: float) -> None:
        rep.now = t
        t0 = time.perf_counter()
        outs = rep.sched.update_from_output(rep.out, rep.mro)
        self._sched_s += time.perf_counter() - t0
        rep.out = rep.mro = None
        rep.busy = False
        for eco in outs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self._finished(o.request_id, t)
        if rep.aborts:
            self._apply_aborts(rep)
        if rep.pending or rep.sched.has_requests():
            self._kick(rep, t)

    def _apply_aborts(self, rep: _Replica) -> None:
        from vllm.v1.request import RequestStatus

        ids, rep.aborts = rep.aborts, set()
        rep.pending = [r for r in rep.pending if r.request_id not in ids]
        t0 = time.perf_counter()
        # One id at a time, in a fixed order: vLLM frees the blocks of a set of ids in the set's order, which
        # depends on the process's string hash seed, and the free order decides later evictions.
        for rid in sorted(ids):
            rep.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self._sched_s += time.perf_counter() - t0
        for rid in ids:
            self._scripts.pop(rid, None)
            self._replica_of.pop(rid, None)

    # ------------------------------------------------------------------ drivers
    def _finished(self, rid: str, t: float) -> None:
        self._scripts.pop(rid, None)
        self._replica_of.pop(rid, None)
        row = self.row_of[rid]
        self._finished_count[row] += 1
        self._finish_time[row] = t
        if self._bar is not None:
            self._bar.update(1)
        traj = self.traj_of_row[row]
        if traj is None or traj.aborted or rid not in traj.live:
            # not live: an aborted attempt's request that finished in the step its abort waited for, after
            # a long round (tail batching) gave its row to a fresh trajectory
            return
        traj.live.discard(rid)
        if self.trace:
            traj.end = max(traj.end, t + (self.verify_latency[row] or 0.0))
            traj.outstanding -= 1
            if traj.outstanding == 0:
                self._traj_done(traj, traj.end)
            return
        if self.kind[row] != "rollout":  # a scoring request: parse its score, then the trajectory may end
            self._push(t + (self.verify_latency[row] or 0.0), _VERIFIED, traj)
            return
        if traj.next_turn < len(traj.turns):  # the tool runs, then the next turn arrives
            nxt = traj.turns[traj.next_turn]
            traj.next_turn += 1
            traj.waiting_row = nxt
            self._push(t + (self.tool_latency[row] or 0.0), _ARRIVE, nxt)
            return
        traj.outstanding = 1 + len(traj.scoring)  # its verifier, then each scoring request's parse
        self._push(t + (self.verify_latency[row] or 0.0), _VERIFIED, traj)
        for s in traj.scoring:
            self._submit(s, t)

    def _verified(self, traj: _Traj, t: float) -> None:
        if traj.aborted:
            return
        traj.outstanding -= 1
        if traj.outstanding == 0:
            self._traj_done(traj, t)

    def _traj_done(self, traj: _Traj, t: float) -> None:
        traj.done = True
        traj.end = t
        self._traj_records.append(TrajectoryRecord(traj.session, traj.step, traj.start, t))
        st = self._step_state.get(traj.step)
        if st is None:
            return
        if st.get("tail") is not None:
            self._tail_traj_done(traj, st, t)
            return
        st["done"] += 1
        st["left"] -= 1
        if st["done"] >= st["quota"] and st["left"] > 0:
            self._abort_step(traj.step, t)
            st["left"] = 0
        if st["left"] == 0:
            self._step_records.append(StepRecord(traj.step, st["start"], t))
            del self._step_state[traj.step]
            if not self.trace:
                self._push(t, _RELEASE, st["index"] + 1)

    def _abort_step(self, step: int, t: float) -> None:
        """Over-provisioning: the step's quota is met; abort its unfinished trajectories."""
        for traj in self.step_trajs[step]:
            if traj.done or traj.aborted:
                continue
            traj.aborted = True
            self._aborted_trajs += 1
            for rid in traj.live:
                rep = self._replica_of.get(rid)
                if rep is None:
                    continue
                rep.aborts.add(rid)
                if not rep.busy:
                    rep.now = max(rep.now, t)
                    self._apply_aborts(rep)
            traj.live.clear()

    def _release(self, index: int, t: float) -> None:
        """Synchronous RL: release step ``steps_order[index]``, every trajectory's first turn at once."""
        if self.tail is not None:
            self._tail_release(t)
            return
        if index >= len(self.steps_order):
            return
        step = self.steps_order[index]
        trajs = self.step_trajs[step]
        quota = self.overprovision.quota(len(trajs)) if self.overprovision is not None else len(trajs)
        self._step_state[step] = {"index": index, "start": t, "done": 0, "left": len(trajs), "quota": quota}
        for traj in trajs:
            traj.start = t
            traj.next_turn = 1
            self._submit(traj.turns[0], t)

    # ------------------------------------------------------------------ tail batching (RollPacker)
    def _abort_trajs(self, trajs: list[_Traj], t: float) -> None:
        """Abort these trajectories: their live requests now or at their replica's step end, their next turns."""
        for traj in trajs:
            if traj.done or traj.aborted:
                continue
            traj.aborted = True
            self._aborted_trajs += 1
            if traj.waiting_row is not None:
                self._stale_arrivals[traj.waiting_row] = self._stale_arrivals.get(traj.waiting_row, 0) + 1
                traj.waiting_row = None
            for rid in traj.live:
                rep = self._replica_of.get(rid)
                if rep is None:
                    continue
                rep.aborts.add(rid)
                if not rep.busy:
                    rep.now = max(rep.now, t)
                    self._apply_aborts(rep)
            traj.live.clear()

    def _tail_groups(self, trajs: list[_Traj]) -> dict[str, list[_Traj]]:
        groups: dict[str, list[_Traj]] = {}
        for traj in trajs:
            groups.setdefault(self.group[traj.turns[0]], []).append(traj)
        return groups

    def _tail_release(self, t: float) -> None:
        """The next tail-batching round: a long round when the queue is full (or at the end), else the next step."""
        spec = self.tail
        queue = self._long_queue
        size = self._long_size
        more_steps = self._tail_next < len(self.steps_order)
        if queue and (len(queue) >= size or (not more_steps and spec.flush_at_end)):
            take, queue[:] = queue[:size], queue[size:]
            k = len(self.long_rounds)
            round_id = self._long_next_id
            self._long_next_id += 1
            self.long_rounds.append((round_id, [g for g, _ in take]))
            trajs = []
            for _, old in take:  # fresh trajectories (stale events of the old attempt see the aborted objects)
                for o in old:
                    traj = _Traj(o.session, round_id)
                    traj.turns, traj.scoring = o.turns, o.scoring
                    for r in traj.turns + traj.scoring:
                        self.traj_of_row[r] = traj
                        alias = f"{self.rid[r]}#long{k}"
                        self._alias[r] = alias
                        self.row_of[alias] = r
                        self.tokens._row[alias] = r
                    trajs.append(traj)
            self.step_trajs[round_id] = trajs
            self._step_state[round_id] = {"index": -1, "start": t, "done": 0, "left": len(trajs),
                                          "quota": len(trajs)}
        elif more_steps:
            step = self.steps_order[self._tail_next]
            self._tail_next += 1
            trajs = self.step_trajs[step]
            groups = self._tail_groups(trajs)
            need = {g: spec.kept(len(ts)) for g, ts in groups.items()}
            self._step_state[step] = {"index": -1, "start": t, "done": 0, "left": len(trajs), "quota": len(trajs),
                                      "tail": {"groups": groups, "need": need, "prompts": spec.kept(len(groups)),
                                               "finished": {}, "complete": []}}
            if self._long_size is None:
                self._long_size = spec.long_round_prompts or spec.kept(len(groups))
        else:
            if queue:  # flush_at_end=False: the queued prompts are dropped
                self.dropped_long_prompts.extend(g for g, _ in queue)
                queue.clear()
            return
        for traj in trajs:
            traj.start = t
            traj.next_turn = 1
            self._submit(traj.turns[0], t)

    def _tail_traj_done(self, traj: _Traj, st: dict, t: float) -> None:
        tb = st["tail"]
        g = self.group[traj.turns[0]]
        tb["finished"][g] = tb["finished"].get(g, 0) + 1
        if tb["finished"][g] == tb["need"][g]:  # the prompt is complete: its first R samples are kept
            tb["complete"].append(g)
            self._abort_trajs(tb["groups"][g], t)
            if len(tb["complete"]) >= tb["prompts"]:  # the step's quota: cut everything else
                kept = set(tb["complete"])
                cut = [h for h in tb["groups"] if h not in kept]
                for h in cut:
                    self._abort_trajs(tb["groups"][h], t)
                    self._long_queue.append((h, tb["groups"][h]))
                cut_sessions = {x.session for h in cut for x in tb["groups"][h]}
                self._traj_records = [r for r in self._traj_records
                                      if not (r.step == traj.step and r.session_id in cut_sessions)]
                self.cut_prompts[traj.step] = cut
        if all(x.done or x.aborted for x in self.step_trajs[traj.step]):
            self._step_records.append(StepRecord(traj.step, st["start"], t))
            del self._step_state[traj.step]
            self._push(t, _RELEASE, 0)

    # ------------------------------------------------------------------ the run
    def run(self) -> SimResult:
        import json

        from vllm.v1.outputs import ModelRunnerOutput

        from data.io import read_telemetry
        from data.schemas import TELEMETRY_TABLES
        from policy.interface import FEATURE_NAMES
        from serving_hook.telemetry import TelemetryWriter

        self._mro_cls = ModelRunnerOutput
        tmp = None
        if self.out_dir is None:
            tmp = Path(tempfile.mkdtemp(prefix="kvpilot-sim-"))
            out_dir = tmp
        else:
            out_dir = self.out_dir
            out_dir.mkdir(parents=True, exist_ok=True)
        tel_dir = out_dir / "telemetry"
        if tel_dir.exists() and any(tel_dir.iterdir()):
            raise SimulationError(f"{tel_dir} already holds telemetry; choose an empty output directory")
        meta = {"decisions": {"kvpilot.feature_names": json.dumps({k: list(v) for k, v in FEATURE_NAMES.items()})}}
        left_out = {t for t, on in (("decisions", self.decision_log), ("kv_events", self.kv_event_log)) if not on}
        tables = [t for t in TELEMETRY_TABLES if t not in left_out] if left_out else None
        writer = TelemetryWriter(tel_dir, capacity=2_000_000, rows_per_file=200_000, flush_interval_s=30.0,
                                 metadata=meta, tables=tables)
        try:
            self._reps = self._build_replicas(writer)
            # The block pools are millions of long-lived objects: keep them out of the collector's scans.
            gc.collect()
            gc.freeze()
            try:
                with _vllm_envs_cached():
                    result = self._loop(writer)
            finally:
                gc.unfreeze()
        finally:
            writer.close()
        dropped = writer.dropped
        requests = read_telemetry(tel_dir, "requests")
        steps = read_telemetry(tel_dir, "steps")
        summary = summarize(self.workload, requests, steps, self._traj_records, self._step_records,
                            tokens=self.tokens)
        summary.update(
            policy=self._policy_name, router=self.router_name if self.n_replicas > 1 else None,
            replicas=self.n_replicas, kv_blocks=self.kv_blocks, kv_fraction=self.kv_fraction, preset=self.preset,
            decode_stride=self.stride, engine_steps=self._engine_steps, aborted_trajectories=self._aborted_trajs,
            telemetry_dropped_rows=dropped, wall_s=result.wall_s, scheduler_s=result.scheduler_s,
            hook_s=result.hook_s, simulator_overhead=result.overhead,
            # policy ``registry``: the registry version served at the end (replica 0) and swaps after start-up
            model_version=self._reps[0].sched.kvpilot_stats.model_version,
            model_swaps=sum(rep.sched.kvpilot_stats.model_swaps for rep in self._reps),
        )
        result.summary, result.requests, result.steps = summary, requests, steps
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            result.out_dir = None
        else:
            (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            result.out_dir = out_dir
        return result

    def _loop(self, writer: Any) -> SimResult:
        n = self.workload.num_rows
        self._heap: list = []
        self._seq = 0
        self._scripts: dict[str, list[int]] = {}
        self._replica_of: dict[str, _Replica] = {}
        self._stream_replica: dict[str, int] = {}
        self._submitted = [0] * n
        self._finished_count = [0] * n
        self._finish_time = [math.nan] * n
        self._traj_records: list[TrajectoryRecord] = []
        self._step_records: list[StepRecord] = []
        self._step_state: dict[int, dict] = {}
        self._aborted_trajs = 0
        self._stale_arrivals: dict[int, int] = {}
        self._alias: dict[int, str] = {}
        self._long_queue: list[tuple[str, list[_Traj]]] = []
        self._long_size: int | None = None
        self._long_next_id = (max(self.steps_order) + 1) if self.steps_order else 0
        self._tail_next = 0
        self.long_rounds: list[tuple[int, list[str]]] = []  # tail batching: (round id, group ids) per long round
        self.cut_prompts: dict[int, list[str]] = {}  # tail batching: per workload step, its cut group ids
        self.dropped_long_prompts: list[str] = []
        self._engine_steps = 0
        self._sched_s = 0.0
        self._policy_name = self._reps[0].sched.kvpilot_policy.name
        self._bar = None
        if self.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=n, file=sys.stderr, unit="req", desc="simulating", mininterval=0.5,
                             dynamic_ncols=True)
        if self.trace:
            firsts: dict[int, float] = {}
            for t in self.trajs.values():
                rows = t.turns + t.scoring
                t.start = min(self.arrival[r] for r in rows)
                t.outstanding = len(rows)
                firsts[t.step] = min(firsts.get(t.step, math.inf), t.start)
            for s in self.steps_order:
                self._step_state[s] = {"index": self.steps_order.index(s), "start": firsts[s], "done": 0,
                                       "left": len(self.step_trajs[s]), "quota": len(self.step_trajs[s])}
            for r in sorted(range(n), key=lambda r: (self.arrival[r], r)):
                self._push(self.arrival[r], _ARRIVE, r)
        else:
            self._push(0.0, _RELEASE, 0)
        heap = self._heap
        pop = heapq.heappop
        t_start = time.perf_counter()
        try:
            while heap:
                t, _, _, kind, arg = pop(heap)
                if kind == _STEP_END:
                    self._end_step(arg, t)
                elif kind == _KICK:
                    arg.kicked = False
                    if not arg.busy:
                        self._start_step(arg, t)
                elif kind == _ARRIVE:
                    self._submit(arg, t)
                elif kind == _VERIFIED:
                    self._verified(arg, t)
                else:
                    self._release(arg, t)
        finally:
            if self._bar is not None:
                self._bar.close()
        wall = time.perf_counter() - t_start
        hook = sum(r.sched.kvpilot_stats.hook_time_s for r in self._reps)
        for r in self._reps:
            r.sched.kvpilot_close()
        left = [self.rid[i] for i in range(n) if self._submitted[i] != self._finished_count[i]]
        unfinished = [s for s in self._step_state]
        if self.overprovision is None and self.tail is None and (left or unfinished):
            raise SimulationError(f"the run ended with {len(left)} request(s) unfinished (e.g. {left[:3]}) and "
                                  f"step(s) {unfinished} open")
        return SimResult(summary={}, out_dir=None, requests=pa.table({}), steps=pa.table({}),
                         trajectories=self._traj_records, rl_steps=self._step_records, wall_s=wall,
                         scheduler_s=self._sched_s, hook_s=hook)

    # ------------------------------------------------------------------ inspection for tests
    @property
    def submitted(self) -> list[int]:
        """Per workload row: how many times it was submitted to an engine."""
        return list(self._submitted)

    @property
    def finished(self) -> list[int]:
        """Per workload row: how many times an engine finished it (aborts excluded)."""
        return list(self._finished_count)

    @property
    def finish_times(self) -> list[float]:
        return list(self._finish_time)


@contextlib.contextmanager
def _vllm_envs_cached() -> Iterator[None]:
    """vLLM's environment variables read once, as vLLM's EngineCore does after start-up; restored afterwards.

    Unless cached, every ``vllm.envs.X`` read looks up ``os.environ`` (``maybe_convert_block_hash`` reads one
    per hashed block). The cache is lifted at the end, so that a later run in this process sees changes."""
    import vllm.envs as envs

    was_cached = hasattr(envs.__getattr__, "cache_clear")
    envs.enable_envs_cache()
    try:
        yield
    finally:
        if not was_cached:
            envs.disable_envs_cache()


def _clock_of(rep: _Replica) -> Callable[[], float]:
    return lambda: rep.now


def _policy_factory(
    policy: PolicySpec, options: dict[str, Any] | None, replicas: int, workload: pa.Table
) -> Callable[[], Policy]:
    """A zero-argument factory of fresh policies (one per replica); fails now on an unknown name or bad options.

    Registry factories that declare a ``workload`` parameter (hindsight oracles) get the simulated workload.
    """
    if isinstance(policy, Policy):
        if replicas > 1:
            raise SimulationError("pass a policy name or factory, not one instance, to simulate several replicas")
        return lambda: policy
    if isinstance(policy, str):
        from policy.catalog import create_policy

        opts = dict(options or {})
        try:
            create_policy(policy, workload=workload, **opts)
        except ValueError as e:  # UnknownPolicyError is a ValueError
            raise SimulationError(str(e)) from None
        return lambda: create_policy(policy, workload=workload, **opts)
    if callable(policy):
        factory = (lambda: policy(**options)) if options else policy
        probe = factory()
        if not isinstance(probe, Policy):
            raise SimulationError(f"the policy factory returned {type(probe).__name__}, not a Policy")
        return factory
    raise SimulationError(f"policy must be a registry name, a factory or a Policy, got {type(policy).__name__}")


def run_simulation(
    workload: pa.Table,
    policy: PolicySpec = "vllm-default",
    *,
    replicas: int = 1,
    router: str | Router = "round-robin",
    kv_blocks: int | None = None,
    kv_fraction: float | None = None,
    preset: str = "H200-7B",
    out_dir: str | Path | None = None,
    overprovision: Overprovision | None = None,
    progress: bool = True,
    **options: Any,
) -> SimResult:
    """Simulate ``workload`` under ``policy`` (a registry name, a factory or, for one replica, an instance).

    ``kv_blocks`` (vLLM blocks per replica, its null block included) or ``kv_fraction``
    (:func:`simulator.sizing.blocks_for_fraction`); neither: the preset's GPU capacity.
    Other keyword options go to :class:`Simulation` (``policy_options``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``sticky_sessions``, ``decision_budget_s``, ...).
    Bad configurations raise :class:`SimulationError` before anything runs.
    """
    sim = Simulation(workload, policy, replicas=replicas, router=router, kv_blocks=kv_blocks,
                     kv_fraction=kv_fraction, preset=preset, out_dir=out_dir, overprovision=overprovision,
                     progress=progress, **options)
    result = sim.run()
    result.summary["setup_s"] = sim.setup_s
    return result
