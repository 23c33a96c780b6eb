"""Identity: with VllmDefaultPolicy the hook schedules exactly like stock vLLM.

One mixed workload (GRPO groups sharing prompts, multi-turn sessions whose next
prompt is the previous prompt + output + tool tokens, long singletons) runs on
vLLM's real scheduler with a fake runner, under KV pressure (small cache), through:

* stock ``vllm.v1.core.sched.scheduler.Scheduler``;
* ``KVPilotScheduler`` with no configuration (``VllmDefaultPolicy``, passthrough);
* ``KVPilotScheduler`` with ``VllmDefaultPolicy(explicit=True)``: every lever is
  consulted and answers vLLM's choice, so the hook's full decision path runs
  (candidates, re-ordering, victim selection, retention), and must change nothing;
* the same, with telemetry on.

Per step, the scheduled tokens per request must be identical, and so must the
totals of preemptions and prefix-cache hits (vLLM's own counters). The test also
checks that the workload did preempt, hit and evict.
"""

from __future__ import annotations

import pytest

from simulator import fake_runner

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 161  # 160 usable blocks of 16 tokens: 2560 tokens of KV
MAX_STEPS = 3000


def mixed_workload(engine):
    """Arrivals by step: (step, request_id, prompt, max_tokens, extra_args), plus session plans."""
    arrivals = []
    # GRPO: 6 groups x 4 samples share a prompt; groups arrive every 4 steps.
    for g in range(6):
        prompt = fake_runner.prompt_tokens(f"grpo-{g}", 96 + 24 * g)
        for k in range(4):
            arrivals.append(
                (
                    4 * g,
                    f"grpo{g}-s{k}",
                    prompt,
                    24 + 37 * ((g + 3 * k) % 5),
                    {"kvpilot_group_id": f"grpo{g}", "kvpilot_group_size": 4, "kvpilot_domain": "math"},
                )
            )
    # Long singletons (reward-model scoring style), to add pressure.
    for j in range(4):
        arrivals.append((6 + 9 * j, f"long{j}", fake_runner.prompt_tokens(f"long-{j}", 400 + 50 * j), 16, None))
    # Multi-turn sessions: turn 0 arrives now, later turns 3 steps after the previous ends.
    sessions = {}
    for s in range(4):
        sid = f"sess{s}"
        prompt = fake_runner.prompt_tokens(f"sess-{s}", 120 + 16 * s)
        sessions[sid] = {"turns": 3, "out": 20 + 6 * s, "tool_tokens": 40 + 8 * s}
        arrivals.append(
            (
                2 * s,
                f"{sid}-t0",
                prompt,
                sessions[sid]["out"],
                {"kvpilot_session_id": sid, "kvpilot_turn": 0, "kvpilot_tool": "search", "kvpilot_domain": "agentic"},
            )
        )
    return arrivals, sessions


def drive(engine, scheduler_cls, *, num_blocks=NUM_BLOCKS, setup=None):
    """Run the mixed workload; returns per-step scheduled tokens and vLLM's counters."""
    sched = engine.make_scheduler(
        scheduler_cls, num_blocks=num_blocks, log_stats=True, max_num_batched_tokens=512, max_num_seqs=32
    )
    from serving_hook.block_pool import install_eviction_counter

    # Instrument only: count evictions in both runs (a subclass that counts and calls vLLM).
    install_eviction_counter(sched.kv_cache_manager.block_pool)
    if setup is not None:
        setup(sched)
    arrivals, sessions = mixed_workload(engine)
    pending = sorted(arrivals, key=lambda a: a[0])
    runner = fake_runner.FakeRunner()
    prompts = {}
    per_step = []
    preemptions = hits = queries = 0
    step = 0
    while step < MAX_STEPS:
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_tokens, extra = pending.pop(0)
            prompts[rid] = (prompt, max_tokens, extra)
            sched.add_request(engine.make_request(rid, prompt, max_tokens, arrival_time=float(step), extra_args=extra))
        out = runner.step(sched)
        per_step.append(dict(out.num_scheduled_tokens))
        preemptions += len(out.preempted_req_ids or ())
        for eco in (runner.last_outputs or {}).values():
            st = eco.scheduler_stats
            if st is not None:
                pc = st.prefix_cache_stats
                # first admissions and re-admissions after preemption together
                hits += pc.hits + pc.preempted_hits
                queries += pc.queries + pc.preempted_queries
            for o in eco.outputs:
                if o.finish_reason is None or not o.request_id.startswith("sess"):
                    continue
                sid, t = o.request_id.split("-t")
                t = int(t)
                plan = sessions[sid]
                if t + 1 < plan["turns"]:
                    prompt, max_tokens, extra = prompts[o.request_id]
                    nxt = (
                        list(prompt)
                        + fake_runner.output_tokens(o.request_id, max_tokens)
                        + fake_runner.prompt_tokens(f"tool-{sid}-{t}", plan["tool_tokens"])
                    )
                    last = t + 1 == plan["turns"] - 1
                    extra = {
                        "kvpilot_session_id": sid,
                        "kvpilot_turn": t + 1,
                        "kvpilot_domain": "agentic",
                        **({} if last else {"kvpilot_tool": "search"}),
                    }
                    pending.append((step + 3, f"{sid}-t{t + 1}", nxt, plan["out"], extra))
                    pending.sort(key=lambda a: a[0])
        step += 1
        if not pending and not sched.has_requests():
            break
    evictions = sched.kv_cache_manager.block_pool.kvpilot_evictions
    return {
        "per_step": per_step,
        "preemptions": preemptions,
        "hits": hits,
        "queries": queries,
        "evictions": evictions,
        "steps": step,
        "sched": sched,
    }


