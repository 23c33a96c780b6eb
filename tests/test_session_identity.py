"""Session identity through vLLM's real scheduler: each source (vLLM's typed ``Request.session_id``, a kvpilot
KV-hint action, the ``kvpilot_*`` extra_args, the block-hash chain), their precedence, ``Request.priority`` on the
candidates, and a workload served with no ids at all (docs/session-identity.md)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import pytest

from policy.interface import EventKind
from policy.vllm_default import VllmDefaultPolicy
from simulator import fake_runner
from tests.hooks import hook_scheduler

pytestmark = pytest.mark.vllm

P, OUT, TOOL = 40, 30, 20  # prompt, output and tool-result tokens of the hand-driven sessions


class Seen(VllmDefaultPolicy):
    """vLLM's choices, every lever consulted; records what the hook told it of each request."""

    name = "test-seen"

    def __init__(self) -> None:
        super().__init__(explicit=True)
        self.meta: dict[str, Any] = {}
        self.events: list[tuple[str, str]] = []
        self.priority: dict[str, int] = {}

    def on_event(self, event: Any) -> None:
        self.events.append((event.kind.value, event.request_id))
        if event.kind is EventKind.ARRIVED:
            self.meta[event.request_id] = event.meta

    def admit(self, waiting: Any, state: Any) -> Any:
        for c in waiting:
            self.priority[c.request_id] = c.priority
        return super().admit(waiting, state)


class Driver:
    """A hook scheduler running :class:`Seen`, fed one request at a time, each run to completion."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.policy = Seen()
        self.sched = engine.make_scheduler(hook_scheduler(self.policy), num_blocks=64, max_num_seqs=8)
        self.runner = fake_runner.FakeRunner()
        self.contexts: dict[str, list[int]] = {}  # request id -> its prompt + output

    def run(self, rid: str, prompt: list[int], **kwargs: Any) -> Any:
        """Serve ``rid`` to completion; the metadata the policy saw."""
        e = self.engine
        self.sched.add_request(e.make_request(rid, prompt, OUT, arrival_time=0.0, **kwargs))
        for _ in range(200):
            if not self.sched.has_requests():
                break
            self.runner.step(self.sched)
        self.contexts[rid] = list(prompt) + fake_runner.output_tokens(rid, OUT)
        return self.policy.meta[rid]

    def next_prompt(self, rid: str, tool_key: str) -> list[int]:
        """The next turn's prompt after ``rid``: its prompt, its output and a tool's result."""
        return self.contexts[rid] + fake_runner.prompt_tokens(tool_key, TOOL)

    @property
    def sources(self) -> dict:
        return self.sched.kvpilot_stats.session_sources


def _hints(payload: dict, version: str = "1", action_type: str = "kvpilot.session") -> Any:
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    return KvHintsEnvelope("1", "m1", [KvHintAction("a0", "other.action", "1", {"x": 1}),
                                       KvHintAction("a1", action_type, version, payload)])


def test_typed_session_id_names_the_session_and_the_chain_counts_its_turns(vllm_engine: Any) -> None:
    """vLLM's ``Request.session_id`` (X-Session-ID, the body's session_id): the session; with no turn given, the
    turn comes from the chain. It outranks the kvpilot extra_args' session id."""
    d = Driver(vllm_engine)
    m0 = d.run("a", fake_runner.prompt_tokens("a", P), session_id="S-typed")
    assert (m0.session_id, m0.turn) == ("S-typed", 0)
    m1 = d.run("b", d.next_prompt("a", "t0"), session_id="S-typed",
               extra_args={"kvpilot_session_id": "ignored", "kvpilot_domain": "agentic"})
    assert (m1.session_id, m1.turn, m1.domain) == ("S-typed", 1, "agentic")
    m2 = d.run("c", d.next_prompt("b", "t1"), session_id="S-typed", extra_args={"kvpilot_turn": 7})
    assert (m2.session_id, m2.turn) == ("S-typed", 7)  # an explicit turn is kept
    assert d.sources == {"typed": 3}


