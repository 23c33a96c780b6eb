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
from pathlib import Path

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
    runner = engine.FakeRunner()

    def add(lo, hi):
        for i in range(lo, hi):
            s.add_request(
                engine.make_request(
                    f"r{i}",
                    engine.prompt_tokens(f"bench-{i}", PROMPT),
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--running", type=int, nargs="*", default=[32, 128, 512])
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="schedule() timed by wall or thread CPU time")
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
