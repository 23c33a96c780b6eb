"""Benchmark: the hook's time per scheduler step beside vLLM's ``schedule()``.

For 32, 128 and 512 running requests with 256 more waiting, in steady decode on
vLLM 0.33's real scheduler (CPU, fake runner), it steps these side by side,
alternating step by step (in rotating order) so they see the same machine
conditions:

* ``stock``:   ``vllm.v1.core.sched.scheduler.Scheduler``;
* ``default``: ``KVPilotScheduler`` with no configuration (``VllmDefaultPolicy``:
  the zero-cost passthrough path);
* ``full``:    ``KVPilotScheduler`` with ``VllmDefaultPolicy(explicit=True)``, so
  every lever is consulted (candidates built, policy called under its budget).

Two admission regimes, one table each:

* ``seq``: ``max_num_seqs`` = running. vLLM's waiting loop stops at its
  running-count check, and the hook skips admission (nobody can be admitted).
* ``kv``: ``max_num_seqs`` leaves room but KV blocks do not: vLLM tries the head
  of the queue every step and fails to allocate (forced with vLLM's admission
  watermark after warm-up, identically in every variant), so the ``full`` hook
  orders all 256 waiting requests every step.

It prints median and p99 of ``schedule()`` wall time for each variant, the
median over steps of each variant's time over stock's in the same step (target
for ``default``: <= 1.05), and the ``full`` hook's own time
per step as the hook measures it (its work before, inside and after vLLM's
``schedule()``, policy calls included). The default path's own time (a flag test
and the ``super()`` call) is too small to see in a whole step, so it is also
measured in isolation over a no-op base.

A third table times the paused-session levers (issue 17): agent sessions whose turns end in a tool call
(turns of 16-48 tokens; a turn's next one arrives 10 steps later with its context plus 16 tool tokens), on
engines with vLLM's native CPU offload tier (the real ``OffloadingConnector``; its transfers reported by
:class:`simulator.offload.OffloadWorker`), so every step has freed blocks to retain (InferCept's choice per
paused session, re-evaluated) or new sessions to hold back (working-set admission):

* ``stock``: vLLM's ``Scheduler`` with the tier;
* ``infercept-offload`` and ``working-set-offload``: the hook with those baselines (admission, retention,
  events and the tier).

Their steps differ (the policies admit and keep different requests), so the ratio there is of medians,
not paired by step.

Run: ``python -m benchmarks.bench_hook [--steps 300] [--running 32 128 512]
[--clock wall|cpu]``; ``--clock cpu`` times ``schedule()`` by the thread's CPU
time, steadier on a shared machine (the hook's own time is always wall time).
Garbage collection is paused inside the timed loop only.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

from simulator import fake_runner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
for _v in ("KVPILOT_POLICY", "KVPILOT_POLICY_OPTIONS", "KVPILOT_TELEMETRY_DIR"):
    os.environ.pop(_v, None)

WAITING = 256
PROMPT = 64
MS = 1e3
#: ``--clock``: wall time, or the scheduler thread's CPU time (steadier on a shared machine:
#: time the thread spends descheduled by the OS is not counted).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter


def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def group_meta(i):
    """Request ``i``'s metadata: GRPO groups of 8."""
    return {"kvpilot_group_id": f"g{i // 8}", "kvpilot_group_size": 8}


