"""Paused agent sessions on vLLM's real scheduler: admission that waits, the CPU offload tier, retention.

* a deferred admission loses no request, and the hook's starvation bound (``max_hold_s``) admits a request
  the policy would hold for ever;
* an offloaded session's next turn loads its blocks from vLLM's native CPU tier (the real
  ``OffloadingConnector``) instead of recomputing them: the hit is counted and the transfer priced;
* without a tier, ``OFFLOAD`` acts as ``KEEP`` (counted) and vLLM schedules exactly as it does alone;
* in whole simulations, the tier cuts recompute on an agentic mix, and a policy with the tier turned off
  (``offload_gib=0``) reproduces vLLM default's every result.

(A pinned prefix surviving other requests' allocations until its TTL, then released: tests/test_hook_levers.py.)
"""

from __future__ import annotations

import dataclasses

import pytest

from policy.interface import AdmissionDecision, OwnerState, Policy, Retention, RetentionAction, RetentionDecision
from simulator import fake_runner
from tests.hooks import hook_scheduler, stock_scheduler

pytestmark = pytest.mark.vllm


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class HoldAll(Policy):
    """Holds every waiting request back, always (``bound_s``: the decisions' own hold bound)."""

    name = "test-hold-all"
    uses_admission = True

    def __init__(self, bound_s: float | None = None) -> None:
        self.bound_s = bound_s

    def admit(self, waiting, state):
        return AdmissionDecision(hold=frozenset(c.request_id for c in waiting), hold_bound_s=self.bound_s)


@pytest.mark.parametrize("bound_s", [None, 3.0])
def test_deferred_admission_loses_nothing_and_the_starvation_bound_admits(vllm_engine, bound_s):
    """Each held request goes once it has waited the hook's bound (2 s), or the decisions' own where they set one."""
    engine = vllm_engine
    s = engine.make_scheduler(hook_scheduler(HoldAll(bound_s), max_hold_s=2.0), num_blocks=64, max_num_seqs=8)
    clock = s.kvpilot_clock = Clock()
    for i in range(3):
        s.add_request(engine.make_request(f"r{i}", fake_runner.prompt_tokens(f"w{i}", 20), 3, arrival_time=0.5 * i))
    runner = fake_runner.FakeRunner()
    admitted: dict[str, float] = {}
    for _ in range(40):
        out = runner.step(s)
        for d in out.scheduled_new_reqs:
            admitted[d.req_id] = clock.t
        # every request is somewhere: waiting, running, or admitted earlier (none is lost from vLLM's queues)
        assert {r.request_id for r in s.waiting} | {r.request_id for r in s.running} | set(admitted) == \
            {"r0", "r1", "r2"}
        clock.t += 0.25
        if not s.has_requests():
            break
    assert not s.has_requests()
    # each waited exactly until it had waited the bound since its arrival, not a step more
    wait = 2.0 if bound_s is None else bound_s
    assert admitted == {"r0": wait, "r1": wait + 0.5, "r2": wait + 1.0}
    assert s.kvpilot_stats.hold_overridden == 3
    assert s.kvpilot_stats.held > 0


class OffloadPaused(Policy):
    """Answers OFFLOAD for every prefix whose owner paused on a tool."""

    name = "test-offload-paused"
    uses_retention = True

    def __init__(self) -> None:
        self.states: list = []

    def retain(self, prefixes, state):
        self.states.append(state)
        return RetentionDecision(actions={p.prefix_id: Retention(RetentionAction.OFFLOAD) for p in prefixes
                                          if p.owner_state is OwnerState.PAUSED_TOOL})


