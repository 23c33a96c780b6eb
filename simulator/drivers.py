"""The RL drivers: when each request of the workload is submitted, and when trajectories and RL steps end.

Each request's prompt is the workload's hash chain expanded into token ids
(:class:`simulator.tokens.WorkloadTokens`), so vLLM's own block hashing sees
exactly the workload's sharing; its metadata reaches the hook as ``kvpilot_*``
``extra_args``, as in production, and its output is the fake runner's script
(:mod:`simulator.runner`).

Drivers
-------
* **Synchronous RL steps** (every ``arrival_s`` null): step s is released when
  step s-1 ends, all its turn-0 requests at once; it ends when every trajectory
  of it and its verification are done.
* **Multi-turn sessions**: a turn that is not its session's last returns, after
  the client's round trip (:mod:`simulator.round_trip`; 0 unless set) and its
  ``tool_latency_s``, as the next turn (a new request whose prompt extends
  the context). Its chain shares the previous turn's blocks, so it hits the
  cache only if they were kept.
* **Verification and scoring**: when a trajectory's last turn ends, its verifier
  runs for that turn's ``verify_latency_s`` and its reward-model scoring
  requests (rows whose ``scores_session_id`` names it) are submitted; each
  scoring request is then verified (parsed) for its own ``verify_latency_s``.
  The trajectory ends when all of these are done.
* **Over-provisioning** (:class:`~simulator.config.Overprovision`): a step ends
  as soon as its quota of trajectories is done; the rest are aborted (vLLM
  ``finish_requests`` with ``FINISHED_ABORTED``) and their later turns never sent.
* **Tail batching**: :mod:`simulator.tail`.
* **Trace replay** (every ``arrival_s`` set): each request arrives at its own
  ``arrival_s``; a trajectory (session) ends at its last request's finish plus
  verification, and each ``step`` value is one window from its first arrival.
* **Trainer** (``SimConfig.trainer``, off by default): after each synchronous RL step the trainer trains on its
  trajectories and updates the weights (:class:`simulator.config.Trainer`'s price), and only then is the next
  step released; the asynchronous driver (:mod:`simulator.async_rl`) prices the same work.
"""

from __future__ import annotations

import math
from typing import Any

from simulator import engine
from simulator.clock import ARRIVE, FOLLOW_UP, RELEASE, VERIFIED, EventClock
from simulator.config import Overprovision, SimulationError, Trainer
from simulator.metrics import StepRecord, TrainRecord, TrajectoryRecord
from simulator.replica import Fleet
from simulator.round_trip import RoundTrip
from simulator.runner import ScriptedRunner
from simulator.workload import PreparedWorkload

__all__ = ["StepDriver", "StepState", "Trajectory"]


class Trajectory:
    """One trajectory (rollout session) as the driver tracks it in a run."""

    __slots__ = (
        "aborted",
        "done",
        "end",
        "live",
        "next_turn",
        "outstanding",
        "returning",
        "scoring",
        "session",
        "start",
        "step",
        "turns",
        "version",
        "waiting_row",
    )

    def __init__(self, session: str, step: int, turns: tuple[int, ...], scoring: tuple[int, ...]) -> None:
        self.session = session
        self.step = step
        self.turns = turns  # rows, by turn
        self.scoring = scoring  # rows of requests scoring it
        self.next_turn = 0
        self.outstanding = 0
        self.start = 0.0
        self.end = 0.0
        self.aborted = False
        self.live: set[str] = set()  # request ids of its requests submitted and not finished
        self.done = False
        self.waiting_row: int | None = None  # a next turn in flight (tool call), not yet submitted
        self.returning: int | None = None  # a finished request's row whose response is on its way to the client
        self.version = 0  # the weight version it started at


class StepState:
    """An open RL step: released at ``start``; ``done`` of its trajectories ended, ``left`` still to end."""

    __slots__ = ("done", "index", "left", "quota", "start")

    def __init__(self, index: int, start: float, launched: int, quota: int) -> None:
        self.index = index  # in the workload's steps (-1: released otherwise, see simulator.tail)
        self.start = start
        self.done = 0
        self.left = launched
        self.quota = quota  # trajectories done at which the rest are aborted (over-provisioning)


