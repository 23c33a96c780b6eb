"""The hook serving the MLflow registry's model, on vLLM's real scheduler: start-up load, hot swap between steps,
and every fault (missing model, corrupt artifact, schema mismatch, unreachable registry) with the engine running on.

Real parts only: an embedded SQLite registry, real POLICY_DIRs (a LightGBM length model trained on a small
workload, scorer weights written by ``LearnedPolicy.save``), ``KVPilotScheduler`` with a fake model runner.
Each test serves its own registered model name (``KVPILOT_MODEL_URI``) in one shared store.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from simulator import fake_runner
from training import registry as reg

pytestmark = pytest.mark.vllm

DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port


# ------------------------------------------------------------------------------------ POLICY_DIRs and store
def make_learned_dir(out: Path, predictors_dir: Path, seed: int) -> Path:
    """A POLICY_DIR written by ``LearnedPolicy.save``: scorer weights from ``seed``, the given predictors."""
    import torch

    from policy.learned.policy import LearnedPolicy
    from policy.learned.scorer import build_scorer

    torch.manual_seed(seed)
    state = build_scorer().state_dict()
    LearnedPolicy(state, None, predictors_dir=predictors_dir).save(out)
    return out


def train_predictors(out: Path) -> Path:
    """A small real ``kvpilot train predictors`` model directory (20 trees, a 3-step synthetic log)."""
    from predictors.features import prepare_requests
    from predictors.pipeline import train_bundle
    from tests.test_predictors_features import fake_telemetry, small_workload

    w = small_workload(steps=3, prompts=8)
    train_bundle(prepare_requests(fake_telemetry(w), w), test_steps=[2], num_trees=20, num_threads=1).save(out)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("policies")
    pred = train_predictors(root / "predictors")
    out = {"v1": make_learned_dir(root / "P1", pred, 1), "v2": make_learned_dir(root / "P2", pred, 2)}
    bad_schema = shutil.copytree(out["v1"], root / "Pschema")
    m = json.loads((bad_schema / "policy.json").read_text())
    m["telemetry_schema_version"] = m["telemetry_schema_version"] + 1
    (bad_schema / "policy.json").write_text(json.dumps(m))
    bad_feats = shutil.copytree(out["v1"], root / "Pfeatures")
    m = json.loads((bad_feats / "policy.json").read_text())
    m["feature_schema"]["features"] = list(reversed(m["feature_schema"]["features"]))
    (bad_feats / "policy.json").write_text(json.dumps(m))
    out.update(schema=bad_schema, features=bad_feats)
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory, vllm_engine):
    root = tmp_path_factory.mktemp("registry")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", "unset")  # restored (removed) at teardown
        mp.delenv("MLFLOW_TRACKING_URI")
        mp.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        mp.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        mp.chdir(root)
        uri = reg.configure("kvpilot-serving-test")
        yield root, uri


def register(policy_dir: Path, name: str, *, champion: bool = True) -> str:
    import mlflow

    with mlflow.start_run() as run:
        mv = reg.log_policy_model(policy_dir, run, name=name)
    if champion:
        reg.set_champion(mv.version, name=name)
    return str(mv.version)


def truncate_in_store(name: str, version: str) -> Path:
    """Cut the registered version's policy.pt in the artifact store in half (a corrupt upload)."""
    import mlflow

    mv = reg.client().get_model_version(name, version)
    model_id = mv.source.split("/")[-1]
    loc = Path(mlflow.get_logged_model(model_id).artifact_location.removeprefix("file://"))
    (pt,) = loc.rglob("policy.pt")
    data = pt.read_bytes()
    pt.write_bytes(data[: len(data) // 2])
    return pt


# ------------------------------------------------------------------------------------ driving the hook
def registry_scheduler(vllm_engine, uri: str, tel: Path, poll_s: float = 0.0, loader: Optional[Callable] = None):
    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig
    from serving_hook.model_source import RegistryPolicy, learned_loader

    cfg = HookConfig(policy="registry", telemetry_dir=str(tel), decision_budget_s=10.0, model_poll_s=poll_s)
    cls = with_policy(KVPilotScheduler, lambda: RegistryPolicy(uri, loader or learned_loader), cfg)
    return vllm_engine.make_scheduler(cls, num_blocks=48, max_num_seqs=6)


def drive(vllm_engine, sched, n: int = 36, on_step: Optional[Callable[[int], None]] = None,
          max_steps: int = 3000) -> list[Optional[str]]:
    """Feed ``n`` requests (3 per step) and step until all finish; returns the served version per step."""
    runner = fake_runner.FakeRunner()
    served: list[Optional[str]] = []
    added = 0
    for step in range(1, max_steps + 1):
        for _ in range(3):
            if added < n:
                prompt = fake_runner.prompt_tokens(f"p{added % 5}", 40 + 8 * (added % 4))
                sched.add_request(vllm_engine.make_request(f"r{added}", prompt, max_tokens=4 + 5 * (added % 7)))
                added += 1
        runner.step(sched)
        served.append(sched.kvpilot_policy.model_version)
        if on_step is not None:
            on_step(step)
        if added == n and not sched.requests:
            return served
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {len(sched.requests)}")


def telemetry(sched, tel: Path) -> tuple[Any, Any, Any]:
    from data.io import read_telemetry

    sched.kvpilot_close()
    tables = [read_telemetry(tel, t).to_pandas() if (tel / t).is_dir() else None
              for t in ("steps", "decisions", "requests")]
    if tables[1] is None:  # no decision at all
        import pandas as pd

        tables[1] = pd.DataFrame({"engine_step": [], "policy_version": []})
    return tuple(tables)


def check_completed(requests: Any, n: int = 36) -> None:
    assert len(requests) == n and set(requests["request_id"]) == {f"r{i}" for i in range(n)}
    assert (requests["finish_reason"] == "length").all()


def one_version_per_step(decisions: Any) -> dict[int, str]:
    per_step = decisions.groupby("engine_step")["policy_version"].unique()
    assert all(len(v) == 1 for v in per_step), "a step mixed two model versions"
    return {int(k): v[0] for k, v in per_step.items()}


def warnings_about(caplog, text: str) -> int:
    return sum(1 for r in caplog.records if r.name == "kvpilot.hook" and r.levelno == logging.WARNING
               and text in r.getMessage())


# ------------------------------------------------------------------------------------ tests
def test_champion_is_served_and_a_new_one_swaps_in_between_steps(store, dirs, vllm_engine, tmp_path):
    name = "swap"
    register(dirs["v1"], name)
    sched = registry_scheduler(vllm_engine, f"models:/{name}@champion", tmp_path / "tel")
    assert sched.kvpilot_policy.model_version == "1"  # loaded at start-up, before the first step
    promoted_after = 12

    def promote(step: int) -> None:
        if step == promoted_after:
            register(dirs["v2"], name)
            assert sched.kvpilot_policy.source.poll_now()  # staged, not yet served
            assert sched.kvpilot_policy.model_version == "1"

    served = drive(vllm_engine, sched, on_step=promote)
    assert served[:promoted_after] == ["1"] * promoted_after
    assert served[promoted_after:] == ["2"] * (len(served) - promoted_after)  # from the very next step
    assert sched.kvpilot_stats.model_swaps == 1 and sched.kvpilot_stats.model_version == "2"
    steps, decisions, requests = telemetry(sched, tmp_path / "tel")
    check_completed(requests)
    assert not steps["hook_fallback"].any()
    by_step = one_version_per_step(decisions)
    v1 = [s for s, v in by_step.items() if v == "swap/1"]
    v2 = [s for s, v in by_step.items() if v == "swap/2"]
    assert v1 and v2 and set(by_step.values()) == {"swap/1", "swap/2"}
    assert max(v1) <= promoted_after < min(v2)
    # The new version decides from the first decision step after the swap.
    assert min(v2) == min(s for s in by_step if s > promoted_after)
    assert (decisions["policy"] == "registry").all()


def test_missing_model_falls_back_to_vllm_then_recovers(store, dirs, vllm_engine, tmp_path, caplog):
    name = "missing"
    sched = registry_scheduler(vllm_engine, f"models:/{name}@champion", tmp_path / "tel")
    assert sched.kvpilot_policy.model_version is None
    registered_after = 10

    def later(step: int) -> None:
        if step < registered_after:
            assert not sched.kvpilot_policy.source.poll_now()  # still nothing: logged once, counted
        elif step == registered_after:
            register(dirs["v1"], name)
            assert sched.kvpilot_policy.source.poll_now()

    served = drive(vllm_engine, sched, on_step=later)
    assert served[:registered_after] == [None] * registered_after
    assert set(served[registered_after:]) == {"1"}
    st = sched.kvpilot_stats
    assert st.fallback_steps == registered_after == st.fallbacks["model:none"]
    assert sched.kvpilot_policy.source.stats.failures["missing"] == registered_after  # start-up + 9 polls
    assert warnings_about(caplog, "cannot serve models:/missing@champion") == 1
    steps, decisions, requests = telemetry(sched, tmp_path / "tel")
    check_completed(requests)
    fell_back = steps.set_index("engine_step")["hook_fallback"]
    assert fell_back.loc[:registered_after].all() and not fell_back.loc[registered_after + 1:].any()
    # the failures are in telemetry too, as counted when each step started (a poll between steps: the next one)
    failed = steps.set_index("engine_step")["model_failures"]
    assert failed.is_monotonic_increasing and failed.iloc[0] == 1 and failed.iloc[-1] == registered_after
    assert st.model_failures == registered_after
    assert (decisions["engine_step"] > registered_after).all()  # no policy decision while falling back
    assert set(decisions["policy_version"]) == {"missing/1"}


def test_corrupt_champion_at_start_up_falls_back_and_is_not_retried(store, dirs, vllm_engine, tmp_path, caplog):
    name = "corrupt"
    version = register(dirs["v1"], name)
    pt = truncate_in_store(name, version)
    sched = registry_scheduler(vllm_engine, f"models:/{name}@champion", tmp_path / "tel")
    assert sched.kvpilot_policy.model_version is None
    drive(vllm_engine, sched, on_step=lambda s: sched.kvpilot_policy.source.poll_now() if s % 5 == 0 else None)
    src = sched.kvpilot_policy.source
    assert src.stats.failures == {"load": 1}  # a bad version is immutable: not downloaded again
    assert warnings_about(caplog, "policy.pt") == 1
    assert any(pt.name in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)
    steps, decisions, requests = telemetry(sched, tmp_path / "tel")
    check_completed(requests)
    assert steps["hook_fallback"].all() and len(decisions) == 0
    assert sched.kvpilot_stats.fallback_steps == len(steps)


@pytest.mark.parametrize("fault", ["truncated policy.pt", "telemetry schema", "feature schema"])
def test_bad_new_champion_keeps_the_last_good_model(store, dirs, vllm_engine, tmp_path, caplog, fault):
    name = "keep-" + fault.split()[0]
    register(dirs["v1"], name)
    sched = registry_scheduler(vllm_engine, f"models:/{name}@champion", tmp_path / "tel")
    promoted_after = 8

    def promote_bad(step: int) -> None:
        if step == promoted_after:
            if fault == "truncated policy.pt":
                v = register(dirs["v2"], name, champion=False)
                truncate_in_store(name, v)
                reg.set_champion(v, name=name)
            else:
                register(dirs["schema" if fault == "telemetry schema" else "features"], name)
        if step >= promoted_after:
            assert not sched.kvpilot_policy.source.poll_now()

    served = drive(vllm_engine, sched, on_step=promote_bad)
    assert set(served) == {"1"}
    failures = sched.kvpilot_policy.source.stats.failures
    assert failures == ({"load": 1} if fault == "truncated policy.pt" else {"schema": 1})
    assert warnings_about(caplog, f"models:/{name}@champion") == 1
    steps, decisions, requests = telemetry(sched, tmp_path / "tel")
    check_completed(requests)
    assert not steps["hook_fallback"].any()
    assert set(decisions["policy_version"]) == {f"{name}/1"}


def test_a_new_version_that_fails_like_the_last_one_is_logged_again(store, dirs, vllm_engine, tmp_path, caplog):
    """Failures are logged once per served version: a promoted version that raises where its predecessor did is
    named in the log, not only counted."""
    from policy.learned.policy import LearnedPolicy

    class Raising(LearnedPolicy):
        def admit(self, waiting, state):
            raise RuntimeError("no admission today")

    def loader(policy_dir):
        policy = LearnedPolicy.load(policy_dir, mode="serve")
        policy.__class__ = Raising
        return policy

    name = "raising"
    register(dirs["v1"], name)
    sched = registry_scheduler(vllm_engine, f"models:/{name}@champion", tmp_path / "tel", loader=loader)

    def promote(step: int) -> None:
        if step == 12:
            register(dirs["v2"], name)
            assert sched.kvpilot_policy.source.poll_now()

    with caplog.at_level(logging.WARNING, logger="kvpilot.hook"):
        drive(vllm_engine, sched, on_step=promote)
    assert sched.kvpilot_stats.model_swaps == 1
    assert warnings_about(caplog, "raised in admit") == 2
    assert sched.kvpilot_stats.fallbacks["admit:exception"] > 2


def test_closing_flushes_the_telemetry_before_waiting_on_the_poll_thread(store, dirs, vllm_engine, tmp_path):
    """A poll stuck in a slow registry call holds the thread's stop for seconds: the telemetry is written first."""
    register(dirs["v1"], "close")
    sched = registry_scheduler(vllm_engine, "models:/close@champion", tmp_path / "tel")
    drive(vllm_engine, sched, n=6)
    source = sched.kvpilot_policy.source
    flushed_at_stop = []
    stop = source.stop
    source.stop = lambda: (flushed_at_stop.append((tmp_path / "tel" / "steps").is_dir()), stop())
    sched.kvpilot_close()
    assert flushed_at_stop == [True]


def test_unreachable_registry_during_polls_keeps_serving(store, dirs, vllm_engine, tmp_path, caplog, monkeypatch):
    """Polls on the background thread against a dead registry: the model stays, the thread lives, and once the
    registry is back a new champion swaps in between steps."""
    import mlflow

    name = "unreachable"
    register(dirs["v1"], name)
    sched = registry_scheduler(vllm_engine, f"models:/{name}@champion", tmp_path / "tel", poll_s=0.05)
    src = sched.kvpilot_policy.source
    live_uri = store[1]
    state = {"phase": "dead"}

    def flip(step: int) -> None:
        if step == 2:
            monkeypatch.setenv("MLFLOW_TRACKING_URI", DEAD)
            mlflow.set_tracking_uri(DEAD)
            t0 = time.monotonic()
            while src.stats.failures.get("unreachable", 0) < 3:  # the thread keeps polling, and failing
                assert time.monotonic() - t0 < 60 and src._thread.is_alive()
                time.sleep(0.02)
        if step == 6:
            monkeypatch.setenv("MLFLOW_TRACKING_URI", live_uri)
            mlflow.set_tracking_uri(live_uri)
            register(dirs["v2"], name)
            state["phase"] = "promoted"
            t0 = time.monotonic()
            while src._pending is None:  # the poll thread loads v2 off the scheduler loop
                assert time.monotonic() - t0 < 60
                time.sleep(0.02)

    served = drive(vllm_engine, sched, on_step=flip)
    assert served[:6] == ["1"] * 6 and set(served[6:]) == {"2"}
    assert warnings_about(caplog, "unreachable") == 1
    steps, decisions, requests = telemetry(sched, tmp_path / "tel")
    assert src._thread is None  # kvpilot_close stopped the poll thread
    check_completed(requests)
    assert not steps["hook_fallback"].any()
    by_step = one_version_per_step(decisions)
    assert {v for s, v in by_step.items() if s <= 6} == {f"{name}/1"}
    assert {v for s, v in by_step.items() if s > 6} == {f"{name}/2"}


# ------------------------------------------------------------------------------------ hot swap keeps state
def agent_request(vllm_engine, rid: str, prompt: list, max_tokens: int, **meta: Any):
    """A request of RL step 0 with kvpilot metadata ``meta`` (``group_id=...``, ``session_id=...``, ...)."""
    extra = {"kvpilot_step": 0, **{f"kvpilot_{k}": v for k, v in meta.items()}}
    return vllm_engine.make_request(rid, prompt, max_tokens, extra_args=extra)


def pause_session(vllm_engine, sched, runner, fillers: int = 24) -> list:
    """Session ``a``'s first turn (it ends in a ``search`` tool call) among ``fillers`` GRPO requests (groups of
    3) that arrive once it runs; steps until it has finished (the session is paused) with requests still
    waiting. Its prompt."""
    prompt = fake_runner.prompt_tokens("sess-a", 48)
    sched.add_request(agent_request(vllm_engine, "a-t0", prompt, 4, session_id="a", turn=0, tool="search",
                                    domain="agentic", group_id="ga", group_size=1))
    runner.step(sched)  # admitted alone
    for i in range(fillers):
        sched.add_request(agent_request(vllm_engine, f"r{i}", fake_runner.prompt_tokens(f"p{i // 3}", 40),
                                        12 + 7 * (i % 5), group_id=f"g{i // 3}", group_size=3, domain="math"))
    for _ in range(200):
        runner.step(sched)
        if "a-t0" not in sched.requests and len(sched.waiting) > 2:
            return prompt
    raise AssertionError("session a never paused with requests waiting")


def swap_now(sched, policy_dir: Path, name: str, runner) -> None:
    """Register ``policy_dir`` as the new champion, stage it, and run the step that swaps it in."""
    old = sched.kvpilot_policy.current
    register(policy_dir, name)
    assert sched.kvpilot_policy.source.poll_now()
    runner.step(sched)
    assert sched.kvpilot_policy.current is not old and sched.kvpilot_stats.model_swaps == 1


def finish(vllm_engine, sched, runner, max_steps: int = 3000) -> None:
    for _ in range(max_steps):
        if not sched.requests:
            return
        runner.step(sched)
    raise AssertionError(f"requests still unfinished: {sorted(sched.requests)}")


def test_swap_keeps_the_learned_policys_session_state(store, dirs, vllm_engine, tmp_path):
    """A new learned version takes over the RL step's phase, the waiting requests' starvation clocks, their table
    rows and the length model's observed state (session ``a`` paused on its tool) at the swap."""
    import math

    name = "carry-learned"
    register(dirs["v1"], name)
    sched = registry_scheduler(vllm_engine, f"models:/{name}@champion", tmp_path / "tel")
    runner = fake_runner.FakeRunner()
    prompt = pause_session(vllm_engine, sched, runner)
    p1 = sched.kvpilot_policy.current
    t1 = p1.table
    rows = {r.request_id: t1.rows[r.request_id] for r in sched.waiting if r.request_id in t1.rows}
    clocks = {rid: (t1.since_step[row], t1.since_s[row]) for rid, row in rows.items()
              if not math.isnan(t1.since_step[row])}
    assert clocks and p1.phase.arrived[0] == 25 and p1.predictor._last_tool == {"a": "search"}
    swap_now(sched, dirs["v2"], name, runner)
    p2 = sched.kvpilot_policy.current
    assert sched.kvpilot_stats.state_carried == 1 and sched.kvpilot_stats.state_dropped == 0
    assert p2.predictor is not p1.predictor
    assert p2.phase.arrived[0] == 25  # all arrived before the swap: a fresh policy counts none
    assert p2.predictor._last_tool == {"a": "search"} and p2.predictor._session["a"].n == 1
    still = [rid for rid in clocks if rid in {r.request_id for r in sched.waiting}]
    assert still, "every clocked request was admitted in the swap step"
    t2 = p2.table
    for rid in still:  # the clock kept running from the first sight under v1
        assert (t2.since_step[t2.rows[rid]], t2.since_s[t2.rows[rid]]) == clocks[rid]
    turn1 = prompt + fake_runner.output_tokens("a-t0", 4) + fake_runner.prompt_tokens("a-tool", 16)
    sched.add_request(agent_request(vllm_engine, "a-t1", turn1, 4, session_id="a", turn=1, domain="agentic",
                                    group_id="ga", group_size=1))
    finish(vllm_engine, sched, runner)
    assert p2.phase.finished[0] == p2.phase.arrived[0] == 26
    steps, decisions, _ = telemetry(sched, tmp_path / "tel")
    assert not steps["hook_fallback"].any() and f"{name}/2" in set(decisions["policy_version"])


def test_swap_keeps_a_baselines_paused_sessions(store, dirs, vllm_engine, tmp_path):
    """Two versions of one baseline class (Continuum): the session paused before the swap is known after it, so
    its tool's latency is learned when its next turn arrives, and the pins taken for it carry over."""
    from policy.baselines.continuum import ToolPauseTTLPolicy

    name = "carry-continuum"
    register(dirs["v1"], name)
    sched = registry_scheduler(vllm_engine, f"models:/{name}@champion", tmp_path / "tel",
                               loader=lambda policy_dir: ToolPauseTTLPolicy(prior_ttl_s=30.0))
    runner = fake_runner.FakeRunner()
    prompt = pause_session(vllm_engine, sched, runner)
    p1 = sched.kvpilot_policy.current
    paused_at = p1.latencies.paused_since_s("a")
    pins = set(p1.pins._pins)
    assert paused_at is not None and not p1.latencies._all
    swap_now(sched, dirs["v2"], name, runner)
    p2 = sched.kvpilot_policy.current
    assert sched.kvpilot_stats.state_carried == 1
    assert p2.latencies.paused_since_s("a") == paused_at and set(p2.pins._pins) == pins
    turn1 = prompt + fake_runner.output_tokens("a-t0", 4) + fake_runner.prompt_tokens("a-tool", 16)
    sched.add_request(agent_request(vllm_engine, "a-t1", turn1, 4, session_id="a", turn=1, domain="agentic",
                                    group_id="ga", group_size=1))
    finish(vllm_engine, sched, runner)
    assert len(p2.latencies._all) == 1 and p2.latencies._all[0] >= 0.0  # the pause, timed across the swap
    assert p2.latencies.paused_since_s("a") is None and not p2.pins._pins
    assert sched.kvpilot_pinned_blocks == 0


def test_swap_to_another_policy_class_drops_the_state(store, dirs, vllm_engine, tmp_path, caplog):
    """A state the new model cannot take (another policy class) is dropped: one log line, counted, no crash."""
    from policy.baselines.continuum import ToolPauseTTLPolicy
    from serving_hook.model_source import learned_loader

    name = "carry-dropped"
    register(dirs["v1"], name)
    loaders = iter([learned_loader, lambda policy_dir: ToolPauseTTLPolicy()])
    sched = registry_scheduler(vllm_engine, f"models:/{name}@champion", tmp_path / "tel",
                               loader=lambda policy_dir: next(loaders)(policy_dir))
    runner = fake_runner.FakeRunner()
    pause_session(vllm_engine, sched, runner)
    swap_now(sched, dirs["v2"], name, runner)
    st = sched.kvpilot_stats
    assert st.state_dropped == 1 and st.state_carried == 0
    assert warnings_about(caplog, "session state") == 1
    assert any("StateMismatch" in r.getMessage() and "kvpilot.learned" in r.getMessage() for r in caplog.records)
    finish(vllm_engine, sched, runner)
    steps, _, _ = telemetry(sched, tmp_path / "tel")
    assert not steps["hook_fallback"].any()


def test_the_start_up_model_decides_the_offload_tier(store, dirs):
    """The tier is built with the engine: the registry policy asks for it when the model it starts with does."""
    from policy.learned.policy import LearnedPolicy
    from serving_hook.model_source import RegistryPolicy

    register(dirs["v1"], "tier")
    uri = "models:/tier@champion"
    assert not RegistryPolicy(uri).uses_offload  # v1 was saved without the tier
    assert RegistryPolicy(uri, lambda d: LearnedPolicy.load(d, offload=True)).uses_offload
    assert not RegistryPolicy("models:/no-such-model@champion").uses_offload  # no model: vLLM's engine as is


def test_the_registry_serves_every_lever_of_its_model(store, dirs):
    """The registry runs its model as ``learned`` runs the same POLICY_DIR: the CPU tier's eviction order (kvpilot's
    cache policy in the tier, decided by the start-up model) and the session prior of its async width rule."""
    from policy.interface import CachedPrefix, EngineState, OwnerState, RequestMeta
    from policy.learned.policy import LearnedPolicy
    from serving_hook.model_source import RegistryPolicy

    register(dirs["v1"], "levers")
    uri = "models:/levers@champion"
    prior = {"swe": {"mean_peak": 1000.0, "sessions": 4.0}}

    def load(d):
        p = LearnedPolicy.load(d, offload=True, host_eviction=True)
        p.session_contexts = prior
        return p

    reg, own = RegistryPolicy(uri, load), load(dirs["v1"])
    assert reg.uses_offload and reg.uses_host_eviction and own.uses_host_eviction
    assert reg.session_contexts == prior
    meta = RequestMeta(session_id="s", tool="bash")
    prefixes = [CachedPrefix(f"o{i}", f"o{i}", state, meta, (), (), float(i), tier_blocks=4)
                for i, state in enumerate((OwnerState.PAUSED_TOOL, OwnerState.FINISHED, OwnerState.RUNNING))]
    state = EngineState(time_s=10.0, engine_step=1, num_running=1, num_waiting=0, num_free_blocks=0,
                        num_total_blocks=64, num_pinned_blocks=0, kv_usage=1.0, block_size=16, max_num_running=8,
                        max_num_batched_tokens=512)
    assert reg.evict_host(prefixes, 4, state).order == own.evict_host(prefixes, 4, state).order
    assert not RegistryPolicy(uri).uses_host_eviction  # v1 was saved without the tier


def test_malformed_model_uri_fails_at_start_up(monkeypatch):
    from serving_hook.config import HookConfig, HookConfigError, build_policy

    monkeypatch.setenv("KVPILOT_MODEL_URI", "kvpilot:champion")
    with pytest.raises(HookConfigError, match="KVPILOT_MODEL_URI.*kvpilot:champion"):
        build_policy(HookConfig(policy="registry"))
    with pytest.raises(HookConfigError, match="option uri.*5: expected a string"):  # a JSON number, not a URI
        build_policy(HookConfig(policy="registry", policy_options={"uri": 5}))


def test_poll_interval_from_the_environment():
    from serving_hook.config import HookConfig, HookConfigError, load_config

    assert load_config({}).model_poll_s == 60.0  # serving polls by default
    assert load_config({"KVPILOT_MODEL_POLL_S": "0"}).model_poll_s == 0.0
    assert HookConfig().model_poll_s == 0.0  # a config built in code (the simulator) never polls
    for bad in ("-1", "often", "nan"):
        with pytest.raises(HookConfigError, match="KVPILOT_MODEL_POLL_S"):
            load_config({"KVPILOT_MODEL_POLL_S": bad})