@pytest.fixture(scope="module")
def stock_run(vllm_engine):
    from vllm.v1.core.sched.scheduler import Scheduler

    return drive(vllm_engine, Scheduler)


def _assert_identical(a, b):
    assert len(a["per_step"]) == len(b["per_step"])
    for i, (x, y) in enumerate(zip(a["per_step"], b["per_step"])):
        assert x == y, f"step {i}: {x} != {y}"
    assert a["preemptions"] == b["preemptions"]
    assert a["hits"] == b["hits"]
    assert a["queries"] == b["queries"]
    assert a["evictions"] == b["evictions"]


def test_workload_exercises_pressure(stock_run):
    r = stock_run
    assert r["steps"] < MAX_STEPS, "workload did not finish"
    assert r["preemptions"] > 0, "no preemption: the workload is too light"
    assert r["hits"] > 0, "no prefix-cache hits"
    assert r["evictions"] > 0, "no prefix-cache evictions"
    # every request ran: 24 GRPO + 4 long + 4 sessions x 3 turns
    ran = set().union(*(s.keys() for s in r["per_step"]))
    assert len(ran) == 24 + 4 + 12


def test_hook_default_is_identical(vllm_engine, stock_run, monkeypatch):
    for var in ("KVPILOT_POLICY", "KVPILOT_POLICY_OPTIONS", "KVPILOT_TELEMETRY_DIR"):
        monkeypatch.delenv(var, raising=False)
    from policy.vllm_default import VllmDefaultPolicy
    from serving_hook import KVPilotScheduler

    hook = drive(vllm_engine, KVPilotScheduler)
    assert isinstance(hook["sched"].kvpilot_policy, VllmDefaultPolicy)
    assert hook["sched"]._kvp_passthrough
    _assert_identical(stock_run, hook)


def test_hook_explicit_default_path_is_identical(vllm_engine, stock_run):
    """The full decision path, answering vLLM's choices, changes nothing."""
    from policy.vllm_default import VllmDefaultPolicy
    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig

    cls = with_policy(KVPilotScheduler, lambda: VllmDefaultPolicy(explicit=True), HookConfig(decision_budget_s=10.0))
    hook = drive(vllm_engine, cls)
    s = hook["sched"]
    assert not s._kvp_passthrough
    assert s.kvpilot_stats.policy_calls > 0
    assert s.kvpilot_stats.fallback_steps == 0
    _assert_identical(stock_run, hook)
    # the hook's own counters agree with vLLM's
    assert s.kvpilot_stats.prefix_hits == stock_run["hits"]
    assert s.kvpilot_stats.prefix_queries == stock_run["queries"]
    assert s.kvpilot_stats.preemptions == stock_run["preemptions"]


def test_hook_async_scheduler_default_is_identical(vllm_engine, monkeypatch):
    for var in ("KVPILOT_POLICY", "KVPILOT_POLICY_OPTIONS", "KVPILOT_TELEMETRY_DIR"):
        monkeypatch.delenv(var, raising=False)
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from serving_hook import KVPilotAsyncScheduler

    a = drive(vllm_engine, AsyncScheduler)
    b = drive(vllm_engine, KVPilotAsyncScheduler)
    _assert_identical(a, b)


def test_hook_with_telemetry_is_identical(vllm_engine, stock_run, tmp_path):
    """Telemetry (and the KV events it turns on) changes nothing either."""
    from policy.vllm_default import VllmDefaultPolicy
    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig

    cfg = HookConfig(telemetry_dir=str(tmp_path), decision_budget_s=10.0)
    hook = drive(vllm_engine, with_policy(KVPilotScheduler, lambda: VllmDefaultPolicy(explicit=True), cfg))
    hook["sched"].shutdown()
    _assert_identical(stock_run, hook)
    assert (tmp_path / "steps").is_dir() and (tmp_path / "kv_events").is_dir()


def test_priority_scheduling_leaves_queue_levers_to_vllm(vllm_engine, caplog):
    """With --scheduling-policy priority the queue is a heap: the hook warns and
    leaves admission and preemption to vLLM, still scheduling identically."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from policy.vllm_default import VllmDefaultPolicy
    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig

    def run(cls):
        s = vllm_engine.make_scheduler(
            cls, num_blocks=41, max_num_seqs=16, max_num_batched_tokens=256, policy="priority"
        )
        for i in range(12):
            prompt = fake_runner.prompt_tokens(f"prio-{i % 3}", 80)
            s.add_request(vllm_engine.make_request(f"p{i}", prompt, 20 + 9 * i, arrival_time=float(i), priority=i % 4))
        runner = fake_runner.FakeRunner()
        steps = []
        while s.has_requests() and len(steps) < 500:
            steps.append(dict(runner.step(s).num_scheduled_tokens))
        return steps, s

    stock, _ = run(Scheduler)
    hooked, s = run(with_policy(KVPilotScheduler, lambda: VllmDefaultPolicy(explicit=True), HookConfig()))
    assert hooked == stock
    assert not s._kvp_admission and not s._kvp_preemption and s._kvp_retention
    assert any("left to vLLM" in r.getMessage() for r in caplog.records)