def build(engine, cls, running, mode, meta=group_meta):
    """A scheduler with ``running`` decoding requests and WAITING queued ones (after warm-up).

    ``meta(i)``: the ``extra_args`` (kvpilot metadata) of request ``i``.
    """
    blocks = (running + WAITING) * 16 + 64  # no preemption during the measurement
    s = engine.make_scheduler(
        cls,
        num_blocks=blocks,
        max_num_seqs=running if mode == "seq" else running + WAITING,
        max_num_batched_tokens=max(8192, running * PROMPT),
    )
    runner = fake_runner.FakeRunner()

    def add(lo, hi):
        for i in range(lo, hi):
            s.add_request(
                engine.make_request(
                    f"r{i}",
                    fake_runner.prompt_tokens(f"bench-{i}", PROMPT),
                    100_000,
                    arrival_time=float(i),
                    extra_args=meta(i),
                )
            )

    add(0, running if mode == "kv" else running + WAITING)
    for _ in range(10):  # admit and prefill
        runner.step(s)
    if mode == "kv":
        s.kv_cache_manager.watermark_blocks = blocks  # no waiting request fits from now on
        add(running, running + WAITING)
        runner.step(s)
    assert len(s.running) == running and len(s.waiting) == WAITING, (len(s.running), len(s.waiting))
    return s, runner


def bench(engine, running, steps, mode):
    from vllm.v1.core.sched.scheduler import Scheduler

    from policy.vllm_default import VllmDefaultPolicy
    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig

    full = with_policy(KVPilotScheduler, lambda: VllmDefaultPolicy(explicit=True), HookConfig(decision_budget_s=1.0))
    variants = {"stock": Scheduler, "default": KVPilotScheduler, "full": full}
    built = {k: build(engine, cls, running, mode) for k, cls in variants.items()}
    times = {k: [] for k in variants}
    hook_own = []
    keys = list(variants)
    gc.collect()
    gc.disable()
    try:
        for i in range(steps):
            for k in keys[i % 3 :] + keys[: i % 3]:  # rotate: no variant always runs first
                s, runner = built[k]
                t = clock()
                out = s.schedule()
                times[k].append(clock() - t)
                s.update_from_output(out, runner.model_output(s, out))
                if k == "full":
                    hook_own.append(s.kvpilot_stats.last_hook_time_s)
    finally:
        gc.enable()
    assert built["full"][0].kvpilot_stats.fallback_steps == 0
    return times, hook_own


def passthrough_overhead(batches=300, calls=1000):
    """The default path's own cost per ``schedule()`` call, isolated on a no-op base.

    ``KVPilotMixin.schedule`` over a base whose ``schedule`` returns at once,
    minus that base called directly; per-call times from batches of ``calls``.
    """
    from serving_hook.scheduler import KVPilotMixin

    class NoOp:
        def schedule(self, *args, **kwargs):
            return None

    class Probe(KVPilotMixin, NoOp):  # class defaults: passthrough, as with VllmDefaultPolicy
        pass

    probe, base = Probe.__new__(Probe), NoOp()
    assert probe._kvp_passthrough
    per_call = []
    perf = time.perf_counter
    for _ in range(batches):
        t = perf()
        for _ in range(calls):
            base.schedule()
        t_base = perf() - t
        t = perf()
        for _ in range(calls):
            probe.schedule()
        per_call.append(max(0.0, (perf() - t) - t_base) / calls)
    return per_call


def table(engine, mode, what, steps, sizes):
    print(f"\n{WAITING} waiting, {what}; {steps} decode steps; times in ms")
    header = (
        f"{'running':>7} | {'stock med':>9} {'p99':>7} | {'default med':>11} {'p99':>7} {'ratio':>6} | "
        f"{'full med':>8} {'p99':>7} {'ratio':>6} | {'hook own med':>12} {'p99':>7} {'own/stock':>9}"
    )
    print(header)
    print("-" * len(header))
    for n in sizes:
        times, own = bench(engine, n, steps, mode)
        sm, sp = statistics.median(times["stock"]), p99(times["stock"])
        dm, dp = statistics.median(times["default"]), p99(times["default"])
        fm, fp = statistics.median(times["full"]), p99(times["full"])
        om, op = statistics.median(own), p99(own)
        # paired by step (the variants ran back to back), which cancels machine drift
        dr = statistics.median(d / s_ for d, s_ in zip(times["default"], times["stock"], strict=True))
        fr = statistics.median(f / s_ for f, s_ in zip(times["full"], times["stock"], strict=True))
        print(
            f"{n:>7} | {sm * MS:>9.3f} {sp * MS:>7.3f} | {dm * MS:>11.3f} {dp * MS:>7.3f} {dr:>6.3f} | "
            f"{fm * MS:>8.3f} {fp * MS:>7.3f} {fr:>6.3f} | {om * MS:>12.3f} {op * MS:>7.3f} {om / sm:>9.3f}"
        )