def test_kv_hint_action_carries_session_turn_tool_and_pause(vllm_engine: Any, caplog: Any) -> None:
    """A kvpilot action in ``Request.kv_hints``: every payload field reaches the policy and outranks the
    extra_args; its tool makes the turn's end a tool call and the next turn its return."""
    from serving_hook import metadata

    metadata._warned.clear()
    caplog.set_level(logging.WARNING, logger="kvpilot.hook")
    d = Driver(vllm_engine)
    payload = {"session_id": "S-hint", "turn": 0, "tool": "search", "expected_pause_s": 1.5}
    m0 = d.run("a", fake_runner.prompt_tokens("a", P), kv_hints=_hints(payload),
               extra_args={"kvpilot_session_id": "ignored", "kvpilot_turn": 9, "kvpilot_tool": "calc"})
    assert (m0.session_id, m0.turn, m0.tool, m0.expected_pause_s) == ("S-hint", 0, "search", 1.5)
    m1 = d.run("b", d.next_prompt("a", "t0"), kv_hints=_hints({"session_id": "S-hint", "turn": 1}))
    assert (m1.session_id, m1.turn, m1.tool) == ("S-hint", 1, None)
    assert ("tool_call_started", "a") in d.policy.events and ("tool_call_ended", "b") in d.policy.events
    # the typed session id outranks the hint's; a bad value is ignored (warned once), the rest is read
    m2 = d.run("c", fake_runner.prompt_tokens("c", P), session_id="S-typed",
               kv_hints=_hints({"session_id": "S-hint", "turn": "two", "tool": "search"}))
    assert (m2.session_id, m2.turn, m2.tool) == ("S-typed", 0, "search")
    # another major version of the action is not read
    m3 = d.run("d", fake_runner.prompt_tokens("d", P), kv_hints=_hints({"session_id": "S-v2"}, version="2.0"))
    assert m3.session_id == "d"
    assert d.sources == {"kv_hints": 2, "typed": 1, "new": 1}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "kv_hints[kvpilot.session].payload['turn']='two'" in warned and "action_version" in warned


def test_kvpilot_extra_args_name_the_session(vllm_engine: Any) -> None:
    """The ``kvpilot_*`` extra_args (vllm_xargs) when neither vLLM field gives a session."""
    d = Driver(vllm_engine)
    xa = {"kvpilot_session_id": "S-x", "kvpilot_turn": 0, "kvpilot_tool": "shell", "kvpilot_expected_pause_s": "0.25"}
    m0 = d.run("a", fake_runner.prompt_tokens("a", P), extra_args=xa)
    assert (m0.session_id, m0.turn, m0.tool, m0.expected_pause_s) == ("S-x", 0, "shell", 0.25)
    m1 = d.run("b", d.next_prompt("a", "t0"), extra_args={"kvpilot_session_id": "S-x"})
    assert (m1.session_id, m1.turn) == ("S-x", 1)  # no turn given: from the chain
    assert d.sources == {"extra_args": 2}


def test_sessions_are_inferred_from_the_block_hash_chain(vllm_engine: Any) -> None:
    """No ids at all: a prompt that extends a finished request's chain continues its session, one turn on; GRPO
    siblings (the same prompt, other outputs) and a later request re-asking the prompt open sessions of their own."""
    e = vllm_engine
    d = Driver(e)
    prompt = fake_runner.prompt_tokens("grpo", P)
    assert (d.run("g0", prompt).session_id, d.policy.meta["g0"].turn) == ("g0", 0)
    assert (d.run("g1", prompt).session_id, d.policy.meta["g1"].turn) == ("g1", 0)  # a sibling
    m = d.run("g0-t1", d.next_prompt("g0", "tool-a"))
    assert (m.session_id, m.turn) == ("g0", 1)
    m = d.run("g1-t1", d.next_prompt("g1", "tool-b"))
    assert (m.session_id, m.turn) == ("g1", 1)
    m = d.run("g0-t2", d.next_prompt("g0-t1", "tool-c"))
    assert (m.session_id, m.turn) == ("g0", 2)
    assert d.run("again", prompt).session_id == "again"  # the next RL step re-asks the prompt
    # kvpilot_turn alone: the chain names the session, the given turn stays
    m = d.run("g1-t2", d.next_prompt("g1-t1", "tool-d"), extra_args={"kvpilot_turn": 5, "kvpilot_domain": "a"})
    assert (m.session_id, m.turn, m.domain) == ("g1", 5, "a")
    assert d.sources == {"new": 3, "chain": 4}


def test_priority_reaches_the_candidates(vllm_engine: Any) -> None:
    """vLLM's ``Request.priority`` is on each candidate the policy ranks."""
    d = Driver(vllm_engine)
    d.run("lo", fake_runner.prompt_tokens("lo", P), priority=-3)
    d.run("hi", fake_runner.prompt_tokens("hi", P), priority=4)
    assert d.policy.priority == {"lo": -3, "hi": 4}


