"""The serving fixes found in a real server, checked without one (the real-server checks: tests/test_engine_*.py).

* telemetry: ``flush()`` writes every queued row now, without closing the writer;
* idle holds: the hook finds the engine process's input queue and waits on it without taking anything;
* ``kvflow`` / ``lrb`` build without a workload (the online reuse model), the oracle still with one;
* the plugin advertises the hook in a server started with ``--scheduler-cls serving_hook.*``.
"""

from __future__ import annotations

import queue
import threading
import time

import pyarrow.parquet as pq
import pytest

from serving_hook.idle import engine_input_queue, wait_for_input
from serving_hook.telemetry import TelemetryWriter
from simulator import fake_runner

REQUEST = {"request_id": "r1", "session_id": "s", "group_id": "g", "prompt_id": None, "step": 0, "turn": 0,
           "domain": "math", "paradigm": "single", "replica": 0, "arrival_s": 1.0, "first_scheduled_s": 1.0,
           "first_token_s": 1.1, "finish_s": 1.2, "prompt_tokens": 10, "cached_tokens": 0, "output_tokens": 2,
           "computed_tokens": 11, "max_tokens": 2, "finish_reason": "length", "preemptions": 0, "block_hashes": []}


def test_flush_writes_queued_rows_without_closing(tmp_path):
    w = TelemetryWriter(tmp_path, flush_interval_s=3600.0)
    try:
        assert w.put("requests", dict(REQUEST))
        time.sleep(0.5)
        assert not (tmp_path / "requests").exists()  # an hour's interval: nothing written yet
        w.flush()
        deadline = time.monotonic() + 10
        while not (tmp_path / "requests").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pq.read_table(tmp_path / "requests").column("request_id").to_pylist() == ["r1"]
        assert w.put("requests", dict(REQUEST, request_id="r2"))  # still open
    finally:
        w.close()
    assert sorted(pq.read_table(tmp_path / "requests").column("request_id").to_pylist()) == ["r1", "r2"]