def _step(engine, s, worker, clock, dt=0.01):
    """One engine step as the simulator's replica runs it: schedule, submit transfers, sample, report."""
    out = s.schedule()
    blocked = worker.submit(out, clock.t) if worker is not None else 0.0
    sampled = []
    for rid in out.num_scheduled_tokens:
        r = s.requests[rid]
        done = r.num_computed_tokens >= r.num_tokens
        sampled.append([fake_runner.output_token(rid, r.num_output_tokens)] if done else [])
    clock.t += dt + blocked
    kv_out = worker.finished(clock.t) if worker is not None else None
    s.update_from_output(out, engine.model_runner_output(list(out.num_scheduled_tokens), sampled, kv_out))
    return out


def _session_run(engine, policy, offload_blocks: int):
    """Turn 1 of a session pauses on a tool; a filler request takes the GPU; turn 2 returns.

    Returns turn 2's prefix hit at admission, the scheduler, the worker and the steps turn 2 waited."""
    from simulator.cost_model import CostModel
    from simulator.offload import OffloadWorker

    cls = (hook_scheduler(policy, kv_block_bytes=1_000_000, host_link_gbps=1.0) if policy is not None
           else stock_scheduler())
    cfg = engine.make_vllm_config(num_blocks=40, offload_blocks=offload_blocks)
    s = engine.make_scheduler(cls, num_blocks=40, vllm_config=cfg)
    clock = Clock()
    if policy is not None:
        s.kvpilot_clock = clock
    cost = CostModel.preset("H200-7B")
    worker = OffloadWorker(cost, cost.kv_block_bytes(16)) if offload_blocks else None
    meta = {"kvpilot_session_id": "s0", "kvpilot_turn": 0, "kvpilot_tool": "bash"}
    prompt = fake_runner.prompt_tokens("ctx", 160)  # 10 full blocks
    s.add_request(engine.make_request("t0", prompt, 4, arrival_time=0.0, extra_args=meta))

    def drain():
        while s.has_requests() or (worker is not None and worker.busy):
            _step(engine, s, worker, clock)

    drain()
    s.add_request(engine.make_request("fill", fake_runner.prompt_tokens("fill", 500), 4, arrival_time=clock.t))
    drain()  # 32 blocks: with 39 usable, most of t0's cached blocks are taken
    turn2 = prompt + fake_runner.output_tokens("t0", 3) + fake_runner.prompt_tokens("tool", 30)
    s.add_request(engine.make_request("t1", turn2, 4, arrival_time=clock.t,
                                      extra_args={**meta, "kvpilot_turn": 1, "kvpilot_tool": None}))
    hit, waited = None, 0
    while s.has_requests() or (worker is not None and worker.busy):
        out = _step(engine, s, worker, clock)
        if hit is None and "t1" in out.num_scheduled_tokens:
            r = s.requests["t1"]
            hit = r.num_computed_tokens - out.num_scheduled_tokens["t1"]
        elif hit is None:
            waited += 1
    return hit, s, worker, waited


def test_offloaded_session_loads_its_blocks_instead_of_recomputing(vllm_engine):
    engine = vllm_engine
    policy = OffloadPaused()
    hit, s, worker, waited = _session_run(engine, policy, offload_blocks=256)
    # turn 1's whole context (10 prompt blocks; the output block is partial) comes back from the CPU tier
    assert hit == 160
    assert worker.loads >= 1 and worker.load_blocks >= 8  # most of it was evicted from the GPU, then loaded
    assert worker.load_bytes == worker.load_blocks * 16 * 57344
    assert worker.stores >= 2  # write-through: t0's and the filler's blocks were stored as computed
    assert waited >= 1  # the asynchronous load held turn 2 (WAITING_FOR_REMOTE_KVS) until the worker reported it
    assert s.kvpilot_stats.offloaded == 1 and s.kvpilot_stats.offload_unavailable == 0
    st = policy.states[0]
    assert st.num_offload_blocks == 256 and st.offload_load_s_per_block == pytest.approx(1e-3)  # 1 MB at 1 GB/s
    # the same run without the tier (OFFLOAD acts as KEEP: LRU) recomputes what the filler evicted
    hit_gpu_only, s2, _, _ = _session_run(engine, OffloadPaused(), offload_blocks=0)
    assert hit_gpu_only <= 160 - 3 * 16
    assert s2.kvpilot_stats.offload_unavailable == 1 and s2.kvpilot_stats.offloaded == 0