class StepDriver:
    """Synchronous RL steps (or a trace replay), multi-turn tool pauses, verification and scoring,
    over-provisioning; the event handlers :meth:`submit`, :meth:`verified`, :meth:`release`, :meth:`follow_up`
    and :meth:`finished` (the fleet's ``on_finished``)."""

    def __init__(self, workload: PreparedWorkload, fleet: Fleet, clock: EventClock, runner: ScriptedRunner,
                 overprovision: Overprovision | None, progress: Any = None, *, reset_at_weight_sync: bool = True,
                 session_ids: bool = True, trainer: Trainer | None = None,
                 round_trip: RoundTrip | None = None) -> None:
        self.workload = w = workload
        #: Seconds from an engine finishing a request to its client's next request of the trajectory (the
        #: response's way back and the next request's way in); None or zero: at once.
        self.round_trip = round_trip if round_trip else None
        #: Send each request's session identity (``kvpilot_session_id``, ``kvpilot_turn``, ``kvpilot_tool``);
        #: False sends none, as verl and AReaL do, and the hook infers sessions from the block-hash chain.
        self.session_ids = session_ids
        #: New weights at every RL step: the replicas' prefix caches are reset before each step (or round) after
        #: the first, as RL frameworks do at weight sync, so no KV crosses a step.
        self.reset_at_weight_sync = reset_at_weight_sync
        self._launched = False
        self.fleet = fleet
        self.clock = clock
        self.runner = runner
        self.overprovision = overprovision
        self.progress = progress  # a progress bar (``update(1)`` per finished request), or None
        n = w.num_rows
        self.trajectories = [Trajectory(s.session_id, s.step, s.turns, s.scoring) for s in w.sessions]
        by_row = {r: t for t in self.trajectories for r in t.turns + t.scoring}
        self.traj_of_row = [by_row[r] for r in range(n)]  # every row is a turn of one or scores one
        self.step_trajs: dict[int, list[Trajectory]] = {s: [] for s in w.steps}
        for t in self.trajectories:
            self.step_trajs[t.step].append(t)
        self.submitted = [0] * n  # per row: times submitted to an engine
        self.finished_count = [0] * n  # per row: times an engine finished it (aborts excluded)
        self.finish_time = [math.nan] * n
        self.traj_records: list[TrajectoryRecord] = []
        self.step_records: list[StepRecord] = []
        self.step_state: dict[int, StepState] = {}  # open steps
        self.aborted = 0  # trajectories aborted
        #: Request ids the run gave rows beside their own, to their rows (none here; see simulator.tail).
        self.aliases: dict[str, int] = {}
        self._stale_arrivals: dict[int, int] = {}  # row -> next turns of aborted trajectories still to arrive
        self.trainer = trainer
        self.train_records: list[TrainRecord] = []  # the trainer's steps (with a trainer)
        self.version = 0  # the weights' version: training steps done

    def start(self) -> None:
        """The run's first events: every arrival of a trace, else the release of the first RL step."""
        w = self.workload
        if not w.trace:
            self.clock.push(0.0, RELEASE, 0)
            return
        arrival = w.arrival_s
        firsts: dict[int, float] = {}
        for t in self.trajectories:
            rows = t.turns + t.scoring
            t.start = min(arrival[r] for r in rows)
            t.outstanding = len(rows)
            firsts[t.step] = min(firsts.get(t.step, math.inf), t.start)
        for i, s in enumerate(w.steps):
            n = len(self.step_trajs[s])
            self.step_state[s] = StepState(i, firsts[s], n, n)
        for r in sorted(range(w.num_rows), key=lambda r: (arrival[r], r)):
            self.clock.push(arrival[r], ARRIVE, r)

    # ------------------------------------------------------------------ requests
    def request_id(self, row: int) -> str:
        """The id row ``row`` is submitted under."""
        return self.workload.request_id[row]

    def row(self, request_id: str) -> int:
        """The row of a submitted request id."""
        return self.workload.row_of[request_id]

    def submit(self, row: int, t: float) -> None:
        """Request ``row`` arrives at time ``t``: build it and hand it to the fleet."""
        if self._stale_arrivals.get(row):  # the next turn of an aborted trajectory
            self._stale_arrivals[row] -= 1
            return
        w = self.workload
        rid = self.request_id(row)
        traj = self.traj_of_row[row]
        if traj.aborted:
            return
        if traj.waiting_row == row:
            traj.waiting_row = None
        extra = self._extra_args(row)
        self.runner.script(rid, row)
        req = engine.make_request(rid, w.tokens.prompt_ids(row).tolist(), w.max_tokens[row], arrival_time=t,
                                  extra_args=extra, stop_token_ids=(engine.EOS_TOKEN_ID,),
                                  cache_salt=self.cache_salt(traj))
        traj.live.add(rid)
        self.submitted[row] += 1
        self.fleet.submit(rid, req, w.request_id[row], w.prompt_tokens[row], w.session_id[row], traj.session, t)

    def _extra_args(self, row: int) -> dict[str, Any]:
        """Row ``row``'s ``kvpilot_*`` ``extra_args`` (:meth:`PreparedWorkload.xargs`)."""
        return self.workload.xargs(row, self.session_ids)

    def cache_salt(self, traj: Trajectory) -> str | None:
        """vLLM's ``cache_salt`` of a trajectory's requests (None: unsalted; the asynchronous driver's ``keep``
        salts by version)."""
        return None

    def finished(self, request_id: str, t: float) -> None:
        """An engine finished ``request_id`` at ``t``: its client has the response a round trip later
        (:meth:`follow_up`: the next turn, verification and scoring, or the end)."""
        w = self.workload
        row = self.row(request_id)
        self.finished_count[row] += 1
        self.finish_time[row] = t
        if self.progress is not None:
            self.progress.update(1)
        traj = self.traj_of_row[row]
        if traj.aborted or request_id not in traj.live:
            # not live: an aborted attempt's request that finished in the step its abort waited for, after
            # a long round (tail batching) gave its row to a fresh trajectory
            return
        traj.live.discard(request_id)
        if w.trace:
            traj.end = max(traj.end, t + (w.verify_latency_s[row] or 0.0))
            traj.outstanding -= 1
            if traj.outstanding == 0:
                self._traj_done(traj, traj.end)
            return
        if self.round_trip is not None:
            traj.returning = row
            self.clock.push(t + self.round_trip.draw(), FOLLOW_UP, (traj, row))
        else:
            self.follow_up((traj, row), t)

    def follow_up(self, finished: tuple[Trajectory, int], t: float) -> None:
        """The client has the response of a trajectory's request (``finished``: the trajectory, the row) at ``t``:
        the next turn after its tool, or verification and scoring, or (scoring) the parse."""
        traj, row = finished
        traj.returning = None
        if traj.aborted:  # while the response was on its way back
            return
        w = self.workload
        if w.kind[row] != "rollout":  # a scoring request: parse its score, then the trajectory may end
            self.clock.push(t + (w.verify_latency_s[row] or 0.0), VERIFIED, traj)
            return
        if traj.next_turn < len(traj.turns):  # the tool runs, then the next turn arrives
            nxt = traj.turns[traj.next_turn]
            traj.next_turn += 1
            traj.waiting_row = nxt
            self.clock.push(t + (w.tool_latency_s[row] or 0.0), ARRIVE, nxt)
            return
        traj.outstanding = 1 + len(traj.scoring)  # its verifier, then each scoring request's parse
        self.clock.push(t + (w.verify_latency_s[row] or 0.0), VERIFIED, traj)
        for s in traj.scoring:
            self.submit(s, t)

    def verified(self, traj: Trajectory, t: float) -> None:
        if traj.aborted:
            return
        traj.outstanding -= 1
        if traj.outstanding == 0:
            self._traj_done(traj, t)

    # ------------------------------------------------------------------ trajectories and steps
    def _traj_done(self, traj: Trajectory, t: float) -> None:
        traj.done = True
        traj.end = t
        self.fleet.session_ended(traj.session)
        self.traj_records.append(TrajectoryRecord(traj.session, traj.step, traj.start, t, traj.version, self.version))
        st = self.step_state.get(traj.step)
        if st is not None:
            self._step_progress(traj, st, t)

    def _step_progress(self, traj: Trajectory, st: StepState, t: float) -> None:
        """``traj`` of the open step ``st`` is done: over-provisioning's quota, the step's end."""
        st.done += 1
        st.left -= 1
        if st.done >= st.quota and st.left > 0:
            self.abort(self.step_trajs[traj.step], t)
            st.left = 0
        if st.left == 0:
            self.step_records.append(StepRecord(traj.step, st.start, t))
            del self.step_state[traj.step]
            if not self.workload.trace:
                self.clock.push(self.train(traj.step, t), RELEASE, st.index + 1)

    def trained_tokens(self, trajs: list[Trajectory]) -> int:
        """Tokens a training step trains on: each trajectory's last turn, its prompt and output."""
        w = self.workload
        return sum(w.prompt_tokens[x.turns[-1]] + w.output_tokens[x.turns[-1]] for x in trajs)

    def train(self, step: int, t: float) -> float:
        """With a trainer: train on RL step ``step``'s done trajectories from ``t``, then update the weights; when
        that ends (``t`` without a trainer)."""
        if self.trainer is None:
            return t
        done = [x for x in self.step_trajs[step] if x.done]
        cost = self.runner.cost
        train_s = self.trainer.train_s(self.trained_tokens(done), cost, len(self.fleet.replicas))
        sync_s = self.trainer.sync_s(cost)
        self.version += 1
        self.train_records.append(TrainRecord(self.version - 1, t, t + train_s, t + train_s + sync_s, len(done),
                                              self.trained_tokens(done), 0))
        return t + train_s + sync_s

    def abort(self, trajs: list[Trajectory], t: float) -> None:
        """Abort these trajectories: their live requests now or at their replica's step end, their next turns."""
        for traj in trajs:
            if traj.done or traj.aborted:
                continue
            traj.aborted = True
            self.aborted += 1
            self.fleet.session_ended(traj.session)
            if traj.waiting_row is not None:
                self._stale_arrivals[traj.waiting_row] = self._stale_arrivals.get(traj.waiting_row, 0) + 1
                traj.waiting_row = None
            for rid in traj.live:
                self.fleet.abort(rid, t)
            traj.live.clear()

    def release(self, index: int, t: float) -> None:
        """Synchronous RL: release step ``steps[index]``, every trajectory's first turn at once."""
        steps = self.workload.steps
        if index >= len(steps):
            return
        trajs = self.step_trajs[steps[index]]
        quota = self.overprovision.quota(len(trajs)) if self.overprovision is not None else len(trajs)
        self.step_state[steps[index]] = StepState(index, t, len(trajs), quota)
        self.launch(trajs, t)

    def launch(self, trajs: list[Trajectory], t: float) -> None:
        """Start these trajectories at ``t`` (an RL step or round, with the new weights): each one's first turn."""
        if self._launched and self.reset_at_weight_sync:
            self.fleet.reset_prefix_caches()
        self._launched = True
        for traj in trajs:
            traj.start = t
            traj.version = self.version
            traj.next_turn = 1
            self.submit(traj.turns[0], t)

    def check_finished(self) -> None:
        """After the run: every request submitted finished and every step closed, unless aborts were planned."""
        if self.overprovision is not None:
            return
        w = self.workload
        left = [w.request_id[i] for i in range(w.num_rows) if self.submitted[i] != self.finished_count[i]]
        unfinished = list(self.step_state)
        if left or unfinished:
            raise SimulationError(f"the run ended with {len(left)} request(s) unfinished (e.g. {left[:3]}) and "
                                  f"step(s) {unfinished} open")
