"""The hook's GRPO group counters on vLLM's real scheduler: ``group_finished`` counts the group's finished requests
(turns) and never falls while the group has requests, its reward model's scoring requests after its rollouts
included (before, the record was dropped once as many turns as ``group_size`` had finished, and the next
admission restarted it at 0)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from policy.interface import Event, EventKind, Policy
from tests.test_sim_run import small_config

pytestmark = pytest.mark.vllm


class CounterRecorder(Policy):
    """vLLM's own decisions; records every waiting candidate's group counters and the group's finished requests."""

    name = "counter-recorder"
    uses_admission = True
    uses_events = True

    def __init__(self) -> None:
        self.finished: dict[str, int] = defaultdict(int)  # group id -> its requests finished so far (events)
        self.seen: list[tuple[str, int, int, int]] = []  # (group, group_finished, sibling turns, truth)

    def on_event(self, event: Event) -> None:
        if event.kind is EventKind.FINISHED:
            self.finished[event.meta.group_id] += 1

    def admit(self, waiting, state):
        for c in waiting:
            g = c.meta.group_id
            if g is not None:
                self.seen.append((g, c.group_finished, len(c.sibling_output_tokens), self.finished[g]))
        return None


def test_group_counters_never_fall_while_the_group_runs(vllm_engine) -> None:
    from data.synth import generate
    from simulator.simulation import run_simulation

    table = generate(small_config(3, prompts=6, group=4, steps=1))
    rows = table.to_pylist()
    assert any(r["tool"] for r in rows) and any(r["kind"] == "scoring" for r in rows)  # turns and scoring
    size = {r["group_id"]: r["group_size"] for r in rows}
    rec = CounterRecorder()
    run_simulation(table, rec, kv_fraction=0.3, progress=False, decode_stride=16)
    assert rec.seen
    before: dict[str, int] = {}
    for g, finished, turns, truth in rec.seen:
        assert finished == turns == truth, (g, finished, turns, truth)
        assert finished >= before.get(g, 0), (g, finished, before[g])  # never falls while the group runs
        before[g] = finished
    # past group_size finished turns (a multi-turn group, then its scoring requests), still counting, not 0
    assert any(finished > size[g] for g, finished, *_ in rec.seen)
