"""Benchmark: the learned policy's decision time per scheduler step beside vLLM's ``schedule()``.

Issue #7's target (and #18 item 6's): the learned policy adds at most 10% to ``schedule()`` at 128
and 512 running requests with 256 waiting. The setting is ``bench_hook``'s
``kv`` regime (steady decode on vLLM 0.33's real scheduler, CPU, fake runner):
``max_num_seqs`` leaves room, so vLLM tries to admit every step and the head of
the queue fails to allocate KV blocks; the learned policy ranks all 256 waiting
requests in every step (its worst case: in a step where the running set is
full, the hook does not call it at all). Requests carry the synthetic
workload's metadata (GRPO groups of 8, math / code / agentic domains, RL step 0).

Five schedulers step side by side, alternating in rotating order so that they see the same machine
conditions; each, when it takes over, runs ``--warmup`` untimed steps (default 10), then ``--block``
timed ones (default 20) before the next one runs:

* ``stock``:   ``vllm.v1.core.sched.scheduler.Scheduler``;
* ``default``: ``KVPilotScheduler`` with ``VllmDefaultPolicy`` (zero-cost path);
* ``full``:    ``VllmDefaultPolicy(explicit=True)`` (every lever consulted);
* ``learned``: the ``learned`` policy in serving mode, its scorer's admission order (``admission="scorer"``;
  the default order, shortest predicted remaining first, runs no scorer), from a POLICY_DIR, with the hook's
  candidates on demand (``lazy_candidates``: only new or changed requests' candidates are built);
* ``eager``:   the same policy with ``lazy_candidates`` off (every candidate object refreshed each step);
* ``exact``:   the same policy with ``rescore_tol`` 0: its scorer computes in every step, where ``learned``
  reuses the last step's scores while no input has moved by more than 1% of its standard deviation (the
  share of steps that reused them is printed).

Printed per size: the median ``schedule()`` time of each; the ratio to stock
(median over steps of the paired per-step ratio; target for ``learned``: <= 1.10);
the learned policy's decision time per step: the hook's decision calls (candidates,
engine state, the policy's predictor, features, scorer and ranking, the queue's new
order), median and p99, over stock's median, for ``learned`` and for ``eager``; the
policy calls alone; and the hook's own time without the policy.

Why runs of steps after untimed ones, not one step each: in production one scheduler runs every step, so
what its decisions touch (numpy's and the policy's code and arrays, the candidates) stays in the CPU
caches between its steps as far as vLLM's own ``schedule()`` and the rest of the engine leave it there.
Another scheduler's steps evict it, and it takes several steps to come back: measured at 128 running on
a busy 2-core machine, the learned decisions' time (ms) by position in runs of 10 steps alternating with
stock's runs of 10 was 0.281 0.165 0.132 0.127 0.111 0.124 0.091 0.092 0.094 0.090, with no other
scheduler 0.079-0.092 at every position (vLLM's ``schedule()`` slows down too after a switch). So the
default times steps 11-30 of each run: the single-scheduler setting. ``--block 1 --warmup 0`` is the
former step-by-step alternation, a cold-cache worst case (every variant, stock included, is slower).

Then the verdict per size: stock ``schedule()`` ms per step, the learned
decisions' ms per step, and the share they add (target: <= 10%). A second table
splits the policy's time into its parts (a separate, instrumented run: table
features, scorer, precedence of the preempted and the starved, ranking), and a last line times one
preemption decision over all running requests.

A last table times every lever at once, the CPU tier's included (issue #30): agent sessions pausing on tools
(``bench_hook``'s sessions) on engines with vLLM's CPU offload tier at ``--tier-share`` of the GPU's blocks, so
that the tier is full and evicts in most steps: stock vLLM (its LRU tier) beside the learned policy with
``offload`` and ``host_eviction`` on (the tier's eviction order from the reuse predictor, through
:mod:`serving_hook.host_tier`). Its steps differ from stock's (the policy admits and keeps other requests), so
it compares medians, in wall time (the hook's own time, which counts the tier's eviction too, is wall time), and
means: the time added over the run, in runs of ``--block`` steps after ``--warmup`` untimed ones as above (measured at
agent turns, runs of 20 and step-by-step alternation give the same share, 18.7% and 18.5%, the latter on slower
steps of both), timed in the steady state (once every session's first turn has ended and its
tool returned; before that few steps decide). Turns are short by default (16-48 tokens: about 4 of 128 sessions end a
turn in every step, so every step decides); ``--tier-turn-tokens 120 360`` gives turns of the agentic preset's
swe length (median 236), where a decision comes every few steps and the median step decides nothing. Beside the
decisions it prints the hook's time elsewhere on the engine thread (``HookStats.side_time_s``: arrivals, the events
the policy observes, finishes and frees, preemptions, the tier's store misses and reuses; not its per-chunk
``insert``, which ``bench_host_tier`` times), and their sum: kvpilot's time in the engine, so that work moved out of
``schedule()`` is not work hidden. The time added is net of the tier's eviction that kvpilot's ``CachePolicy.evict``
does instead of vLLM's LRU: stock's ``schedule()`` spends its ``LRUCachePolicy.evict`` time inside (timed in the
same run, column ``lru``), and the hook's time counts kvpilot's whole ``evict``, the order and the chunks it frees;
the gross share is printed beside it.

POLICY_DIR: ``--model DIR`` (e.g. one written by ``kvpilot train policy``), or by
default one built with the learned policy's own API: LightGBM length and reuse models
(the default trees) fitted on a synthetic workload's requests, and a scorer
with seeded random weights (the decision time does not depend on the weights).

Times are the scheduler thread's CPU time by default (``--clock cpu``): on a
shared machine, wall times mostly measure when the OS deschedules the process;
``--clock wall`` gives wall times (the hook's own time is always wall time).

Run: ``python -m benchmarks.bench_learned [--steps 200] [--running 128 512] [--model DIR] [--clock cpu|wall]
[--block 20] [--warmup 10] [--tier-running 128] [--tier-steps 600] [--tier-share 0.05] [--tier-turn-tokens 16 48]``.
Garbage collection is paused inside the timed loops only.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
for _v in ("KVPILOT_POLICY", "KVPILOT_POLICY_OPTIONS", "KVPILOT_TELEMETRY_DIR"):
    os.environ.pop(_v, None)

from benchmarks import bench_hook  # noqa: E402
from benchmarks.bench_hook import CLOCKS, TURN_TOKENS, WAITING, build, p99, sessions_build  # noqa: E402

MS = 1e3
#: The admission tables time the scorer's order, the costlier one (the default, shortest predicted remaining
#: first, ranks the same table's column and runs no scorer); the every-lever table runs the defaults.
SCORER = "scorer"
#: Issue #7's target: the learned policy's decision time per step over stock ``schedule()``'s.
TARGET = 0.10
#: Consecutive timed steps of one scheduler before the next one runs, and its untimed steps before them
#: (``--block``, ``--warmup``; see the module docstring).
BLOCK, WARMUP = 20, 10
#: Steps of the every-lever table: at agent turns about one step in three decides, and two runs of 200 steps of the
#: same tree gave 18.2% and 20.9%.
TIER_STEPS = 600
DOMAINS = ("math", "math", "code", "agentic")  # the synthetic workload's mix (50 / 25 / 25)


def synth_meta(i: int) -> dict:
    """Request ``i``'s metadata, as the synthetic workload's rollouts carry it."""
    g = i // 8
    dom = DOMAINS[g % len(DOMAINS)]
    meta = {
        "kvpilot_domain": dom,
        "kvpilot_paradigm": {"math": "verifier", "code": "unit_tests", "agentic": "tool"}[dom],
        "kvpilot_group_id": f"s0-p{g}",
        "kvpilot_group_size": 8,
        "kvpilot_step": 0,
    }
    if dom == "agentic":
        meta.update(kvpilot_session_id=f"s0-p{g}-{i % 8}", kvpilot_turn=0, kvpilot_tool="search")
    return meta


def make_policy_dir(root: Path) -> Path:
    """A POLICY_DIR built with the learned policy's API (see the module docstring)."""
    import torch

    from data.synth import SynthConfig, generate
    from policy.learned.policy import LearnedPolicy
    from policy.learned.scorer import build_scorer
    from predictors.features import workload_as_requests
    from predictors.length import LengthModel
    from predictors.reuse import ReuseModel

    requests = workload_as_requests(generate(SynthConfig(steps=2)))
    preds = root / "predictors"
    LengthModel.fit(requests).save(preds / "length")
    ReuseModel.fit(requests).save(preds / "reuse")
    length = LengthModel.load(preds / "length")
    torch.manual_seed(0)
    state = {k: v.detach().numpy() for k, v in build_scorer().state_dict().items()}
    policy = LearnedPolicy(state, length, predictors_dir=preds)
    return policy.save(root / "policy")


