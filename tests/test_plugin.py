"""The ``vllm.general_plugins`` entry point, loaded by vLLM's own plugin loader.

The editable install's entry points come from /work/main's dist-info, so each test makes the entry point
visible through a temporary dist-info on ``sys.path`` (what ``pip install`` writes from pyproject.toml).
"""

from __future__ import annotations

import pytest

from simulator import fake_runner

pytestmark = pytest.mark.vllm

ENTRY = "kvpilot_under_test"


@pytest.fixture
def load_plugins(vllm_engine, tmp_path, monkeypatch):
    """Run ``vllm.plugins.load_general_plugins`` with only our entry point allowed; undo what it patched."""
    import vllm.plugins
    from vllm.config.scheduler import SchedulerConfig

    dist = tmp_path / "kvpilot_plugin_test-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvpilot-plugin-test\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY} = serving_hook.plugin:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VLLM_PLUGINS", ENTRY)
    monkeypatch.setattr(SchedulerConfig, "get_scheduler_cls", SchedulerConfig.get_scheduler_cls)
    for var in ("KVPILOT_POLICY", "KVPILOT_POLICY_OPTIONS", "KVPILOT_TELEMETRY_DIR", "KVPILOT_ENABLE"):
        monkeypatch.delenv(var, raising=False)

    def load() -> None:
        monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
        vllm.plugins.load_general_plugins()

    return load


def _resolved(vllm_engine, **kw):
    return vllm_engine.make_vllm_config(**kw).scheduler_config.get_scheduler_cls()


def test_inert_without_kvpilot_enable(load_plugins, vllm_engine, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    load_plugins()
    assert _resolved(vllm_engine) is Scheduler
    monkeypatch.setenv("KVPILOT_ENABLE", "0")
    load_plugins()
    assert _resolved(vllm_engine) is Scheduler


def test_enable_installs_the_hook_and_it_schedules(load_plugins, vllm_engine, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    from serving_hook import KVPilotAsyncScheduler, KVPilotScheduler

    monkeypatch.setenv("KVPILOT_ENABLE", "1")
    load_plugins()
    load_plugins()  # vLLM may load plugins again in the same process: still one wrapper
    cfg = vllm_engine.make_vllm_config()
    cls = cfg.scheduler_config.get_scheduler_cls()
    assert cls is KVPilotScheduler
    cfg.scheduler_config.async_scheduling = True
    assert cfg.scheduler_config.get_scheduler_cls() is KVPilotAsyncScheduler
    # An explicit --scheduler-cls still wins.
    assert _resolved(vllm_engine, scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler") is Scheduler

    sched = vllm_engine.make_scheduler(cls)
    assert sched.kvpilot_policy.name == "vllm-default"
    sched.add_request(vllm_engine.make_request("r0", fake_runner.prompt_tokens("p", 40), max_tokens=3))
    runner = fake_runner.FakeRunner()
    for _ in range(10):
        fake_runner.step(sched, runner)
    assert not sched.requests  # finished


def test_bad_configuration_fails_at_plugin_load(load_plugins, monkeypatch):
    from serving_hook.config import HookConfigError

    monkeypatch.setenv("KVPILOT_ENABLE", "1")
    monkeypatch.setenv("KVPILOT_DECISION_BUDGET_MS", "soon")
    with pytest.raises(HookConfigError, match="KVPILOT_DECISION_BUDGET_MS"):
        load_plugins()
    monkeypatch.setenv("KVPILOT_ENABLE", "maybe")
    with pytest.raises(HookConfigError, match="KVPILOT_ENABLE"):
        load_plugins()
