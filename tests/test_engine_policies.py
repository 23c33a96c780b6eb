"""Failure isolation and admission holds inside a real vLLM OpenAI server (vLLM 0.32's CPU build).

One server runs the hook with a test policy (``tests.engine_policies.HoldOrRaiseScheduler``): it raises while a
``raise*`` session waits and holds ``hold*`` sessions until the hook's starvation bound (here 10 s).

* A policy that raises: every request is served, the step falls back to vLLM (``hook_fallback`` rows).
* A hold: the request is released no sooner than the bound, and meanwhile the engine does not spin: its
  processes use a small share of one core, and it logs a bounded number of ``steps`` / ``decisions`` rows
  (before the fix: ~500 empty steps and rows per second).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.engine_server import complete, start_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]

HOLD_S = 10.0


@pytest.fixture(scope="module")
def telemetry_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("telemetry")


@pytest.fixture(scope="module")
def server(tmp_path_factory, telemetry_dir):
    env = {"KVPILOT_TELEMETRY_DIR": str(telemetry_dir), "KVPILOT_MAX_HOLD_S": str(HOLD_S)}
    args = ("--block-size", "32", "--enforce-eager", "--scheduler-cls", "tests.engine_policies.HoldOrRaiseScheduler")
    with start_server(tmp_path_factory.mktemp("server"), hook=False, env=env, args=args) as srv:
        yield srv


def _rows(telemetry_dir, table: str):
    path = telemetry_dir / table
    return pq.read_table(path) if path.exists() and any(path.iterdir()) else None


def _wait_rows(telemetry_dir, table: str, n: int, timeout_s: float = 10.0):
    """The table once it has at least n rows (the hook flushes when its engine goes idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = _rows(telemetry_dir, table)
        if (rows is not None and rows.num_rows >= n) or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_a_raising_policy_falls_back_and_serves_every_request(server, telemetry_dir):
    prompts = [list(range(50 + 7 * i, 250 + 7 * i)) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: complete(server.url, prompts[i], 12,
                                                   vllm_xargs={"kvpilot_session_id": f"raise-{i}"}), range(8)))
    assert [len(a["choices"][0]["token_ids"]) for a in answers] == [12] * 8
    assert all(a["choices"][0]["finish_reason"] == "length" for a in answers)
    steps = _wait_rows(telemetry_dir, "steps", 1)
    assert steps is not None and pc.sum(steps.column("hook_fallback").cast("int64")).as_py() >= 1
    requests = _wait_rows(telemetry_dir, "requests", 8)
    assert sum(s.startswith("raise-") for s in requests.column("session_id").to_pylist()) == 8


def test_a_held_request_waits_for_its_bound_without_spinning(server, telemetry_dir):
    engine = psutil.Process(server.proc.pid).children(recursive=True)  # the engine core and its worker
    assert engine
    steps_before = _rows(telemetry_dir, "steps")
    decisions_before = _rows(telemetry_dir, "decisions")
    n_steps = steps_before.num_rows if steps_before is not None else 0
    n_decisions = decisions_before.num_rows if decisions_before is not None else 0
    cpu0 = sum(p.cpu_times().user + p.cpu_times().system for p in engine)
    t0 = time.monotonic()
    answer = complete(server.url, list(range(600, 900)), 8, vllm_xargs={"kvpilot_session_id": "hold-1"})
    waited = time.monotonic() - t0
    cpu = sum(p.cpu_times().user + p.cpu_times().system for p in engine) - cpu0
    assert len(answer["choices"][0]["token_ids"]) == 8
    assert waited >= HOLD_S - 0.5  # the hold releases no sooner
    assert cpu < 0.25 * waited, f"the engine used {cpu:.1f} s of CPU during a {waited:.1f} s hold"
    steps = _wait_rows(telemetry_dir, "steps", n_steps + 1)
    decisions = _wait_rows(telemetry_dir, "decisions", n_decisions + 1)
    assert steps.num_rows - n_steps <= 40, "a steps row per empty step"
    assert decisions.num_rows - n_decisions <= 40, "a decision row per empty step"