def schedulers(engine, model: Path, running: int) -> dict:
    from vllm.v1.core.sched.scheduler import Scheduler

    from policy.catalog import create_policy
    from policy.vllm_default import VllmDefaultPolicy
    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig

    cfg = HookConfig(decision_budget_s=1.0)  # measure, never fall back

    def eager():
        p = create_policy("learned", model=str(model), admission=SCORER)
        p.lazy_candidates = False
        return p

    def exact():
        return create_policy("learned", model=str(model), admission=SCORER, rescore_tol=0.0)

    variants = {
        "stock": Scheduler,
        "default": KVPilotScheduler,
        "full": with_policy(KVPilotScheduler, lambda: VllmDefaultPolicy(explicit=True), cfg),
        "learned": with_policy(KVPilotScheduler, lambda: create_policy("learned", model=str(model), admission=SCORER),
                               cfg),
        "eager": with_policy(KVPilotScheduler, eager, cfg),
        "exact": with_policy(KVPilotScheduler, exact, cfg),
    }
    return {k: build(engine, cls, running, "kv", meta=synth_meta) for k, cls in variants.items()}


#: The variants running the learned policy.
LEARNED = ("learned", "eager", "exact")


def policy_time(s) -> float:
    """The (wall) time the hook measured inside policy calls in the scheduler's last step."""
    return s._kvp_guard.budget_s - s._kvp_guard.budget_left


