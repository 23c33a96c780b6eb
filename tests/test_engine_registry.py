"""The loop closed on a real server's telemetry (vLLM 0.32's CPU build, ``.venv-engine``).

1. A server runs the hook with the exploring ``logging`` policy; ``kvpilot replay`` drives a workload through
   it; SIGTERM (vLLM's default shutdown): its telemetry is the training log.
2. ``kvpilot train`` fits predictors and policy on that log and registers version 1; ``promote`` makes it the
   champion (the first version needs no gate).
3. A server runs policy ``registry`` (``models:/kvpilot@champion``, polled every second). Replays run back to
   back against it while a second version is registered and promoted (``--force``): the server swaps to it
   between two engine steps, no request fails, and its decisions telemetry carries both ``kvpilot/1`` and
   ``kvpilot/2``.
"""

from __future__ import annotations

import shutil
import threading
import time

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.engine_server import start_server
from tests.test_engine_server import SERVER_ARGS, tiny_workload

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _replays_until(stop: threading.Event, url: str, workload, results: list) -> None:
    """Replay ``workload`` again and again until ``stop`` is set (so one is in flight at every moment)."""
    from training.replay import ReplayConfig, replay

    cfg = ReplayConfig(url, concurrency=16, time_scale=0.0, progress=False)
    while not stop.is_set():
        results.append(replay(workload, cfg))


def test_registry_loop_on_a_real_server(tmp_path, monkeypatch):
    import mlflow

    from data.io import write_workload
    from simulator.workload import load_workload
    from training import registry
    from training.promote import promote
    from training.replay import ReplayConfig, replay
    from training.train import HeldoutParams, train_and_register

    store = tmp_path / "store"
    store.mkdir()
    uri = f"sqlite:///{store / 'mlruns.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(store)  # MLflow's default artifact root is relative to the working directory
    train_wl = tmp_path / "train.parquet"
    write_workload(tiny_workload(seed=5, steps=3, prompts=8), train_wl)
    heldout_wl = tmp_path / "heldout.parquet"
    write_workload(tiny_workload(seed=6, steps=1, prompts=4), heldout_wl)

    # 1. the logging policy on a real server
    logs = tmp_path / "logs"
    with start_server(tmp_path / "logging", env={"KVPILOT_POLICY": "logging", "KVPILOT_TELEMETRY_DIR": str(logs)},
                      args=SERVER_ARGS) as server:
        logged = replay(load_workload(train_wl), ReplayConfig(server.url, time_scale=0.0, progress=False))
    assert logged["failed"] == 0 and logged["hook"] == {"policy": "logging"}
    assert pq.read_table(logs / "requests").num_rows == logged["requests"]
    assert pq.read_table(logs / "decisions").num_rows > 0
    shutil.copy(train_wl, logs / "workload.parquet")  # the predictors join prompt ids and tools from it

    # 2. train on the server's telemetry, register, promote
    trained = train_and_register([logs], tmp_path / "train", heldout=HeldoutParams(workload=heldout_wl),
                                 progress=False)
    assert promote(trained.version, progress=False).promoted
    first = str(trained.version)

    # 3. the registry policy on a real server, swapped mid-replay
    served = tmp_path / "served"
    env = {"KVPILOT_POLICY": "registry", "KVPILOT_MODEL_URI": registry.DEFAULT_MODEL_URI, "KVPILOT_MODEL_POLL_S": "1",
           "MLFLOW_TRACKING_URI": uri, "KVPILOT_TELEMETRY_DIR": str(served)}
    results: list = []
    stop = threading.Event()
    with start_server(tmp_path / "registry", env=env, args=SERVER_ARGS) as server:
        worker = threading.Thread(target=_replays_until, args=(stop, server.url, load_workload(heldout_wl), results))
        worker.start()
        try:
            time.sleep(3)
            with mlflow.start_run():
                second = str(registry.log_policy_model(tmp_path / "train" / "policy").version)
            assert promote(second, force=True, progress=False).promoted
            time.sleep(8)  # a poll (1 s), the download and the swap, then more replayed steps
        finally:
            stop.set()
            worker.join(300)
    assert len(results) >= 2 and all(r["failed"] == 0 for r in results), [r["failures"] for r in results]
    versions = set(pc.unique(pq.read_table(served / "decisions").column("policy_version")).to_pylist())
    assert {f"kvpilot/{first}", f"kvpilot/{second}"} <= versions, versions
