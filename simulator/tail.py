"""Tail batching (after RollPacker): the synchronous-step driver with cut prompts re-run in long rounds.

A policy whose ``step_driver`` (:attr:`policy.interface.Policy.step_driver`)
has ``kind == "tail-batching"`` (e.g.
:class:`policy.baselines.rollpacker.TailBatchingPolicy`) switches the run to
:class:`TailBatchingDriver`: each step keeps the first ``ceil(G / eta)``
samples of its first ``ceil(L / eta)`` complete prompts, aborts the rest,
queues the cut prompts, and re-runs them from scratch in dedicated long rounds
(see :mod:`policy.baselines.rollpacker`). A long round submits its rows under
new request ids (``<request_id>#long<k>``, the driver's :attr:`aliases`) as
fresh trajectories, numbered as RL steps after the workload's last one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from simulator.clock import RELEASE
from simulator.config import SimConfig, SimulationError
from simulator.drivers import StepDriver, StepState, Trajectory
from simulator.metrics import StepRecord
from simulator.workload import PreparedWorkload

if TYPE_CHECKING:
    from policy.baselines.rollpacker import TailBatchingSpec
    from policy.interface import Policy

__all__ = ["TailBatchingDriver", "TailStep", "tail_batching_spec"]


def tail_batching_spec(policy: Policy, config: SimConfig, workload: PreparedWorkload) -> TailBatchingSpec | None:
    """The policy's tail-batching spec (its ``step_driver``), or None; a driver this run cannot use is an error."""
    spec = policy.step_driver
    if spec is None:
        return None
    if getattr(spec, "kind", None) != "tail-batching":
        raise SimulationError(f"unknown step driver {spec!r} on the policy")
    if workload.trace:
        raise SimulationError("tail batching applies to RL steps, not to a trace replay")
    if config.overprovision is not None:
        raise SimulationError("give either over-provisioning or a tail-batching policy, not both")
    return spec


class TailStep(StepState):
    """A workload step under tail batching: its prompt groups and how many samples of each are kept."""

    __slots__ = ("complete", "finished", "groups", "need", "prompts")

    def __init__(self, start: float, groups: dict[str, list[Trajectory]], need: dict[str, int], prompts: int,
                 launched: int) -> None:
        super().__init__(-1, start, launched, launched)
        self.groups = groups  # group id -> its trajectories
        self.need = need  # group id -> samples kept (R)
        self.prompts = prompts  # complete prompts that end the step (P)
        self.finished: dict[str, int] = {}  # group id -> its trajectories done
        self.complete: list[str] = []  # groups with R done, in order


class TailBatchingDriver(StepDriver):
    """Synchronous steps cut at P complete prompts of R samples; cut prompts re-run in long rounds."""

    def __init__(self, *args: Any, spec: TailBatchingSpec, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spec = spec
        self.long_rounds: list[tuple[int, list[str]]] = []  # (round id, group ids) per long round
        self.cut_prompts: dict[int, list[str]] = {}  # per workload step, its cut group ids
        self.dropped_long_prompts: list[str] = []  # queued at the end with flush_at_end=False
        self._queue: list[tuple[str, list[Trajectory]]] = []  # cut prompts: (group id, its old trajectories)
        self._round_prompts: int | None = None  # prompts per long round, set at the first step
        self._next_round_id = max(self.workload.steps) + 1
        self._next_step = 0  # index of the next workload step
        self._alias_of_row: dict[int, str] = {}

    def request_id(self, row: int) -> str:
        return self._alias_of_row.get(row) or self.workload.request_id[row]

    def row(self, request_id: str) -> int:
        r = self.aliases.get(request_id)
        return self.workload.row_of[request_id] if r is None else r

    def check_finished(self) -> None:
        """Nothing to check: cut attempts stay unfinished by design."""

    def release(self, index: int, t: float) -> None:
        """The next round: a long round when the queue is full (or at the end), else the next workload step."""
        w = self.workload
        spec = self.spec
        queue = self._queue
        size = self._round_prompts
        more_steps = self._next_step < len(w.steps)
        if queue and (len(queue) >= size or (not more_steps and spec.flush_at_end)):
            take, queue[:] = queue[:size], queue[size:]
            k = len(self.long_rounds)
            round_id = self._next_round_id
            self._next_round_id += 1
            self.long_rounds.append((round_id, [g for g, _ in take]))
            trajs = []
            for _, old in take:  # fresh trajectories (stale events of the old attempt see the aborted objects)
                for o in old:
                    traj = Trajectory(o.session, round_id, o.turns, o.scoring)
                    for r in traj.turns + traj.scoring:
                        self.traj_of_row[r] = traj
                        alias = f"{w.request_id[r]}#long{k}"
                        self._alias_of_row[r] = alias
                        self.aliases[alias] = r
                    trajs.append(traj)
            self.step_trajs[round_id] = trajs
            self.step_state[round_id] = StepState(-1, t, len(trajs), len(trajs))
        elif more_steps:
            step = w.steps[self._next_step]
            self._next_step += 1
            trajs = self.step_trajs[step]
            groups: dict[str, list[Trajectory]] = {}
            for traj in trajs:
                groups.setdefault(w.group_id[traj.turns[0]], []).append(traj)
            need = {g: spec.kept(len(ts)) for g, ts in groups.items()}
            self.step_state[step] = TailStep(t, groups, need, spec.kept(len(groups)), len(trajs))
            if self._round_prompts is None:
                self._round_prompts = spec.long_round_prompts or spec.kept(len(groups))
        else:
            if queue:  # flush_at_end=False: the queued prompts are dropped
                self.dropped_long_prompts.extend(g for g, _ in queue)
                queue.clear()
            return
        self.launch(trajs, t)

    def _step_progress(self, traj: Trajectory, st: StepState, t: float) -> None:
        if not isinstance(st, TailStep):  # a long round runs to completion
            super()._step_progress(traj, st, t)
            return
        g = self.workload.group_id[traj.turns[0]]
        st.finished[g] = st.finished.get(g, 0) + 1
        if st.finished[g] == st.need[g]:  # the prompt is complete: its first R samples are kept
            st.complete.append(g)
            self.abort(st.groups[g], t)
            if len(st.complete) >= st.prompts:  # the step's quota: cut everything else
                kept = set(st.complete)
                cut = [h for h in st.groups if h not in kept]
                for h in cut:
                    self.abort(st.groups[h], t)
                    self._queue.append((h, st.groups[h]))
                cut_sessions = {x.session for h in cut for x in st.groups[h]}
                self.traj_records = [r for r in self.traj_records
                                     if not (r.step == traj.step and r.session_id in cut_sessions)]
                self.cut_prompts[traj.step] = cut
        if all(x.done or x.aborted for x in self.step_trajs[traj.step]):
            self.step_records.append(StepRecord(traj.step, st.start, t))
            del self.step_state[traj.step]
            self.clock.push(t, RELEASE, 0)