def test_offload_without_a_tier_schedules_as_vllm_does(vllm_engine):
    engine = vllm_engine
    hit_hooked, *_ = _session_run(engine, OffloadPaused(), offload_blocks=0)
    hit_stock, *_ = _session_run(engine, None, offload_blocks=0)
    assert hit_hooked == hit_stock


def test_worker_prices_transfers_on_the_host_link():
    from simulator.cost_model import CostModel

    c = CostModel.preset("H100-7B")
    assert c.host_transfer_s(64e9 * 0.8) == pytest.approx(1.0)  # PCIe Gen5 x16 at 80 %
    with pytest.raises(ValueError, match="host_link_efficiency"):
        CostModel.preset("H100-7B", host_link_efficiency=0.0)


# ------------------------------------------------------------------ whole simulations
@pytest.fixture(scope="module")
def agentic_small():
    from data.synth import SynthConfig, generate

    return generate(dataclasses.replace(SynthConfig.preset("agentic"), steps=1, prompts_per_step=2))


def _run(workload, policy, **kw):
    from simulator.simulation import run_simulation

    return run_simulation(workload, policy, kv_fraction=0.2, progress=False, decode_stride=32,
                          decision_log=False, kv_event_log=False, **kw)


def _sim(workload, policy, **kw):
    return _run(workload, policy, **kw).summary


def test_tier_cuts_recompute_and_off_is_vllm_default(vllm_engine, agentic_small):
    base = _sim(agentic_small, "vllm-default")
    res = _run(agentic_small, "vllm-offload", offload_gib=8.0)
    off = res.summary
    # the hook's steps telemetry reads the same transfers from vLLM's connector metadata
    assert sum(res.steps.column("offload_loaded_blocks").to_pylist()) == off.offload.offload_loaded_blocks
    assert sum(res.steps.column("offload_stored_blocks").to_pylist()) == off.offload.offload_stored_blocks
    assert sum(res.steps.column("offload_loaded_bytes").to_pylist()) == off.offload.offload_load_bytes
    assert sum(res.steps.column("offload_stored_bytes").to_pylist()) == off.offload.offload_store_bytes
    assert off.offload.offload_blocks == int(8 * 2**30 // (16 * 57344))
    tier = off.offload
    assert tier.offload_loads > 0 and tier.offload_load_bytes == tier.offload_loaded_blocks * 16 * 57344
    assert tier.offload_stores > 0 and tier.offload_store_bytes == tier.offload_stored_blocks * 16 * 57344
    assert off.metrics.recomputed_tokens_eviction < 0.5 * base.metrics.recomputed_tokens_eviction
    assert off.metrics.prefix_hit_rate > base.metrics.prefix_hit_rate
    assert off.metrics.simulated_s < base.metrics.simulated_s
    assert off.bound.makespan_over_bound >= 1.0  # the bound charges no transfer: it still holds
    none = _sim(agentic_small, "vllm-offload", offload_gib=0.0)
    assert none.offload.offload_blocks == 0 and none.offload.offload_loads == 0
    skip = {"policy", "wall_s", "scheduler_s", "hook_s", "router_s", "simulator_overhead", "setup_s"}
    none, base = none.to_dict(), base.to_dict()
    assert {k: v for k, v in none.items() if k not in skip} == {k: v for k, v in base.items() if k not in skip}


def test_working_set_admission_holds_and_every_request_finishes(vllm_engine, agentic_small):
    """Holding new sessions back (working-set admission) delays them; none is lost (the driver checks that
    every request of the workload finished) and telemetry counts the holds."""
    res = _run(agentic_small, "working-set")
    held = res.steps.column("held").to_pylist()
    assert sum(held) > 0
    assert res.summary.metrics.requests == agentic_small.num_rows
