"""The hook's GRPO group counters on vLLM's real scheduler: ``group_finished`` counts the sessions whose last turn
finished (``group_size`` counts sessions, not turns; a tool call's turn is not a finished session), and never
falls while the group has requests, its reward model's scoring requests after its rollouts included."""

from __future__ import annotations

from collections import defaultdict

import pytest

from policy.interface import Event, EventKind, Policy
from tests.test_sim_run import small_config

pytestmark = pytest.mark.vllm


class CounterRecorder(Policy):
    """vLLM's own decisions; records every waiting candidate's group counters and the finished requests."""

    name = "counter-recorder"
    uses_admission = True
    uses_events = True

    def __init__(self, last_turns: set[str]) -> None:
        self.last_turns = last_turns  # request ids of sessions' last turns (no tool after them)
        self.ended: dict[str, int] = defaultdict(int)  # group id -> sessions ended so far (from the workload)
        self.seen: list[tuple[str, int, int, int, int]] = []  # (group, finished, running, sibling turns, truth)

    def on_event(self, event: Event) -> None:
        if event.kind is EventKind.FINISHED and event.request_id in self.last_turns:
            self.ended[event.meta.group_id] += 1

    def admit(self, waiting, state):
        for c in waiting:
            g = c.meta.group_id
            if g is not None:
                self.seen.append((g, c.group_finished, c.group_running, len(c.sibling_output_tokens),
                                  self.ended[g]))
        return None


def test_group_finished_counts_sessions_and_never_falls(vllm_engine) -> None:
    from data.synth import generate
    from simulator.simulation import run_simulation

    table = generate(small_config(3, prompts=6, group=4, steps=1))
    rows = table.to_pylist()
    assert any(r["tool"] for r in rows), "the workload needs multi-turn sessions"
    last = {r["request_id"] for r in rows if not r["tool"]}
    rollouts = {r["group_id"]: r["group_size"] for r in rows}
    rec = CounterRecorder(last)
    run_simulation(table, rec, kv_fraction=0.3, progress=False, decode_stride=16)
    assert rec.seen
    before: dict[str, tuple[int, int]] = {}
    for g, finished, running, turns, truth in rec.seen:
        assert finished == truth, (g, finished, truth)  # sessions, as the workload ends them (scoring included)
        f0, t0 = before.get(g, (0, 0))
        assert finished >= f0 and turns >= t0, (g, finished, f0, turns, t0)  # never falls while the group runs
        before[g] = (finished, turns)
    # the sibling turns (which stamp the length predictions) grow past the sessions: a tool call's turn counts there
    assert any(turns > finished for _, finished, _, turns, _ in rec.seen)
    # a group's scoring requests, after every rollout ended, see the rollouts' count, not a fresh 0
    assert any(finished >= rollouts[g] for g, finished, *_ in rec.seen)