def test_chain_memory_is_bounded(vllm_engine: Any) -> None:
    """The finished chains kept for inference are bounded; the oldest go first."""
    from serving_hook.identity import SessionIdentity

    e = vllm_engine
    ident = SessionIdentity(e.BLOCK_SIZE, max_chains=2)
    reqs = {}
    for k in range(3):
        r = reqs[k] = e.make_request(f"r{k}", fake_runner.prompt_tokens(f"p{k}", P), OUT)
        ident.finished(_completed(e, r), ident.meta(r))
    tool = fake_runner.prompt_tokens("t", TOOL)
    nxt = {k: e.make_request(f"n{k}", list(reqs[k].all_token_ids) + tool, OUT) for k in range(3)}
    assert [ident.continued(nxt[k]) for k in range(3)] == [None, ("r1", 0), ("r2", 0)]
    assert len(ident._tips) == 2


def _completed(engine: Any, request: Any) -> Any:
    """``request`` with its ``OUT`` output tokens appended (as the engine does, hashing new full blocks)."""
    request.append_output_token_ids(fake_runner.output_tokens(request.request_id, OUT))
    return request


# ---------------------------------------------------------------- a workload served with no ids at all


def _agentic_workload() -> Any:
    """The search-agent domain alone (1-5 turns, GRPO groups of 4), two RL steps whose prompts recur, no
    reward-model requests (they extend the trajectory's chain, so inference calls them its next turn)."""
    from data.synth import SynthConfig, generate

    agent = dataclasses.replace(SynthConfig.preset("short").domains["agentic"], share=1.0, score_fraction=0.0)
    return generate(SynthConfig(steps=2, prompts_per_step=12, group_size=4, seed=5, domains={"agentic": agent}))


def _cli_simulate(workload: Any, out: Any, policy: str, *flags: str) -> dict:
    from typer.testing import CliRunner

    from training.cli import app

    res = CliRunner().invoke(app, ["simulate", "-w", str(workload), "-o", str(out), "-p", policy,
                                   "--kv-fraction", "0.2", "--json", "--no-progress", *flags])
    assert res.exit_code == 0, res.output
    return json.loads(res.output[res.output.index("{"): res.output.rindex("}") + 1])


@pytest.mark.slow
def test_no_ids_workload_infers_sessions_and_keeps_a_session_aware_makespan(vllm_engine: Any, tmp_path: Any) -> None:
    """Served with ``--no-session-ids`` (no session, turn or tool, as verl sends), the inferred sessions match the
    true ones on >= 95% of turns, and heddle (progressive priority by session progress) keeps its makespan within
    2% of the run with ids, where sessions move it more than 2% from vLLM's FCFS."""
    from data.io import read_telemetry, write_workload

    w = _agentic_workload()
    path = tmp_path / "w.parquet"
    write_workload(w, path)
    with_ids = _cli_simulate(path, tmp_path / "ids", "heddle")
    no_ids = _cli_simulate(path, tmp_path / "none", "heddle", "--no-session-ids")
    fcfs = _cli_simulate(path, tmp_path / "fcfs", "vllm-default")
    assert with_ids["session_ids"] is True and no_ids["session_ids"] is False

    cols = w.select(["request_id", "session_id", "turn", "kind"]).to_pydict()
    rows = list(zip(cols["request_id"], cols["session_id"], cols["turn"], cols["kind"]))
    first = {s: r for r, s, t, k in rows if k == "rollout" and t == 0}
    truth = {r: (first[s], t) for r, s, t, k in rows if k == "rollout"}
    got = read_telemetry(tmp_path / "none" / "telemetry", "requests").to_pydict()
    inferred = dict(zip(got["request_id"], zip(got["session_id"], got["turn"])))
    match = sum(inferred.get(r) == v for r, v in truth.items()) / len(truth)
    assert len(truth) > 100 and max(t for _, t in truth.values()) >= 3
    assert match >= 0.95, match

    def makespan(s: dict) -> float:
        return s["makespan_s"]

    assert abs(makespan(no_ids) / makespan(with_ids) - 1) <= 0.02
    assert abs(makespan(with_ids) / makespan(fcfs) - 1) > 0.02  # the sessions matter to heddle here
    # with ids, nothing is inferred: the telemetry names the workload's sessions
    ids_rows = read_telemetry(tmp_path / "ids" / "telemetry", "requests").to_pydict()
    assert set(ids_rows["session_id"]) == set(cols["session_id"])

