"""Failure isolation: a policy that raises, or overruns its time budget, leaves the
engine running with vLLM's own decisions; the fallbacks are counted and logged
once. A bad hook configuration fails at start-up with a clear message."""

from __future__ import annotations

import logging
import time

import pytest

from policy.interface import AdmissionDecision, Policy, PreemptionDecision
from simulator import fake_runner

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 41  # 40 usable blocks: enough pressure to preempt


def _workload(engine):
    reqs = []
    for g in range(3):
        prompt = fake_runner.prompt_tokens(f"fb-{g}", 80)
        for k in range(4):
            reqs.append((f"g{g}s{k}", prompt, 20 + 15 * k))
    return reqs


def _run(engine, cls, steps=400):
    s = engine.make_scheduler(cls, num_blocks=NUM_BLOCKS, max_num_seqs=16, max_num_batched_tokens=256)
    for i, (rid, prompt, n) in enumerate(_workload(engine)):
        s.add_request(
            engine.make_request(rid, prompt, n, arrival_time=float(i), extra_args={"kvpilot_group_id": rid[:2]})
        )
    runner = fake_runner.FakeRunner()
    per_step = []
    preempted = 0
    for _ in range(steps):
        out = runner.step(s)
        per_step.append(dict(out.num_scheduled_tokens))
        preempted += len(out.preempted_req_ids or ())
        if not s.has_requests():
            break
    assert not s.has_requests(), "engine stalled"
    return per_step, preempted, s


class RaisingPolicy(Policy):
    """Uses every lever; the method named ``broken`` raises, the others keep vLLM's choice."""

    name = "test-raising"
    uses_admission = True
    uses_preemption = True
    uses_retention = True
    uses_events = True

    def __init__(self, broken):
        self.broken = broken

    def _maybe_raise(self, what):
        if what == self.broken:
            raise RuntimeError(f"{what} broke")

    def admit(self, waiting, state):
        self._maybe_raise("admit")
        return None

    def preempt(self, running, state):
        self._maybe_raise("preempt")
        return None

    def retain(self, prefixes, state):
        self._maybe_raise("retain")
        return None

    def on_event(self, event):
        self._maybe_raise("on_event")


class SleepingPolicy(Policy):
    """Answers a very different schedule, but too late: every answer must be discarded."""

    name = "test-sleeping"
    uses_admission = True
    uses_preemption = True
    decision_budget_s = 0.002

    def admit(self, waiting, state):
        time.sleep(0.004)
        return AdmissionDecision(order=[c.request_id for c in reversed(waiting)], hold=[waiting[0].request_id])

    def preempt(self, running, state):
        time.sleep(0.004)
        return PreemptionDecision(victim=running[0].request_id)


@pytest.fixture(scope="module")
def stock(vllm_engine):
    from vllm.v1.core.sched.scheduler import Scheduler

    per_step, preempted, _ = _run(vllm_engine, Scheduler)
    assert preempted > 0
    return per_step, preempted


def _hook(policy_cls, **cfg):
    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig

    return with_policy(KVPilotScheduler, policy_cls, HookConfig(**cfg))


@pytest.mark.parametrize("broken", ["admit", "preempt", "retain", "on_event"])
def test_raising_policy_falls_back_to_vllm(vllm_engine, stock, caplog, broken):
    caplog.set_level(logging.WARNING, logger="kvpilot.hook")
    per_step, preempted, s = _run(vllm_engine, _hook(lambda: RaisingPolicy(broken)))
    assert per_step == stock[0]
    assert preempted == stock[1]
    st = s.kvpilot_stats
    assert st.fallbacks.get(f"{broken}:exception", 0) > 1
    assert st.fallback_steps > 0
    # logged once, however often it happened
    msgs = [r.getMessage() for r in caplog.records if r.name == "kvpilot.hook"]
    assert sum(f"raised in {broken} " in m for m in msgs) == 1, msgs