def clocked(obj, names, clock, acc: list) -> None:
    """Time ``obj``'s methods ``names`` with ``clock``, summed into ``acc[0]``."""
    for name in names:
        fn = getattr(obj, name)

        def wrapper(*a, _fn=fn):
            t = clock()
            try:
                return _fn(*a)
            finally:
                acc[0] += clock() - t

        setattr(obj, name, wrapper)


def bench(engine, model: Path, running: int, steps: int, clock, block: int = 1, warmup: int = 0) -> dict:
    built = schedulers(engine, model, running)
    keys = list(built)
    times = {k: [] for k in keys}
    decision = {k: [] for k in LEARNED}  # the hook's decision calls: candidates, policy, new order
    pol, own = [], []
    acc = {k: [0.0] for k in LEARNED}
    pacc = [0.0]
    for k in LEARNED:
        s = built[k][0]
        clocked(s._kvp_admission, ("admit",), clock, acc[k])
        if s._kvp_preemption is not None:
            clocked(s._kvp_preemption, ("choose_victim",), clock, acc[k])
    clocked(built["learned"][0].kvpilot_policy, ("admit", "preempt"), clock, pacc)
    gc.collect()
    gc.disable()
    try:
        for i in range(-(-steps // block)):
            j = i % len(keys)
            for k in keys[j:] + keys[:j]:  # rotate: no variant always runs first
                s, runner = built[k]
                for _ in range(warmup):  # untimed: what the other schedulers' steps evicted comes back
                    out = s.schedule()
                    s.update_from_output(out, runner.model_output(s, out))
                for _ in range(block):  # ``block`` consecutive steps of one scheduler (see the module docstring)
                    if k in acc:
                        acc[k][0] = 0.0
                    pacc[0] = 0.0
                    t = clock()
                    out = s.schedule()
                    times[k].append(clock() - t)
                    if k in acc:
                        decision[k].append(acc[k][0])
                    if k == "learned":
                        pol.append(pacc[0])
                        own.append(s.kvpilot_stats.last_hook_time_s - policy_time(s))
                    s.update_from_output(out, runner.model_output(s, out))
    finally:
        gc.enable()
    for k in LEARNED:
        st = built[k][0].kvpilot_stats
        assert st.fallback_steps == 0, st.fallbacks
        assert st.policy_calls >= steps, f"the learned policy ({k}) was not asked every step"
    return {"times": times, "decision": decision, "policy": pol, "hook_own": own, "scheduler": built["learned"][0]}


def breakdown(engine, model: Path, running: int, steps: int, clock) -> dict[str, list[float]]:
    """Per-step time of each part of the learned policy's admission decision (instrumented run)."""
    s, runner = schedulers_learned(engine, model, running)
    pol = s.kvpilot_policy
    parts: dict[str, list[float]] = {}
    acc: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = clock()
            try:
                return fn(*a, **kw)
            finally:
                acc[name] = acc.get(name, 0.0) + clock() - t

        return wrapper

    try:
        pol.table.features = timed("features", pol.table.features)
        pol.scorer.head = timed("scorer", pol.scorer.head)
        pol.table.first = timed("precedence", pol.table.first)
        pol._order = timed("ranking", pol._order)
        pol.admit = timed("admit", pol.admit)
        gc.collect()
        gc.disable()
        for _ in range(steps):
            acc.clear()
            out = s.schedule()
            total = acc.pop("admit", 0.0)
            for n, v in acc.items():
                parts.setdefault(n, []).append(v)
            parts.setdefault("rest", []).append(total - sum(acc.values()))
            parts.setdefault("admit() total", []).append(total)
            s.update_from_output(out, runner.model_output(s, out))
    finally:
        gc.enable()
    return parts


def schedulers_learned(engine, model: Path, running: int):
    from policy.catalog import create_policy
    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig

    cls = with_policy(KVPilotScheduler, lambda: create_policy("learned", model=str(model), admission=SCORER),
                      HookConfig(decision_budget_s=1.0))
    return build(engine, cls, running, "kv", meta=synth_meta)


def preempt_time(s, clock, calls: int = 50) -> tuple[float, float]:
    """Median and p99 of one ``preempt()`` decision over all running requests (candidates built by the hook)."""
    now = s.kvpilot_clock()
    tr = s._kvp_translate
    ts = []
    for _ in range(calls):
        t = clock()
        cands = tr.candidates(list(s.running), now)
        s.kvpilot_policy.preempt(cands, tr.state(now))
        ts.append(clock() - t)
    return statistics.median(ts), p99(ts)


def tier_bench(engine, model: Path, running: int, steps: int, tier_share: float,
               turn_tokens: tuple[int, int] = TURN_TOKENS, block: int = BLOCK, warmup: int = WARMUP) -> dict:
    """Stock vLLM (LRU tier) beside the learned policy with every lever on, on agent sessions with a full tier.

    ``steps`` timed steps of each, in runs of ``block`` after ``warmup`` untimed ones (see the module docstring)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from policy.catalog import create_policy
    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig

    def learned():
        return create_policy("learned", model=str(model), offload=True, host_eviction=True)

    cls = with_policy(KVPilotScheduler, learned, HookConfig(decision_budget_s=1.0))
    bench_hook.clock = CLOCKS["wall"]
    drivers = {"stock": sessions_build(engine, Scheduler, running, tier_share, turn_tokens=turn_tokens),
               "learned": sessions_build(engine, cls, running, tier_share, host_policy=True, turn_tokens=turn_tokens)}
    # stock's tier eviction (vLLM's LRUCachePolicy.evict), inside its schedule(): kvpilot's evict replaces it
    lru_s = [0.0]
    clocked(drivers["stock"].scheduler.connector.connector_scheduler.manager._policy, ["evict"], CLOCKS["wall"], lru_s)
    lru: list[float] = []
    times: dict[str, list[float]] = {k: [] for k in drivers}
    hook: list[float] = []
    side: list[float] = []  # the hook's time elsewhere in the step (arrivals, events, finishes, the tier's bookkeeping)
    st = None
    gc.collect()
    gc.disable()
    try:
        for i in range(-(-steps // block)):
            for k, drive in (drivers.items() if i % 2 else reversed(drivers.items())):
                for _ in range(warmup):  # untimed: what the other scheduler's steps evicted comes back
                    drive(False)
                for _ in range(block):
                    side0 = st.side_time_s if k == "learned" and st is not None else None
                    lru0 = lru_s[0]
                    dt, st_k = drive(True)
                    times[k].append(dt)
                    if k == "stock":
                        lru.append(lru_s[0] - lru0)
                    if st_k is not None:
                        if side0 is not None:
                            side.append(st_k.side_time_s - side0)
                        st = st_k
                        hook.append(st.last_hook_time_s)
    finally:
        gc.enable()
    assert st is not None and st.fallback_steps == 0, getattr(st, "fallbacks", None)
    assert st.host_evict_calls > 0, "the tier never asked the policy for an eviction order"
    return {"times": times, "hook": hook, "side": side, "lru": lru, "stats": st}


def tier_table(engine, model: Path, sizes: list[int], steps: int, tier_share: float,
               turn_tokens: tuple[int, int] = TURN_TOKENS, block: int = BLOCK, warmup: int = WARMUP) -> None:
    print(f"\nevery lever with the CPU tier: agent sessions pausing on tools, turns of {turn_tokens[0]}-"
          f"{turn_tokens[1]} tokens, a tier of {tier_share:g}x the GPU's blocks (full: it evicts), {WAITING} more "
          f"sessions than running; {steps} steps, in runs of {block} per scheduler after {warmup} untimed; wall ms")
    head = (f"{'running':>7} | {'stock':>7} {'p99':>7} | {'learned':>7} {'p99':>7} {'ratio':>6} | "
            f"{'decide':>7} {'p99':>7} {'/stock':>6} | {'mean':>7} {'/stock':>6} | "
            f"{'lru':>6} {'net':>7} {'/stock':>6} | "
            f"{'side':>7} {'whole':>7} {'/stock':>6} | {'tier orders/step':>16}")
    print(head)
    print("-" * len(head))
    verdicts = []
    for n in sizes:
        r = tier_bench(engine, model, n, steps, tier_share, turn_tokens, block, warmup)
        t, h, st = r["times"], r["hook"], r["stats"]
        sm, lm, hm = statistics.median(t["stock"]), statistics.median(t["learned"]), statistics.median(h)
        smean, hmean = statistics.mean(t["stock"]), statistics.mean(h)
        side, lru = statistics.mean(r["side"]), statistics.mean(r["lru"])
        net = hmean - lru
        print(f"{n:>7} | {sm * MS:>7.3f} {p99(t['stock']) * MS:>7.3f} | {lm * MS:>7.3f} {p99(t['learned']) * MS:>7.3f} "
              f"{lm / sm:>6.3f} | {hm * MS:>7.3f} {p99(h) * MS:>7.3f} {hm / sm:>6.3f} | "
              f"{hmean * MS:>7.3f} {hmean / smean:>6.3f} | {lru * MS:>6.3f} {net * MS:>7.3f} {net / smean:>6.3f} | "
              f"{side * MS:>7.3f} {(net + side) * MS:>7.3f} {(net + side) / smean:>6.3f} | "
              f"{st.host_evict_calls / st.steps:>16.2f}")
        share = max(hm / sm, net / smean)  # the worse of the typical step and the time added over the run
        verdicts.append(f"{n:>7} running, CPU tier, turns of {turn_tokens[0]}-{turn_tokens[1]} tokens: schedule() "
                        f"{sm * MS:.3f} ms (mean {smean * MS:.3f}), every lever's decisions {hm * MS:.3f} ms (mean "
                        f"{hmean * MS:.3f}, {hmean / smean:.1%} of schedule()'s; less the {lru * MS:.3f} ms stock "
                        f"spends in vLLM's LRU eviction of the tier, which kvpilot's does instead, "
                        f"{net * MS:.3f}), added {hm / sm:.1%} per median step, {net / smean:.1%} over the run "
                        f"(target <= {TARGET:.0%}): {'met' if share <= TARGET else 'NOT met'}; with the hook's time "
                        f"elsewhere in the step ({side * MS:.3f} ms: arrivals, events, finishes, the tier's "
                        f"bookkeeping), kvpilot's whole time on the engine thread adds {(net + side) / smean:.1%}")
    print("ratio = learned/stock median schedule() (different steps: the policy admits and keeps other "
          "requests); decide = the hook's own time per step with every decision in it (admission, preemption, "
          "retention, the tier's eviction order and its CachePolicy.evict), over stock's median; mean = its mean "
          "over stock's mean (the time added over the run: where few steps decide, the median step decides "
          "nothing); lru = stock's mean time per step in vLLM's LRUCachePolicy.evict, inside its schedule(): the "
          "tier's eviction, which kvpilot's CachePolicy.evict (in decide) does instead; net = mean - lru, the time "
          "kvpilot adds over the run; side = the hook's mean time per step outside its schedule() measure "
          "(add_request, update_from_output, frees, preemptions, the tier's store misses and reuses: "
          "HookStats.side_time_s); whole = net + side, over stock's mean schedule(); tier orders = evict_host calls "
          "per step")
    print("\n".join(verdicts))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--running", type=int, nargs="*", default=[128, 512])
    ap.add_argument("--model", type=Path, default=None, help="a POLICY_DIR (default: built here)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="times taken by thread CPU or wall time")
    ap.add_argument("--block", type=int, default=BLOCK,
                    help="consecutive timed steps of one scheduler before the next runs (1: alternate step by step)")
    ap.add_argument("--warmup", type=int, default=WARMUP,
                    help="untimed steps of a scheduler before its timed ones, each time it takes over (0: none)")
    ap.add_argument("--tier-running", type=int, nargs="*", default=[128],
                    help="running sessions of the every-lever table with the CPU tier (none: skip it)")
    ap.add_argument("--tier-steps", type=int, default=TIER_STEPS,
                    help="steps of the every-lever table (its mean rests on the few steps that decide)")
    ap.add_argument("--tier-share", type=float, default=0.05, help="that table's tier, a share of the GPU's blocks")
    ap.add_argument("--tier-turn-tokens", type=int, nargs=2, default=list(TURN_TOKENS), metavar=("MIN", "MAX"),
                    help="that table's output tokens per turn (default: short turns, a decision in every step; "
                         "the agentic preset's swe turns are 46-1477, median 236)")
    a = ap.parse_args(argv)
    clock = CLOCKS[a.clock]
    from simulator import engine

    engine.make_vllm_config()  # first ModelConfig outside the timing
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-learned-") as tmp:
        model = a.model or make_policy_dir(Path(tmp))
        print(f"learned policy from {'--model ' + str(a.model) if a.model else 'a POLICY_DIR built here'}")
        print(
            f"\n{WAITING} waiting, vLLM tries to admit every step (KV-bound); {a.steps} decode steps, in runs of "
            f"{a.block} per scheduler after {a.warmup} untimed; "
            f"times in ms ({a.clock} clock)"
        )
        head = (
            f"{'running':>7} | {'stock':>7} | {'default':>7} {'ratio':>6} | {'full':>7} {'ratio':>6} | "
            f"{'learned':>7} {'p99':>7} {'ratio':>6} | {'eager':>7} {'ratio':>6} | "
            f"{'decide':>7} {'p99':>7} {'/stock':>6} | {'eager':>7} {'/stock':>6} | {'policy':>7} {'/stock':>6} | "
            f"{'hook':>6}"
        )
        print(head)
        print("-" * len(head))
        rows, verdicts = [], []
        for n in a.running:
            r = bench(engine, model, n, a.steps, clock, a.block, a.warmup)
            t = r["times"]
            sm = statistics.median(t["stock"])

            def ratio(k, t=t):
                return statistics.median(x / y for x, y in zip(t[k], t["stock"], strict=True))

            pm = statistics.median(r["policy"])
            dm, em = statistics.median(r["decision"]["learned"]), statistics.median(r["decision"]["eager"])
            xm = statistics.median(r["decision"]["exact"])
            learned = r["scheduler"].kvpilot_policy
            reused = learned.reused / max(learned.reused + learned.computed, 1)
            print(
                f"{n:>7} | {sm * MS:>7.3f} | {statistics.median(t['default']) * MS:>7.3f} {ratio('default'):>6.3f} | "
                f"{statistics.median(t['full']) * MS:>7.3f} {ratio('full'):>6.3f} | "
                f"{statistics.median(t['learned']) * MS:>7.3f} {p99(t['learned']) * MS:>7.3f} "
                f"{ratio('learned'):>6.3f} | "
                f"{statistics.median(t['eager']) * MS:>7.3f} {ratio('eager'):>6.3f} | "
                f"{dm * MS:>7.3f} {p99(r['decision']['learned']) * MS:>7.3f} {dm / sm:>6.3f} | "
                f"{em * MS:>7.3f} {em / sm:>6.3f} | {pm * MS:>7.3f} {pm / sm:>6.3f} | "
                f"{statistics.median(r['hook_own']) * MS:>6.3f}"
            )
            rows.append((n, r["scheduler"]))
            verdicts.append(f"{n:>7} running: schedule() {sm * MS:.3f} ms, learned decisions {dm * MS:.3f} ms "
                            f"(without candidates on demand {em * MS:.3f} ms), added {dm / sm:.1%} "
                            f"(target <= {TARGET:.0%}): {'met' if dm / sm <= TARGET else 'NOT met'}; scores "
                            f"reused in {reused:.0%} of steps; computed in every step (rescore_tol 0) "
                            f"{xm * MS:.3f} ms, {xm / sm:.1%}")
        print(
            "ratio = median over steps of variant/stock schedule() time, paired step by step (target for learned: "
            "<= 1.10); decide = the learned policy's decision time per step, as the hook spends it (its admission "
            "and preemption calls: candidates, engine state, the policy, the queue's new order) with candidates on "
            "demand, eager = the same without; /stock = over stock's median; policy = the policy's admit/preempt "
            "calls alone (predictions, features, scorer, ranking); hook = the hook's own wall time without the "
            "policy."
        )
        print(f"\nissue #7's target: the learned policy's decisions add at most {TARGET:.0%} to stock schedule() "
              f"(per step, {a.clock} time)")
        print("\n".join(verdicts))
        print("\nparts of the learned policy's admission decision per step (instrumented run), ms median [p99]")
        for n, _ in rows:
            parts = breakdown(engine, model, n, max(20, a.steps // 4), clock)
            print(f"{n:>7} running: " + "; ".join(
                f"{k} {statistics.median(v) * MS:.3f} [{p99(v) * MS:.3f}]" for k, v in parts.items()
            ))
        for n, s in rows:
            m, q = preempt_time(s, clock)
            print(f"one preemption decision over {n} running (candidates + preempt()): "
                  f"{m * MS:.3f} ms [p99 {q * MS:.3f}]")
        if a.tier_running:
            tier_table(engine, model, a.tier_running, a.tier_steps, a.tier_share, tuple(a.tier_turn_tokens), a.block,
                       a.warmup)


if __name__ == "__main__":
    main()
