"""Asynchronous RL: rollouts without the step barrier, a trainer beside them, weight updates mid-session.

The workload's GRPO groups (in step order) are the stream of work. A rollout controller keeps groups in flight
under a staleness bound ``eta``; the trainer consumes batches of ``B`` finished groups
(:class:`simulator.config.Trainer`: ``B`` defaults to the workload's groups per RL step, so a synchronous run of
the same workload trains the same batches), each training step priced from its tokens, then updates the
weights, pausing generation for the update's price. Versions: the weights start at 0 and the update after
training step k makes version k + 1; a group started at version v is trained at version k with staleness
``k - v``, and every trajectory records the versions it spanned (``TrajectoryRecord.version_start`` /
``version_end``).

Admission (:class:`simulator.config.AsyncRL`):

* ``staleness``: AReaL's capacity rule, FCFS over groups: with ``started`` groups so far and ``v`` the current
  version, admit while ``started < (eta + v + 1) x B`` (and ``max_concurrent_groups``, if set).
* ``kv-pressure``: prime-rl's controller inside the same rule: a concurrency limit that starts at the fleet's KV
  capacity over a group's largest context (at least one group), grows by one group when a group ends with the
  fleet's KV use below ``kv_low`` and shrinks by one above ``kv_high``. prime-rl also cancels its youngest
  episodes near the ceiling; here the limit only stops admission (no work is thrown away).
* ``working-set``: kvpilot's width inside the same rule (:mod:`policy.group_width`): the next group starts only
  while the predicted peak contexts of the sessions in flight and of its own fit in the fleet's GPU KV plus its
  host tier (one group always may). A session's peak is predicted by domain from the policy's logged prior
  (:attr:`policy.interface.Policy.session_contexts`), refined by each session that ends; one in flight counts
  at least its context now (the prompt of its latest turn). It is checked whenever a session ends. While the
  groups run, a session's next turn is held while the contexts now of the sessions in flight of its group and
  every older group, a running one's host copy counted too, do not fit in GPU KV plus the tier (the oldest
  group's never is; :func:`policy.group_width.working_set_holds`). When a session's end makes room, the held
  turns that fit go, oldest group first; a younger group's turn that fits goes even while an older group's does
  not (backfill). GPU KV and the tier are summed over the replicas.
* ``auto`` (the default): ``working-set`` for a policy with a logged prior, else ``staleness``.

The trainer takes the ``B`` finished groups of the lowest start version (then finish order), but never a batch
after which some group could no longer be trained by version ``v + eta`` (earliest deadline first with a
feasibility check: for each m in k..k+eta, the groups left with deadline <= m must fit in the m - k batches
before it); it waits for more groups instead. So staleness never exceeds ``eta``. The last batch may be partial.

Weight updates (``weight_sync``), at the end of each training step; every replica stops generating for
``Trainer.sync_s`` (a step in flight ends first) and then:

* ``abort`` (AReaL, verl fully-async, slime): every request on the engines is aborted and the prefix cache reset;
  at the update's end each is resubmitted with its prompt plus the tokens it had sampled (a new request id,
  ``<request_id>#a<update>``), and its context is prefilled again. A replica whose step in flight outlasts the
  update aborts at that step's end, and resubmits at once.
* ``recompute`` (vLLM's ``pause_generation(mode="keep", clear_cache=True)``): vLLM's
  ``reset_prefix_cache(reset_running_requests=True)`` preempts every running request and clears the cache; they
  recompute their context when rescheduled.
* ``keep`` (SkyRL, prime-rl, PipelineRL, NeMo RL): nothing is reset; in-flight requests keep their old-version KV
  and every request carries vLLM's ``cache_salt`` of its group's start version, so a session keeps hitting its
  own blocks while groups of other versions cannot share them.

``reprefill_tokens`` counts what an update throws away: the computed tokens of the requests it aborts or preempts,
plus (abort and recompute) the context of sessions paused on a tool, whose cached blocks the reset drops.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from policy.group_width import SessionContexts, working_set_admits, working_set_holds
from simulator import engine
from simulator.clock import RELEASE, SYNC_END, TRAIN_END, EventClock
from simulator.config import AsyncRL, SimulationError, Trainer
from simulator.drivers import StepDriver, Trajectory
from simulator.metrics import StepRecord, TrainRecord, TrajectoryRecord
from simulator.replica import Fleet, Replica
from simulator.round_trip import RoundTrip
from simulator.runner import ScriptedRunner
from simulator.workload import PreparedWorkload

__all__ = ["AsyncDriver", "Group", "grpo_groups", "next_batch"]


def grpo_groups(workload: PreparedWorkload, sessions: list[Any]) -> tuple[list[list[Any]], int]:
    """The workload's GRPO groups in start order (step, then first row), each the list of its ``sessions`` (anything
    with ``step`` and ``turns``), and the groups of the first RL step (the trainer's default batch)."""
    w = workload
    by_group: dict[tuple[int, str], list[Any]] = {}
    for s in sessions:
        by_group.setdefault((s.step, w.group_id[s.turns[0]]), []).append(s)
    order = sorted(by_group, key=lambda k: (w.steps.index(k[0]), min(x.turns[0] for x in by_group[k])))
    first = w.steps[0]
    return [by_group[k] for k in order], sum(1 for k in by_group if k[0] == first)


def next_batch(ready: list[Any], unconsumed: list[Any], batch: int, eta: int, version: int,
               last: bool) -> list[Any] | None:
    """The trainer's next batch at weight version ``version``, or None: wait (see the module docstring).

    ``ready``: the finished groups not trained; ``unconsumed``: every group started and not trained (the ready ones
    included); each has ``index``, ``version`` (its start version) and ``finish_seq``. ``last``: every group has
    started and none runs, so a partial batch may go.
    """
    ready = sorted(ready, key=lambda g: (g.version, g.finish_seq))
    if len(ready) >= batch:
        taken = ready[:batch]
    elif ready and last:
        taken = ready  # the last, partial batch
    else:
        return None
    ids = {g.index for g in taken}
    rest = [g.version + eta for g in unconsumed if g.index not in ids]  # deadlines
    for m in range(version, version + eta + 1):
        if sum(1 for d in rest if d <= m) > (m - version) * batch:
            return None
    return taken


class Group:
    """One GRPO group: its trajectories, the version it started at, when it started and ended."""

    __slots__ = ("end", "finish_seq", "index", "left", "start", "trajs", "version")

    def __init__(self, index: int, trajs: list[Trajectory]) -> None:
        self.index = index
        self.trajs = trajs
        self.left = len(trajs)
        self.version = -1  # not started
        self.start = 0.0
        self.end = 0.0
        self.finish_seq = 0


class AsyncDriver(StepDriver):
    """Asynchronous rollouts under a staleness bound, a trainer consuming batches of finished groups, and weight
    updates in one of three modes (see the module docstring); the handlers :meth:`release`, :meth:`trained` and
    :meth:`synced` besides the synchronous driver's."""

    def __init__(self, workload: PreparedWorkload, fleet: Fleet, clock: EventClock, runner: ScriptedRunner,
                 progress: Any = None, *, spec: AsyncRL, trainer: Trainer, session_ids: bool = True,
                 tier_tokens: int = 0, session_contexts: Any = None, round_trip: RoundTrip | None = None) -> None:
        if workload.trace:
            raise SimulationError("the async driver runs RL steps, not a trace replay (every arrival_s is set)")
        super().__init__(workload, fleet, clock, runner, None, progress, reset_at_weight_sync=False, trainer=trainer,
                         session_ids=session_ids, round_trip=round_trip)
        self.spec = spec
        w = workload
        groups, first_step = grpo_groups(w, self.trajectories)
        self.groups = [Group(i, trajs) for i, trajs in enumerate(groups)]
        self.group_of = {x.session: g for g in self.groups for x in g.trajs}
        self.batch = trainer.train_batch or first_step
        self.next_group = 0  # groups started
        self.running_groups = 0
        self.ready: list[Group] = []  # finished, not trained
        self.unconsumed: set[int] = set()  # started, not trained (group indices)
        self._finish_seq = 0
        self.trainer_busy = False
        self.sync_s = trainer.sync_s(runner.cost)
        self.replicas = len(fleet.replicas)
        self.staleness: list[int] = []  # per trained trajectory
        self.updates = 0
        self.reprefill_tokens = 0
        self.kv_by_age: dict[int, int] = defaultdict(int)  # version age -> tokens held, summed over updates
        self._resubmit: list[tuple[int, int, Trajectory]] = []  # abort: (row, tokens sampled, trajectory)
        self._updating = False  # a weight update is under way (from a training step's end to its sync's)
        self._alias_of_row: dict[int, str] = {}
        self._sampled: dict[str, int] = {}  # a resubmitted request's id -> the output tokens its prompt holds
        self.cache_epoch = [0] * w.num_rows  # per row: the cache it could hit (version salt or reset epoch)
        self._epoch = 0  # abort / recompute: prefix-cache resets so far
        total_tokens = sum(r.kv_blocks for r in fleet.replicas) * 16
        group_need = max(len(g.trajs) for g in self.groups) * max(w.largest_request, 1)
        self.kv_limit = max(1, total_tokens // group_need)  # kv-pressure: groups in flight
        # working-set: the sessions in flight, their predicted peak contexts, and the memory they must fit in
        self.contexts = SessionContexts(session_contexts, fallback=max(w.largest_request, 1))
        self.gpu_tokens, self.tier_tokens = total_tokens, tier_tokens
        self.in_flight: dict[Trajectory, None] = {}  # in start order, so that sums are reproducible
        self.held: list[tuple[int, Trajectory, float]] = []  # working-set: turns held (row, trajectory, since)
        self.held_turns = 0
        self.held_s = 0.0

    # ------------------------------------------------------------------ ids
    def request_id(self, row: int) -> str:
        return self._alias_of_row.get(row) or self.workload.request_id[row]

    def row(self, request_id: str) -> int:
        r = self.aliases.get(request_id)
        return self.workload.row_of[request_id] if r is None else r

    def cache_salt(self, traj: Trajectory) -> str | None:
        return f"kvpilot-v{traj.version}" if self.spec.weight_sync == "keep" else None

    def submit(self, row: int, t: float) -> None:
        traj = self.traj_of_row[row]
        if self.spec.admission == "working-set" and self.workload.kind[row] == "rollout" and self._holds(traj):
            self.held.append((row, traj, t))
            self.held_turns += 1
            return
        self._send(row, traj, t)

    def _send(self, row: int, traj: Trajectory, t: float) -> None:
        self.cache_epoch[row] = traj.version if self.spec.weight_sync == "keep" else self._epoch
        super().submit(row, t)

    def _context(self, traj: Trajectory) -> int:
        """A session's context now: the prompt of its latest turn (sent, held or on its tool), and its output while
        the response is on its way back to the client."""
        w = self.workload
        if traj.returning is not None:
            return w.prompt_tokens[traj.returning] + w.output_tokens[traj.returning]
        return w.prompt_tokens[traj.turns[max(traj.next_turn - 1, 0)]]

    def _holds(self, traj: Trajectory) -> bool:
        """working-set: whether ``traj``'s next turn waits (:func:`policy.group_width.working_set_holds`)."""
        g = self.group_of[traj.session]
        tokens, running, oldest = 0, 0, None
        for x in self.in_flight:  # in start order: groups start in index order
            gx = self.group_of[x.session]
            if oldest is None:
                oldest = gx
            if gx.index <= g.index:
                c = self._context(x)
                tokens += c
                if x.live or x is traj:
                    running += c
        return working_set_holds(tokens, running, self.gpu_tokens, self.tier_tokens, g is oldest)

    def _release(self, t: float) -> None:
        """working-set: send the held turns that now fit, oldest group first (then the time they were held). A turn
        that fits goes even while an older group's does not (backfill: holding it behind measured slower)."""
        held, self.held = sorted(self.held, key=lambda h: (self.group_of[h[1].session].index, h[2])), []
        for row, traj, since in held:
            if self._holds(traj):
                self.held.append((row, traj, since))
            else:
                self.held_s += t - since
                self._send(row, traj, t)

    def _extra_args(self, row: int) -> dict[str, Any]:
        return {**super()._extra_args(row), "kvpilot_weight_version": self.traj_of_row[row].version}

    # ------------------------------------------------------------------ admission
    def start(self) -> None:
        self.clock.push(0.0, RELEASE, 0)

    def release(self, index: int, t: float) -> None:
        self.admit(t)

    def capacity(self) -> int:
        """Groups the controller may start now."""
        spec = self.spec
        cap = (spec.staleness + self.version + 1) * self.batch - self.next_group
        if spec.max_concurrent_groups is not None:
            cap = min(cap, spec.max_concurrent_groups - self.running_groups)
        if spec.admission == "kv-pressure":
            cap = min(cap, self.kv_limit - self.running_groups)
        return cap

    def _session_need(self, traj: Trajectory) -> float:
        """working-set: the tokens a session in flight is predicted to hold at its peak."""
        return max(self._context(traj), self.contexts.predict(self.workload.domain[traj.turns[0]]))

    def _fits(self, g: Group) -> bool:
        """working-set: whether group ``g``'s predicted working set fits beside that of the sessions in flight."""
        need = self._session_need
        return working_set_admits(sum(need(x) for x in self.in_flight), sum(need(x) for x in g.trajs),
                                  self.gpu_tokens + self.tier_tokens, self.running_groups)

    def admit(self, t: float) -> None:
        """Start groups while the capacity allows, in workload order."""
        cap = self.capacity()
        working_set = self.spec.admission == "working-set"
        while cap > 0 and self.next_group < len(self.groups):
            g = self.groups[self.next_group]
            if working_set and not self._fits(g):
                break
            self.next_group += 1
            self.running_groups += 1
            self.unconsumed.add(g.index)
            g.version, g.start = self.version, t
            for traj in g.trajs:
                traj.start, traj.version, traj.next_turn = t, self.version, 1
                self.in_flight[traj] = None
                self.submit(traj.turns[0], t)
            cap -= 1

    def _kv_use(self) -> float:
        reps = self.fleet.replicas
        total = sum(r.kv_blocks for r in reps)
        return 1.0 - sum(r.free_blocks() for r in reps) / total if total else 0.0

    # ------------------------------------------------------------------ trajectories and groups
    def _traj_done(self, traj: Trajectory, t: float) -> None:
        traj.done = True
        traj.end = t
        self.fleet.session_ended(traj.session)
        self.traj_records.append(TrajectoryRecord(traj.session, traj.step, traj.start, t, traj.version, self.version))
        self.in_flight.pop(traj, None)
        working_set = self.spec.admission == "working-set"
        if working_set:  # the session's peak refines its domain's prediction, and frees room
            w = self.workload
            self.contexts.observe(w.domain[traj.turns[0]],
                                  max(w.prompt_tokens[r] + w.output_tokens[r] for r in traj.turns))
        g = self.group_of[traj.session]
        g.left -= 1
        if self.held:
            self._release(t)
        if g.left:
            if working_set:
                self.admit(t)
            return
        g.end = t
        self._finish_seq += 1
        g.finish_seq = self._finish_seq
        self.ready.append(g)
        self.running_groups -= 1
        if self.spec.admission == "kv-pressure":
            use = self._kv_use()
            if use < self.spec.kv_low:
                self.kv_limit += 1
            elif use > self.spec.kv_high:
                self.kv_limit = max(1, self.kv_limit - 1)
        self.admit(t)
        self.try_train(t)

    # ------------------------------------------------------------------ the trainer
    def _next_batch(self) -> list[Group] | None:
        """The trainer's next batch (see the module docstring), or None: wait."""
        last = self.next_group == len(self.groups) and self.running_groups == 0
        return next_batch(self.ready, [self.groups[i] for i in self.unconsumed], self.batch, self.spec.staleness,
                          self.version, last)

    def try_train(self, t: float) -> None:
        """Start a training step if the trainer is free and a batch is ready."""
        if self.trainer_busy:
            return
        batch = self._next_batch()
        if batch is None:
            return
        taken = {g.index for g in batch}
        self.ready = [g for g in self.ready if g.index not in taken]
        self.unconsumed -= taken
        trajs = [x for g in batch for x in g.trajs]
        stale = [self.version - x.version for x in trajs]
        self.staleness.extend(stale)
        tokens = self.trained_tokens(trajs)
        train_s = self.trainer.train_s(tokens, self.runner.cost, self.replicas)
        self.trainer_busy = True
        self.train_records.append(TrainRecord(self.version, t, t + train_s, t + train_s + self.sync_s, len(trajs),
                                              tokens, max(stale)))
        self.clock.push(t + train_s, TRAIN_END, None)

    def trained(self, _: Any, t: float) -> None:
        """A training step ended: the weight update pauses generation (and acts on the engines)."""
        self.updates += 1
        action = {"abort": self._abort_all, "recompute": self._recompute_all, "keep": None}[self.spec.weight_sync]
        self._hold_by_age()
        if action is not None:
            self._epoch += 1
            self._count_paused_sessions()
        self._updating = True
        self.fleet.pause(t + self.sync_s, action, t)
        self.clock.push(t + self.sync_s, SYNC_END, None)

    def synced(self, _: Any, t: float) -> None:
        """The weight update ended: the new version serves; aborted requests come back; more groups may start."""
        self.version += 1
        self.trainer_busy = False
        self._updating = False
        self._resubmit_aborted(t)
        self.admit(t)
        self.try_train(t)

    def _resubmit_aborted(self, t: float) -> None:
        """abort: the requests aborted by the update come back, with the tokens they had."""
        resubmit, self._resubmit = self._resubmit, []
        for row, sampled, traj in resubmit:
            if not traj.aborted and not traj.done:
                self._resubmit_row(row, sampled, traj, t)

    # ------------------------------------------------------------------ weight-update actions
    def _hold_by_age(self) -> None:
        """KV tokens the engines' requests hold, by their trajectory's version age (summed over updates)."""
        for rep in self.fleet.replicas:
            reqs = rep.engine.requests
            for rid in self.fleet.live_requests(rep):
                traj = self.traj_of_row[self.row(rid)]
                self.kv_by_age[self.version - traj.version] += reqs[rid].num_computed_tokens

    def _count_paused_sessions(self) -> None:
        """The context of sessions paused on a tool (or with a turn's response on its way back), whose cached
        blocks a reset drops."""
        w = self.workload
        for traj in self.trajectories:
            if traj.done or traj.aborted:
                continue
            if traj.waiting_row is not None:
                prev = traj.turns[traj.next_turn - 2]
            elif traj.returning is not None and w.kind[traj.returning] == "rollout":
                prev = traj.returning
            else:
                continue
            self.reprefill_tokens += w.prompt_tokens[prev] + w.output_tokens[prev]

    def _abort_all(self, rep: Replica, t: float) -> None:
        """abort: every request on the engine is aborted (to be resubmitted with its tokens so far) and the prefix
        cache reset."""
        reqs = rep.engine.requests
        ids = self.fleet.live_requests(rep)
        for rid in ids:
            r = reqs[rid]
            self.reprefill_tokens += r.num_computed_tokens
            row = self.row(rid)
            traj = self.traj_of_row[row]
            traj.live.discard(rid)
            self._resubmit.append((row, self._sampled.get(rid, 0) + r.num_output_tokens, traj))
        self.fleet.abort_now(rep, ids)
        self.fleet.reset_now(rep)
        if not self._updating:  # a step longer than the update ended after it: its requests come back now
            self._resubmit_aborted(t)

    def _recompute_all(self, rep: Replica, t: float) -> None:
        """recompute: vLLM preempts every running request and clears the prefix cache."""
        sched = rep.engine.sched
        self.reprefill_tokens += sum(r.num_computed_tokens for r in sched.running)
        self.fleet.reset_now(rep, running=True)

    def _resubmit_row(self, row: int, sampled: int, traj: Trajectory, t: float) -> None:
        """abort: resubmit ``row`` with its prompt plus the ``sampled`` tokens it had, under a new id."""
        w = self.workload
        rid = f"{w.request_id[row]}#a{self.updates}"
        self._alias_of_row[row] = rid
        self.aliases[rid] = row
        self._sampled[rid] = sampled
        out = w.tokens.output_ids(row).tolist()
        self.runner.script(rid, row)
        self.runner.scripts[rid] = self.runner.scripts[rid][sampled:]
        extra = self._extra_args(row)
        req = engine.make_request(rid, w.tokens.prompt_ids(row).tolist() + out[:sampled], w.max_tokens[row] - sampled,
                                  arrival_time=t, extra_args=extra, stop_token_ids=(engine.EOS_TOKEN_ID,))
        traj.live.add(rid)
        self.submitted[row] += 1
        self.cache_epoch[row] = self._epoch
        self.fleet.submit(rid, req, w.request_id[row], w.prompt_tokens[row] + sampled, w.session_id[row],
                          traj.session, t)

    # ------------------------------------------------------------------ the end
    def check_finished(self) -> None:
        """After the run: every row finished once, every group trained; the workload steps' windows recorded."""
        w = self.workload
        left = [w.request_id[i] for i in range(w.num_rows) if self.finished_count[i] != 1]
        if left or self.unconsumed or self.ready or self.next_group < len(self.groups):
            raise SimulationError(f"the async run ended with {len(left)} request(s) unfinished (e.g. {left[:3]}), "
                                  f"{len(self.groups) - self.next_group} group(s) never started and "
                                  f"{len(self.unconsumed)} untrained")
        spans: dict[int, list[float]] = {}
        for r in self.traj_records:
            lo, hi = spans.get(r.step, [r.start_s, r.end_s])
            spans[r.step] = [min(lo, r.start_s), max(hi, r.end_s)]
        self.step_records = [StepRecord(s, lo, hi) for s, (lo, hi) in sorted(spans.items())]