def test_sleeping_policy_is_discarded(vllm_engine, stock, caplog):
    caplog.set_level(logging.WARNING, logger="kvpilot.hook")
    per_step, preempted, s = _run(vllm_engine, _hook(SleepingPolicy))
    assert per_step == stock[0]
    assert preempted == stock[1]
    st = s.kvpilot_stats
    assert st.fallbacks.get("admit:overrun", 0) > 0
    assert st.fallback_steps > 0
    assert st.admission_reorders == 0 and st.held == 0 and st.policy_victims == 0
    msgs = [r.getMessage() for r in caplog.records if "overran its time budget" in r.getMessage()]
    assert len(msgs) == len({k for k in st.fallbacks if k.endswith(":overrun")})


class SlowAfterDecisions(Policy):
    """Decides in time; its events after the step's decisions (scheduled, finished) overrun the budget."""

    name = "test-slow-events"
    uses_admission = True
    uses_events = True
    decision_budget_s = 0.002

    def admit(self, waiting, state):
        return AdmissionDecision(order=[c.request_id for c in reversed(waiting)])

    def on_event(self, event):
        if event.kind.value in ("scheduled", "finished"):
            time.sleep(0.003)


def test_events_after_the_decisions_overrun_without_undoing_them(vllm_engine, caplog):
    """The step's decisions stand: an overrun by the events that follow them is counted and logged once, and the
    step is no fallback (nothing was left to fall back)."""
    caplog.set_level(logging.WARNING, logger="kvpilot.hook")
    _, _, s = _run(vllm_engine, _hook(SlowAfterDecisions))
    st = s.kvpilot_stats
    assert st.late_event_overruns > 0 and st.admission_reorders > 0
    assert st.fallback_steps == 0 and not st.fallbacks
    msgs = [r.getMessage() for r in caplog.records if "after the step's decisions overran" in r.getMessage()]
    assert len(msgs) == 1, msgs


def test_budget_from_config_applies(vllm_engine, stock):
    """KVPILOT_DECISION_BUDGET_MS bounds a policy that does not set its own budget."""

    class Slow(SleepingPolicy):
        decision_budget_s = None

    per_step, _, s = _run(vllm_engine, _hook(Slow, decision_budget_s=0.001))
    assert per_step == stock[0]
    assert s.kvpilot_stats.fallbacks.get("admit:overrun", 0) > 0


def test_wrong_return_type_falls_back(vllm_engine, stock):
    class Wrong(Policy):
        name = "test-wrong"
        uses_admission = True

        def admit(self, waiting, state):
            return [c.request_id for c in reversed(waiting)]  # not an AdmissionDecision

    per_step, _, s = _run(vllm_engine, _hook(Wrong))
    assert per_step == stock[0]
    assert s.kvpilot_stats.fallback_steps > 0


# ------------------------------------------------------------ configuration
def _construct(engine, cls):
    return engine.make_scheduler(cls, num_blocks=16)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"KVPILOT_POLICY": "no-such-policy"}, "known policies: continuum, continuum-offload, heddle"),
        ({"KVPILOT_POLICY_OPTIONS": "{not json"}, "KVPILOT_POLICY_OPTIONS is not valid JSON"),
        ({"KVPILOT_POLICY_OPTIONS": "[1, 2]"}, "must be a JSON object"),
        ({"KVPILOT_POLICY_OPTIONS": '{"bogus": 1}'}, "cannot build policy 'vllm-default'"),
        ({"KVPILOT_DECISION_BUDGET_MS": "fast"}, "KVPILOT_DECISION_BUDGET_MS='fast' is not a number"),
        ({"KVPILOT_DECISION_BUDGET_MS": "-1"}, "must be > 0"),
        ({"KVPILOT_MAX_PINNED_FRACTION": "2"}, "must be in [0, 1]"),
    ],
)
def test_bad_configuration_fails_at_startup(vllm_engine, monkeypatch, env, message):
    from serving_hook import KVPilotScheduler
    from serving_hook.config import HookConfigError

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(HookConfigError) as e:
        _construct(vllm_engine, KVPilotScheduler)
    assert message in str(e.value)