SESSION_PAUSE_STEPS = 10
#: Untimed steps before a sessions run's first turn can end (admission, prefill).
WARM_STEPS = 20
SESSION_TURNS = 5
#: A turn's output tokens, from MIN to MAX (a hash of its id): short turns, so that about 4 of 128 running
#: sessions finish a turn in every step (the levers' worst case: decisions in every step).
TURN_TOKENS = (16, 48)


def sessions_build(engine, cls, running, tier_share=4.0, host_policy=False, turn_tokens=TURN_TOKENS):
    """A scheduler with the CPU tier and ``running`` + WAITING agent sessions, and its turn driver.

    ``tier_share``: the tier's blocks over the GPU's (which hold every session); ``host_policy``: kvpilot's
    ``CachePolicy`` in the tier (:mod:`serving_hook.host_tier`), else vLLM's LRU; ``turn_tokens``: (min, max)
    output tokens of a turn.
    """
    from simulator.cost_model import CostModel
    from simulator.offload import OffloadWorker

    cost = CostModel.preset("H200-7B")
    n = running + WAITING
    blocks = n * 24 + 64
    cfg = engine.make_vllm_config(num_blocks=blocks, max_num_seqs=running, max_num_batched_tokens=max(8192, n * 4),
                                  offload_blocks=int(tier_share * blocks), host_policy=host_policy)
    s = engine.make_scheduler(cls, num_blocks=blocks, vllm_config=cfg)
    worker = OffloadWorker(cost, cost.kv_block_bytes(16))
    runner = fake_runner.FakeRunner()
    now = [0.0]
    if hasattr(s, "kvpilot_clock"):
        s.kvpilot_clock = lambda: now[0]
    prompts: dict[str, list] = {}
    returns: list = []  # (step, session, turn)

    lengths: dict[str, int] = {}

    def add(sid, turn):
        rid = f"{sid}-t{turn}"
        p = prompts[sid]
        out = lengths[rid] = turn_tokens[0] + zlib.crc32(rid.encode()) % (turn_tokens[1] - turn_tokens[0] + 1)
        meta = {"kvpilot_session_id": sid, "kvpilot_turn": turn, "kvpilot_tool": "bash", "kvpilot_domain": "swe",
                "kvpilot_group_id": f"g{int(sid[1:].rstrip('n')) // 8}", "kvpilot_group_size": 8}
        s.add_request(engine.make_request(rid, p, out, arrival_time=now[0], extra_args=meta))

    for i in range(n):
        prompts[f"s{i}"] = fake_runner.prompt_tokens(f"sess-{i}", PROMPT)
        add(f"s{i}", 0)

    k = 0  # the engine step

    def step(timed):
        nonlocal k
        k += 1
        while returns and returns[0][0] <= k:
            _, sid, turn = returns.pop(0)
            add(sid, turn)
        t = clock()
        out = s.schedule()
        dt = clock() - t
        worker.submit(out, now[0])
        mro = runner.model_output(s, out)
        now[0] += 0.02
        kv_out = worker.finished(now[0])
        res = s.update_from_output(out, engine.model_runner_output(mro.req_ids, mro.sampled_token_ids, kv_out))
        for eco in res.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    rid = o.request_id
                    sid, turn = rid.rsplit("-t", 1)
                    if int(turn) < SESSION_TURNS - 1:  # the tool runs; the next turn holds the whole context
                        prompts[sid] = prompts[sid] + fake_runner.output_tokens(rid, lengths[rid]) + \
                            fake_runner.prompt_tokens(f"{rid}-tool", 16)
                        returns.append((k + SESSION_PAUSE_STEPS, sid, int(turn) + 1))
                    else:  # a new session takes its place
                        new = f"{sid}n"
                        prompts[new] = fake_runner.prompt_tokens(f"sess-{new}", PROMPT)
                        returns.append((k, new, 0))
        if timed:
            return dt, getattr(s, "kvpilot_stats", None)
        return None

    # warm-up: admit, prefill, and every session's first turn ended and its tool returned (until then few turns end
    # and few steps decide: timed from step 20, turns of 120-360 tokens measured half the steady state's cost)
    for _ in range(WARM_STEPS + turn_tokens[1] + SESSION_PAUSE_STEPS):
        step(False)
    step.scheduler = s  # (the scheduler the driver steps, for callers that time its parts)
    return step