class _Engine:
    """Stands for vLLM's EngineCoreProc: its input queue exists before it builds its scheduler."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue = queue.Queue()
        self.scheduler = _Scheduler()


class _Scheduler:
    def __init__(self) -> None:
        self.inputs = engine_input_queue()


def test_the_hook_finds_the_engine_input_queue():
    engine = _Engine()
    assert engine.scheduler.inputs is engine.input_queue
    assert _Scheduler().inputs is None  # built outside an engine process


def test_wait_for_input_wakes_on_a_put_and_takes_nothing():
    q: queue.Queue = queue.Queue()
    t0 = time.monotonic()
    assert not wait_for_input(q, 0.2)
    assert time.monotonic() - t0 >= 0.2
    threading.Timer(0.1, q.put_nowait, args=("req",)).start()
    t0 = time.monotonic()
    assert wait_for_input(q, 30.0)
    assert time.monotonic() - t0 < 10.0
    assert q.get_nowait() == "req"


@pytest.mark.parametrize("name", ["kvflow", "lrb"])
def test_next_use_baselines_build_without_a_workload(name):
    from policy.catalog import create_policy
    from policy.predictors import OnlineNextUse, OracleReusePredictor

    assert isinstance(create_policy(name).reuse, OnlineNextUse)
    with pytest.raises(ValueError, match="needs the simulated workload"):
        create_policy(name, reuse_predictor="oracle")
    from data.synth import SynthConfig, generate

    table = generate(SynthConfig(steps=1, prompts_per_step=2, group_size=2, seed=1))
    assert isinstance(create_policy(name, workload=table).reuse, OracleReusePredictor)


def test_online_next_use_ranks_nothing_before_its_first_model():
    from policy.predictors import OnlineNextUse

    assert OnlineNextUse().next_use_s([], 0.0) == []


def test_plugin_reads_the_scheduler_class_from_the_command_line():
    from serving_hook.plugin import scheduler_cls_arg

    assert scheduler_cls_arg(["x", "--scheduler-cls", "serving_hook.KVPilotScheduler"]) == \
        "serving_hook.KVPilotScheduler"
    assert scheduler_cls_arg(["x", "--scheduler_cls=serving_hook.KVPilotAsyncScheduler"]) == \
        "serving_hook.KVPilotAsyncScheduler"
    assert scheduler_cls_arg(["x", "--model", "m"]) is None


@pytest.mark.vllm
def test_an_idle_held_step_waits_only_when_every_queued_request_is_held(vllm_engine):
    """A held request and a session's next turn whose context loads from the CPU tier, nothing running: vLLM skips
    the loading turn for a step, and the hook must not take that step for an idle one (it would wait on the engine's
    input queue, which no finished load wakes, up to the hold's release). Once only the held request is queued,
    it waits until an input arrives."""
    from policy.interface import AdmissionDecision, Policy
    from simulator.cost_model import CostModel
    from simulator.offload import OffloadWorker
    from tests.hooks import hook_scheduler

    engine = vllm_engine

    class HoldH(Policy):
        name = "test-hold-h"
        uses_admission = True

        def admit(self, waiting, state):
            return AdmissionDecision(hold=frozenset(c.request_id for c in waiting if c.request_id == "h"))

    cls = hook_scheduler(HoldH(), kv_block_bytes=1_000_000, host_link_gbps=1.0, max_hold_s=20.0)
    s = engine.make_scheduler(cls, num_blocks=40, vllm_config=engine.make_vllm_config(num_blocks=40, offload_blocks=64))
    assert s.kvpilot_clock is time.time  # a real-time engine: the only kind that waits
    s._kvp_inputs = inputs = queue.Queue()  # what the hook finds in a real engine process
    cost = CostModel.preset("H200-7B")
    worker = OffloadWorker(cost, cost.kv_block_bytes(16))

    def step():
        out = s.schedule()
        worker.submit(out, time.time())
        sampled = []
        for rid in out.num_scheduled_tokens:
            r = s.requests[rid]
            sampled.append([] if r.num_computed_tokens < r.num_tokens
                           else [fake_runner.output_token(rid, r.num_output_tokens)])
        kv_out = worker.finished(time.time() + 1.0)  # every transfer done by the next step
        s.update_from_output(out, engine.model_runner_output(list(out.num_scheduled_tokens), sampled, kv_out))

    def drain():
        while s.has_requests() or worker.busy:
            step()

    meta = {"kvpilot_session_id": "s0", "kvpilot_turn": 0, "kvpilot_tool": "bash"}
    prompt = fake_runner.prompt_tokens("ctx", 160)
    s.add_request(engine.make_request("t0", prompt, 4, extra_args=meta))
    drain()
    for i in range(4):  # they push turn 0's blocks out of the GPU; the tier keeps them
        s.add_request(engine.make_request(f"fill{i}", fake_runner.prompt_tokens(f"fill{i}", 160), 4))
        drain()
    s.add_request(engine.make_request("h", fake_runner.prompt_tokens("h", 32), 4))
    turn1 = prompt + fake_runner.output_tokens("t0", 3) + fake_runner.prompt_tokens("tool", 30)
    s.add_request(engine.make_request("t1", turn1, 4, extra_args={**meta, "kvpilot_turn": 1, "kvpilot_tool": None}))
    loaded0 = worker.load_blocks
    for _ in range(20):
        step()
        if "t1" not in s.requests:
            break
    st = s.kvpilot_stats
    assert "t1" not in s.requests and worker.load_blocks > loaded0  # turn 1 ran, its context loaded from the tier
    assert st.idle_held_steps == 0 and st.idle_wait_s == 0.0
    assert list(s.requests) == ["h"] and not s.running
    threading.Timer(0.2, inputs.put_nowait, args=("req",)).start()
    step()  # only the held request is queued: the hook waits for the engine's next input
    assert st.idle_held_steps == 1 and 0.0 < st.idle_wait_s < 15.0


@pytest.mark.vllm
def test_sessions_whose_next_turn_never_comes_are_not_kept_for_ever(vllm_engine, monkeypatch):
    """A long-lived server sees sessions end on a tool call and never return: the hook keeps the most recently
    paused ones up to a bound, not one entry per such session for ever."""
    from policy.interface import Policy
    from serving_hook import translate
    from tests.hooks import hook_scheduler

    class Events(Policy):
        name = "test-events"
        uses_events = True

    monkeypatch.setattr(translate, "_MAX_PAUSED", 50)
    s = vllm_engine.make_scheduler(hook_scheduler(Events()), num_blocks=256)
    runner = fake_runner.FakeRunner()
    for k in range(120):
        s.add_request(vllm_engine.make_request(f"r{k}", fake_runner.prompt_tokens(f"p{k}", 20), 1,
                                               extra_args={"kvpilot_session_id": f"s{k}", "kvpilot_tool": "bash"}))
        if k % 40 == 39:
            while s.has_requests():
                runner.step(s)
    paused = s._kvp_translate.sessions
    assert list(paused) == [f"s{k}" for k in range(70, 120)]


@pytest.mark.vllm
def test_a_hold_given_as_one_id_holds_that_request_alone(vllm_engine):
    """``AdmissionDecision.hold`` is a collection of ids; a policy that gives one id as a string holds that request,
    not every request whose id contains it."""
    from policy.interface import AdmissionDecision, Policy
    from tests.hooks import hook_scheduler

    class HoldOne(Policy):
        name = "test-hold-one"
        uses_admission = True

        def admit(self, waiting, state):
            return AdmissionDecision(hold="r10")

    s = vllm_engine.make_scheduler(hook_scheduler(HoldOne()), num_blocks=64)
    for rid in ("r1", "r10"):
        s.add_request(vllm_engine.make_request(rid, fake_runner.prompt_tokens(rid, 20), 2))
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"r1"} and [r.request_id for r in s.waiting] == ["r10"]


def test_vllms_own_allocation_error_reaches_its_caller(vllm_engine):
    """The hook guards its own work in ``allocate_slots`` only: an error raised by vLLM's allocation on the hook's
    retry after releasing a pin reaches vLLM's caller, as it would without the hook (it was swallowed, and the
    step went on after a failed allocation); an error of the hook's pin release is contained and counted."""
    from types import SimpleNamespace

    from policy.interface import Policy
    from tests.hooks import hook_scheduler

    class Pins(Policy):
        name = "test-pins"
        uses_retention = True

    s = vllm_engine.make_scheduler(hook_scheduler(Pins()), num_blocks=64)
    s.add_request(vllm_engine.make_request("r1", fake_runner.prompt_tokens("r1", 20), 2))
    request = s.waiting.peek_request()
    calls = []

    def vllm_allocate(req, *args, **kwargs):
        calls.append(req.request_id)
        if len(calls) > 1:
            raise RuntimeError("vLLM's own failure")
        return None  # the first attempt does not fit

    s._kvp_orig_allocate = vllm_allocate
    s._kvp_retention = SimpleNamespace(release_one=lambda: True)  # a pin to release: the hook retries
    with pytest.raises(RuntimeError, match="vLLM's own failure"):
        s._kvp_allocate_slots(request, 20)
    assert calls == ["r1", "r1"]

    def broken():
        raise ValueError("the hook's failure")

    calls.clear()
    s._kvp_retention = SimpleNamespace(release_one=broken)
    assert s._kvp_allocate_slots(request, 20) is None  # vLLM's answer to the first attempt
    assert calls == ["r1"] and s.kvpilot_stats.fallbacks.get("hook:allocate", 0) == 1