def test_explicit_default_configuration(vllm_engine, monkeypatch):
    from policy.vllm_default import VllmDefaultPolicy
    from serving_hook import KVPilotScheduler

    monkeypatch.setenv("KVPILOT_POLICY", "vllm-default")
    monkeypatch.setenv("KVPILOT_POLICY_OPTIONS", '{"explicit": true}')
    monkeypatch.setenv("KVPILOT_DECISION_BUDGET_MS", "7.5")
    s = _construct(vllm_engine, KVPilotScheduler)
    assert isinstance(s.kvpilot_policy, VllmDefaultPolicy) and s.kvpilot_policy.explicit
    assert s._kvp_guard.budget_s == pytest.approx(0.0075)
    assert not s._kvp_passthrough


# ----------------------------------------------------------- bad metadata
def test_metadata_is_optional_and_forgiving(caplog):
    from policy.interface import RequestMeta
    from serving_hook import metadata

    metadata._warned.clear()
    caplog.set_level(logging.WARNING, logger="kvpilot.hook")
    assert metadata.parse_extra_args(None) == RequestMeta()
    assert metadata.parse_extra_args({"other": 1}) == RequestMeta()
    good = metadata.parse_extra_args(
        {
            "kvpilot_domain": "math",
            "kvpilot_paradigm": "math_verifier",
            "kvpilot_group_id": 17,
            "kvpilot_group_size": "8",
            "kvpilot_session_id": "s1",
            "kvpilot_turn": 2,
            "kvpilot_tool": "search",
            "kvpilot_step": 3.0,
        }
    )
    assert good == RequestMeta("math", "math_verifier", "17", 8, "s1", 2, "search", 3)
    for _ in range(3):
        bad = metadata.parse_extra_args(
            {
                "kvpilot_turn": "two",
                "kvpilot_group_size": 0,
                "kvpilot_domain": ["x"],
                "kvpilot_step": True,
                "kvpilot_tool": "calc",
            }
        )
        assert bad == RequestMeta(tool="calc")
    assert metadata.parse_extra_args(["not", "a", "dict"]) == RequestMeta()
    warnings = [r.getMessage() for r in caplog.records]
    # one warning per bad key, not per request
    assert len(warnings) == 5, warnings
    assert sum("kvpilot_turn" in w for w in warnings) == 1


def test_bad_metadata_never_reaches_vllm(vllm_engine):
    from policy.vllm_default import VllmDefaultPolicy

    s = vllm_engine.make_scheduler(_hook(lambda: VllmDefaultPolicy(explicit=True)), num_blocks=32)
    for i, extra in enumerate([{"kvpilot_turn": "x"}, {"kvpilot_group_size": -3, "kvpilot_group_id": None}, {}]):
        s.add_request(vllm_engine.make_request(f"m{i}", fake_runner.prompt_tokens(f"m{i}", 20), 3, extra_args=extra))
    runner = fake_runner.FakeRunner()
    for _ in range(20):
        runner.step(s)
        if not s.has_requests():
            break
    assert not s.has_requests()
    assert s.kvpilot_stats.fallback_steps == 0


# ------------------------------------------------------------- registry
def test_registry_unknown_name_lists_known_ones():
    from policy.catalog import UnknownPolicyError, create_policy, known_policies

    assert "vllm-default" in known_policies()
    with pytest.raises(UnknownPolicyError, match="known policies: .*vllm-default"):
        create_policy("nope")
    p = create_policy("vllm-default")
    assert p.is_vllm_default and p.name == "vllm-default"
    assert not create_policy("vllm-default", explicit=True).is_vllm_default


def test_config_check_needs_no_vllm_engine():
    """A plugin can validate the configuration before the engine loads the model."""
    from serving_hook.config import HookConfigError, check

    cfg, policy = check({"KVPILOT_POLICY": "vllm-default", "KVPILOT_DECISION_BUDGET_MS": "2"})
    assert cfg.decision_budget_s == pytest.approx(0.002) and policy.name == "vllm-default"
    with pytest.raises(HookConfigError, match="known policies"):
        check({"KVPILOT_POLICY": "learned-v9"})