def sessions_table(engine, steps, sizes):
    from vllm.v1.core.sched.scheduler import Scheduler

    from policy.catalog import create_policy
    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig

    names = ("infercept-offload", "working-set-offload")
    variants = {"stock": Scheduler}
    for name in names:
        variants[name] = with_policy(KVPilotScheduler, lambda name=name: create_policy(name),
                                     HookConfig(decision_budget_s=1.0, kv_block_bytes=917504))
    print(f"\nagent sessions pausing on tools, CPU offload tier on, {WAITING} more sessions than running; "
          f"{steps} steps; times in ms")
    header = f"{'running':>7} | {'stock med':>9} {'p99':>7} | " + " | ".join(
        f"{n + ' med':>22} {'p99':>7} {'ratio':>6} {'hook own':>8}" for n in names)
    print(header)
    print("-" * len(header))
    for n in sizes:
        drivers = {k: sessions_build(engine, cls, n) for k, cls in variants.items()}
        times = {k: [] for k in variants}
        own = {k: [] for k in names}
        gc.collect()
        gc.disable()
        try:
            for _ in range(steps):
                for k, drive in drivers.items():
                    dt, st = drive(True)
                    times[k].append(dt)
                    if st is not None:
                        own[k].append(st.last_hook_time_s)
        finally:
            gc.enable()
        sm = statistics.median(times["stock"])
        cells = [f"{n:>7} | {sm * MS:>9.3f} {p99(times['stock']) * MS:>7.3f}"]
        for k in names:
            m = statistics.median(times[k])
            cells.append(f"{m * MS:>22.3f} {p99(times[k]) * MS:>7.3f} {m / sm:>6.3f} "
                         f"{statistics.median(own[k]) * MS:>8.3f}")
        print(" | ".join(cells))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--running", type=int, nargs="*", default=[32, 128, 512])
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="schedule() timed by wall or thread CPU time")
    a = ap.parse_args(argv)
    global clock
    clock = CLOCKS[a.clock]
    from simulator import engine

    engine.make_vllm_config()  # first ModelConfig outside the timing
    print(
        "vLLM schedule() beside the kvpilot hook (stock / default = VllmDefaultPolicy / full = explicit path); "
        f"schedule() timed by {a.clock} clock"
    )
    table(engine, "seq", "admission bound by max_num_seqs (= running)", a.steps, a.running)
    table(engine, "kv", "admission bound by KV blocks (the queue head fails to allocate)", a.steps, a.running)
    sessions_table(engine, a.steps, a.running)
    own = passthrough_overhead()
    print(
        f"\ndefault path (VllmDefaultPolicy, no telemetry): the hook's own time per schedule() call is "
        f"{statistics.median(own) * 1e6:.3f} us median, {p99(own) * 1e6:.3f} us p99 (a flag test and super())."
    )
    print(
        "ratio = median over steps of variant/stock schedule() time, paired step by step "
        "(target for default: <= 1.05); hook own = the full hook's self-measured time per step "
        "(part of 'full'; the allocate_slots wrapper's fast path and the eviction counter are not in it)."
    )


if __name__ == "__main__":
    main()
