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

    assert scheduler_cls_arg(["x", "--scheduler-cls", "serving_hook.KVPilotScheduler"]) == "serving_hook.KVPilotScheduler"
    assert scheduler_cls_arg(["x", "--scheduler_cls=serving_hook.KVPilotAsyncScheduler"]) == \
        "serving_hook.KVPilotAsyncScheduler"
    assert scheduler_cls_arg(["x", "--model", "m"]) is None
