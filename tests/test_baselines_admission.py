"""The admission / preemption baselines (policy.baselines: priority, sjf, sortedrl,
heddle, rolloutpipe, seer).

* unit tests of each ranking on plain CandidateRequest objects (no vLLM), of the
  prediction cache, and of the predictor-resolution errors;
* one test of each baseline's defining behaviour on vLLM's real scheduler (the
  kvpilot hook with the FakeRunner), with max_num_seqs or KV small enough that
  order matters, asserting exact outcomes.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from policy.baselines.heddle import ProgressivePriorityPolicy
from policy.baselines.priority import VllmPriorityPolicy
from policy.baselines.rolloutpipe import FrontierGroupPolicy
from policy.baselines.seer import LongestGroupFirstPolicy
from policy.baselines.sjf import ShortestPredictedFirstPolicy
from policy.baselines.sortedrl import SortedRLPolicy
from policy.catalog import create_policy
from policy.common import (
    LengthCache,
    remaining_tokens,
    resolve_length_predictor,
)
from policy.interface import (
    CandidateRequest,
    EngineState,
    Event,
    EventKind,
    RequestMeta,
    RequestStatus,
)
from policy.predictors import DomainMeanLengthPredictor, OracleLengthPredictor
from simulator import fake_runner
from tests.hooks import hook_scheduler as _hook

NAMES = ("vllm-priority", "sjf-predicted", "sortedrl", "heddle", "rolloutpipe", "seer")

STATE = EngineState(
    time_s=0.0,
    engine_step=1,
    num_running=0,
    num_waiting=0,
    num_free_blocks=100,
    num_total_blocks=100,
    num_pinned_blocks=0,
    kv_usage=0.0,
    block_size=16,
    max_num_running=8,
    max_num_batched_tokens=8192,
)


def cand(
    rid,
    arrival=0.0,
    *,
    out=0,
    max_tokens=1000,
    group=None,
    size=None,
    finished=0,
    running=0,
    sibs=(),
    session=None,
    turn=None,
    step=None,
    priority=0,
    wait=0.0,
    status=RequestStatus.WAITING,
    domain=None,
):
    return CandidateRequest(
        request_id=rid,
        meta=RequestMeta(domain=domain, group_id=group, group_size=size, session_id=session, turn=turn, step=step),
        status=status,
        prompt_token_ids=(),
        num_prompt_tokens=10,
        num_cached_tokens=-1,
        num_computed_tokens=0,
        num_output_tokens=out,
        max_tokens=max_tokens,
        arrival_s=arrival,
        wait_s=wait,
        priority=priority,
        group_finished=finished,
        group_running=running,
        sibling_output_tokens=tuple(sibs),
    )


def running(*args, **kw):
    return cand(*args, status=RequestStatus.RUNNING, **kw)


class TablePredictor:
    """Lengths by request id (p50 = p90); unknown ids: inf. Records what it was asked."""

    def __init__(self, lengths, default=math.inf):
        self.lengths = dict(lengths)
        self.default = default
        self.asked: list[str] = []
        self.events: list = []

    def predict(self, requests):
        self.asked.extend(r.request_id for r in requests)
        return [(float(self.lengths.get(r.request_id, self.default)),) * 2 for r in requests]

    def observe(self, event):
        self.events.append(event)


def order(policy, waiting):
    dec = policy.admit(waiting, STATE)
    assert dec.propensity == 1.0
    return list(dec.order)


def victim(policy, cands):
    dec = policy.preempt(cands, STATE)
    assert dec.propensity == 1.0
    return dec.victim


def finished_event(rid, *, out=0, group=None, size=None, session=None, turn=None, reason="stop", domain=None):
    meta = RequestMeta(domain=domain, group_id=group, group_size=size, session_id=session, turn=turn)
    return Event(EventKind.FINISHED, 0.0, rid, meta, num_output_tokens=out, finish_reason=reason)


def arrived_event(rid, *, group=None, size=None, session=None, turn=None):
    meta = RequestMeta(group_id=group, group_size=size, session_id=session, turn=turn)
    return Event(EventKind.ARRIVED, 0.0, rid, meta)


# ================================================== predictor resolution
def test_oracle_without_workload_is_a_clear_error():
    with pytest.raises(ValueError, match="needs the simulated workload.*domain-mean"):
        resolve_length_predictor("oracle", None, policy="X")
    for name in ("sjf-predicted", "sortedrl", "rolloutpipe", "seer"):
        with pytest.raises(ValueError, match="workload"):
            create_policy(name)  # default length_predictor="oracle", no workload in production


def test_predictor_resolution():
    wl = pa.table({"session_id": ["s0", "s1"], "turn": [0, 1], "output_tokens": [7, 9]})
    p = resolve_length_predictor("oracle", wl)
    assert isinstance(p, OracleLengthPredictor)
    assert p.predict([cand("a", session="s1", turn=1), cand("b")]) == [(9.0, 9.0), (math.inf, math.inf)]
    assert isinstance(resolve_length_predictor("domain-mean"), DomainMeanLengthPredictor)
    obj = TablePredictor({})
    assert resolve_length_predictor(obj) is obj
    with pytest.raises(ValueError, match="unknown length_predictor 'lgbm'.*oracle, domain-mean"):
        resolve_length_predictor("lgbm", wl)
    with pytest.raises(TypeError, match="length_predictor must be"):
        resolve_length_predictor(42)
    with pytest.raises(ValueError, match="session_id, turn, output_tokens"):
        resolve_length_predictor("oracle", pa.table({"x": [1]}))
    # the registry passes the workload, and rejects bad options with ValueError
    sjf = create_policy("sjf-predicted", workload=wl)
    assert isinstance(sjf.predictor, OracleLengthPredictor)
    assert isinstance(create_policy("seer", length_predictor="domain-mean").predictor, DomainMeanLengthPredictor)
    with pytest.raises(ValueError, match="bad options"):
        create_policy("seer", length_predictor=3)
    with pytest.raises(ValueError, match="priority_from"):
        create_policy("vllm-priority", priority_from="deadline")
    with pytest.raises(ValueError, match="max_wait_s"):
        create_policy("sjf-predicted", length_predictor="domain-mean", max_wait_s=-1)
    with pytest.raises(ValueError, match="micro_batch_groups"):
        create_policy("rolloutpipe", length_predictor="domain-mean", micro_batch_groups=0)


@pytest.mark.parametrize("name", NAMES)
def test_every_baseline_builds_from_the_registry(name):
    wl = pa.table({"session_id": ["s0"], "turn": [0], "output_tokens": [5]})
    p = create_policy(name, workload=wl)
    assert p.name == name and p.uses_admission and p.uses_preemption and not p.uses_retention
    # deployable configuration: no workload
    q = create_policy(name, length_predictor="domain-mean")
    assert q.name == name


@pytest.mark.parametrize("name", NAMES)
def test_missing_metadata_never_raises_and_is_fcfs(name):
    p = create_policy(name, length_predictor="domain-mean")
    waiting = [cand(f"r{i}", float(i)) for i in range(4)]
    assert order(p, waiting) == ["r0", "r1", "r2", "r3"]
    assert p.admit([], STATE).order == []
    assert p.preempt([], STATE) is None
    assert victim(p, [running(f"r{i}", float(i)) for i in range(3)]) == "r2"  # vLLM's tail
    p.on_event(finished_event("r0"))
    p.on_event(Event(EventKind.TOOL_CALL_STARTED, 0.0, "r1", RequestMeta()))


# ======================================================== shared helpers
def test_remaining_tokens():
    assert remaining_tokens(100, 200, 0, 1000) == 100
    assert remaining_tokens(100, 200, 150, 1000) == 50  # past the median: p90 - generated
    assert remaining_tokens(100, 200, 250, 1000) == 100  # past p90: p90 - p50 more
    assert remaining_tokens(100, 200, 0, 40) == 40  # capped by max_tokens
    assert remaining_tokens(math.inf, math.inf, 10, 50) == 40  # unknown: the remaining budget
    assert remaining_tokens(math.inf, math.inf, 0, 0) == math.inf


def test_length_cache_predicts_once_and_refreshes_on_group_change():
    pred = TablePredictor({"a": 5, "b": 7})
    cache = LengthCache(pred)
    a, b = cand("a", group="g", size=2), cand("b", group="g", size=2)
    assert cache.lookup([a, b]) == [(5.0, 5.0), (7.0, 7.0)]
    for _ in range(3):
        cache.lookup([a, b])
    assert pred.asked == ["a", "b"] and cache.predict_calls == 1
    b.group_finished = 1  # a sibling finished: b is predicted again, alone
    cache.lookup([b])
    cache.lookup([b])
    assert pred.asked == ["a", "b", "b"]
    cache.forget("a")
    cache.lookup([a])
    assert pred.asked[-1] == "a" and len(cache) == 2
    small = LengthCache(TablePredictor({}), max_entries=4)
    small.lookup([cand(f"x{i}") for i in range(4)])
    small.lookup([cand("y")])
    assert len(small) <= 4


def test_predicted_policies_forward_events_and_forget_finished():
    pred = TablePredictor({"a": 5})
    p = ShortestPredictedFirstPolicy(length_predictor=pred)
    p.admit([cand("a")], STATE)
    assert len(p.lengths) == 1
    ev = finished_event("a", out=5)
    p.on_event(ev)
    assert pred.events == [ev] and len(p.lengths) == 0


@pytest.mark.parametrize("name", NAMES)
def test_admission_lists_only_what_vllm_can_admit(name):
    import dataclasses

    lengths = {f"r{i}": float((i * 37) % 23 + 1) for i in range(60)}
    waiting = [
        cand(
            f"r{i}",
            float(i),
            group=f"g{i // 6}" if i % 5 else None,
            size=6,
            finished=i % 3,
            priority=i % 4,
            session=f"s{i % 7}",
            turn=i % 3,
            wait=float(i % 11),
        )
        for i in range(60)
    ]
    small = dataclasses.replace(STATE, max_num_running=6, num_running=4)  # 2 slots: 2 * 2 + 8 = 12 listed
    big = dataclasses.replace(STATE, max_num_running=1000)

    def make():
        return create_policy(name, length_predictor=TablePredictor(lengths))

    full = make().admit(waiting, big).order
    assert sorted(full) == sorted(c.request_id for c in waiting)
    part = make().admit(waiting, small).order
    assert len(part) >= 12 and part == full[: len(part)]


def test_rank_keys_are_cached_until_group_counts_change():
    p = SortedRLPolicy(length_predictor=TablePredictor({}, default=5.0))
    calls = []
    compute = p._compute
    p._compute = lambda sub: calls.append([c.request_id for c in sub]) or compute(sub)
    waiting = [cand("a", 0.0, group="G", size=4), cand("b", 1.0, group="G", size=4), cand("c", 2.0)]
    for _ in range(3):
        p.admit(waiting, STATE)
    assert calls == [["a", "b", "c"]]
    waiting[1].group_finished = 1
    waiting[1].sibling_output_tokens = (7,)
    p.admit(waiting, STATE)
    assert calls[-1] == ["b"]
    p.on_event(finished_event("c"))
    p.admit(waiting, STATE)
    assert calls[-1] == ["c"]


# ============================================================== priority
def test_priority_admission_and_victim():
    p = VllmPriorityPolicy()
    waiting = [cand("a", 0.0, priority=2), cand("b", 1.0, priority=0), cand("c", 2.0, priority=0), cand("d", 3.0)]
    assert order(p, waiting) == ["b", "c", "d", "a"]
    runs = [running("a", 0.0, priority=1), running("b", 1.0, priority=3), running("c", 2.0, priority=3)]
    assert victim(p, runs) == "c"  # max (priority, arrival)


def test_priority_from_metadata():
    p = VllmPriorityPolicy(priority_from="turn")
    waiting = [cand("t0", 0.0, turn=0), cand("t2", 1.0, turn=2), cand("none", 2.0), cand("t1", 3.0, turn=1)]
    assert order(p, waiting) == ["t2", "t1", "t0", "none"]
    assert victim(p, [running(c.request_id, c.arrival_s, turn=c.meta.turn) for c in waiting]) == "none"
    s = VllmPriorityPolicy(priority_from="step")
    waiting = [cand("new", 0.0, step=5), cand("old", 1.0, step=3), cand("none", 2.0)]
    assert order(s, waiting) == ["old", "new", "none"]


# =================================================================== sjf
def test_sjf_orders_by_predicted_remaining():
    pred = TablePredictor({"long": 500, "mid": 100, "short": 10, "pre": 120})
    p = ShortestPredictedFirstPolicy(length_predictor=pred, max_wait_s=None)
    waiting = [cand("long", 0.0), cand("mid", 1.0), cand("short", 2.0), cand("pre", 3.0, out=100), cand("unk", 4.0)]
    # "pre" was preempted after 100 tokens: 20 remain; "unk" ranks by its budget (1000)
    assert order(p, waiting) == ["short", "pre", "mid", "long", "unk"]
    for _ in range(5):
        p.admit(waiting, STATE)
    assert sorted(pred.asked) == sorted(["long", "mid", "short", "pre", "unk"])  # predicted once


def test_sjf_starvation_protection():
    pred = TablePredictor({"long": 500, "s1": 10, "s2": 20, "old": 900})
    hard = ShortestPredictedFirstPolicy(length_predictor=pred, max_wait_s=30.0)
    waiting = [cand("long", 0.0, wait=40.0), cand("old", 1.0, wait=35.0), cand("s1", 2.0, wait=1.0), cand("s2", 3.0)]
    assert order(hard, waiting) == ["long", "old", "s1", "s2"]  # starved ones first, FCFS among them
    aged = ShortestPredictedFirstPolicy(length_predictor=pred, max_wait_s=None, aging_tokens_per_s=20.0)
    # long: 500 - 20*40 = -300; old: 900 - 700 = 200; s1: 10 - 20 = -10; s2: 20
    assert order(aged, waiting) == ["long", "s1", "s2", "old"]
    plain = ShortestPredictedFirstPolicy(length_predictor=pred, max_wait_s=None)
    assert order(plain, waiting) == ["s1", "s2", "long", "old"]


def test_sjf_preempts_longest_remaining():
    pred = TablePredictor({"a": 100, "b": 400, "c": 300})
    p = ShortestPredictedFirstPolicy(length_predictor=pred)
    runs = [running("a", 0.0), running("b", 1.0, out=350), running("c", 2.0, out=10)]
    assert victim(p, runs) == "c"  # b: 50 left (p90 = p50 = 400), c: 290 left
    off = ShortestPredictedFirstPolicy(length_predictor=pred, preempt_longest=False)
    assert off.uses_preemption is False and type(off).uses_preemption is True


# ============================================================== sortedrl
def test_sortedrl_prefers_nearly_complete_groups_then_short():
    pred = TablePredictor({"a2": 400, "b0": 50, "b1": 60, "solo": 30, "huge": 9000})
    p = SortedRLPolicy(length_predictor=pred, long_tokens=4096)
    waiting = [
        cand("b0", 0.0, group="B", size=4, finished=1),
        cand("solo", 1.0),
        cand("huge", 2.0, group="A", size=4, finished=3, max_tokens=16000),
        cand("a2", 3.0, group="A", size=4, finished=3),
        cand("b1", 4.0, group="B", size=4, finished=1),
    ]
    # A is 3/4 done: its short member first (the long one is set aside), then B (1/4), then the solo request
    assert order(p, waiting) == ["a2", "b0", "b1", "solo", "huge"]
    runs = [
        running(
            c.request_id,
            c.arrival_s,
            group=c.meta.group_id,
            size=c.meta.group_size,
            finished=c.group_finished,
            max_tokens=c.max_tokens,
        )
        for c in waiting
    ]
    assert victim(p, runs) == "huge"
    assert (
        victim(
            p,
            [
                running("a2", 0.0, group="A", size=4, finished=3),
                running("b0", 1.0, group="B", size=4),
                running("solo", 2.0),
            ],
        )
        == "b0"
    )  # least complete group, then the longest remaining
    off = SortedRLPolicy(length_predictor=pred, long_tokens=None)
    assert order(off, waiting)[:2] == ["a2", "huge"]


# ================================================================ heddle
def test_heddle_progress_from_events():
    p = ProgressivePriorityPolicy(turn_weight_tokens=100.0)
    p.on_event(finished_event("s-t0", out=300, session="S", turn=0, reason="tool_call"))
    p.on_event(finished_event("s-t1", out=200, session="S", turn=1, reason="tool_call"))
    assert p.session_progress("S") == (2, 500)
    # the returning turn carries no turn metadata: progress comes from the events alone
    waiting = [cand("f0", 0.0, session="F0", turn=0), cand("f1", 1.0), cand("s-t2", 2.0, session="S")]
    assert p.progress(waiting[2]) == 2 * 100 + 500
    assert order(p, waiting) == ["s-t2", "f0", "f1"]
    runs = [running("s-t2", 0.0, session="S", out=10), running("f0", 1.0, out=50), running("f1", 2.0, out=50)]
    assert victim(p, runs) == "f1"  # least progressed; among equals the latest arrival
    p.on_event(finished_event("x", out=10, session="T", reason="abort"))
    assert p.session_progress("T") == (0, 0)


def test_heddle_turn_metadata_and_bounded_sessions():
    p = ProgressivePriorityPolicy(max_sessions=2, length_predictor=TablePredictor({"a": 9, "b": 3}))
    assert order(p, [cand("a", 0.0, turn=1), cand("b", 1.0, turn=1), cand("c", 2.0, turn=3)]) == ["c", "b", "a"]
    for s in ("S1", "S2", "S3"):
        p.on_event(finished_event(s, out=1, session=s))
    assert p.session_progress("S1") == (0, 0) and p.session_progress("S3") == (1, 1)


# =========================================================== rolloutpipe
def test_rolloutpipe_frontier_is_sticky_until_complete():
    pred = TablePredictor({"a0": 50, "a1": 60, "b0": 10, "b1": 20, "c0": 5, "c1": 500, "d0": 1})
    p = FrontierGroupPolicy(micro_batch_groups=2, length_predictor=pred)
    members = {"A": ("a0", "a1"), "B": ("b0", "b1"), "C": ("c0", "c1")}
    for g, ids in members.items():
        for rid in ids:
            p.on_event(arrived_event(rid, group=g, size=2))
    p.on_event(arrived_event("d0"))
    waiting = [
        cand("a0", 0.0, group="A", size=2),
        cand("a1", 1.0, group="A", size=2),
        cand("c0", 2.0, group="C", size=2, running=0),
        cand("c1", 3.0, group="C", size=2),
        cand("b0", 4.0, group="B", size=2),
        cand("b1", 5.0, group="B", size=2),
        cand("d0", 6.0),
    ]
    # closeness ties (0): smallest max remaining -> d0 (1, own group), B (20); then A (60), C (500)
    assert order(p, waiting) == ["d0", "b0", "b1", "a0", "a1", "c0", "c1"]
    assert list(p.frontier) == [("r", "d0"), ("g", "B")]
    # A becomes closer (a member runs) but the frontier is sticky
    waiting2 = [
        cand("a1", 1.0, group="A", size=2, running=1),
        cand("c0", 2.0, group="C", size=2),
        cand("c1", 3.0, group="C", size=2),
        cand("b1", 5.0, group="B", size=2, running=1),
    ]
    assert order(p, waiting2) == ["b1", "a1", "c0", "c1"]
    # victims come from outside the frontier, least complete group first
    runs = [
        running("b0", 4.0, group="B", size=2, running=2),
        running("a0", 0.0, group="A", size=2, running=2),
        running("c0", 2.0, group="C", size=2, running=1),
    ]
    assert victim(p, runs) == "c0"
    assert victim(p, runs[:1]) == "b0"
    # d0 finishes: its slot is refilled with the closest waiting group
    p.on_event(finished_event("d0"))
    assert p.completed == [("r", "d0")]
    assert order(p, waiting2) == ["b1", "a1", "c0", "c1"]
    assert list(p.frontier) == [("g", "B"), ("g", "A")]
    for rid in ("b0", "b1"):
        p.on_event(finished_event(rid, group="B", size=2))
    assert ("g", "B") not in p.frontier and p.completed[-1] == ("g", "B")


# ================================================================== seer
def test_seer_probes_then_longest_group_first():
    pred = TablePredictor({}, default=100.0)
    p = LongestGroupFirstPolicy(length_predictor=pred)
    waiting = [
        cand("a1", 0.0, group="A", size=3, finished=1, sibs=(40,)),
        cand("a2", 1.0, group="A", size=3, finished=1, sibs=(40,)),
        cand("b0", 2.0, group="B", size=3),
        cand("b1", 3.0, group="B", size=3),
        cand("c1", 4.0, group="C", size=3, finished=2, sibs=(300, 500)),
        cand("c2", 5.0, group="C", size=3, finished=2, sibs=(300, 500)),
        cand("d1", 6.0, group="D", size=3, running=1),
        cand("solo", 7.0),
    ]
    # B is unprobed: one member first; then C (500), D and solo (predicted 100), A (40)
    assert order(p, waiting) == ["b0", "c1", "c2", "b1", "d1", "solo", "a1", "a2"]
    mean = LongestGroupFirstPolicy(length_predictor=pred, group_estimate="mean", probe=False)
    # C's mean 400; B, D, solo at 100 in group-arrival order; no probe
    assert order(mean, waiting) == ["c1", "c2", "b0", "b1", "d1", "solo", "a1", "a2"]
    runs = [
        running("c1", 0.0, group="C", size=3, sibs=(500,)),
        running("a1", 1.0, group="A", size=3, sibs=(40,), out=5),
        running("a2", 2.0, group="A", size=3, sibs=(40,), out=1),
    ]
    assert victim(p, runs) == "a2"  # the shortest group; inside it the least work lost


def test_seer_reprobes_a_preempted_probe():
    p = LongestGroupFirstPolicy(length_predictor=TablePredictor({}, default=10.0))
    waiting = [
        cand("g0", 0.0, group="G", size=2),
        cand("g1", 1.0, group="G", size=2, out=4, status=RequestStatus.PREEMPTED),
    ]
    assert order(p, waiting) == ["g1", "g0"]


# ====================================================== on vLLM's scheduler
class _FixedClock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


class _Run:
    """Drive a hooked scheduler; record admissions and finishes (by engine step)."""

    def __init__(self, engine, policy, *, num_blocks=64, max_num_seqs=1, clock=None):
        self.engine = engine
        self.s = engine.make_scheduler(_hook(policy), num_blocks=num_blocks, max_num_seqs=max_num_seqs)
        # a fixed clock: arrival times are small numbers, wait_s = 10 - arrival
        self.s.kvpilot_clock = clock if clock is not None else _FixedClock(10.0)
        self.runner = fake_runner.FakeRunner()
        self.admitted: list[str] = []
        self.finished: dict[str, int] = {}
        self.preempted: list[list[str]] = []

    def add(self, rid, max_tokens, arrival, *, priority=0, **meta):
        extra = {f"kvpilot_{k}": v for k, v in meta.items()} or None
        self.s.add_request(
            self.engine.make_request(
                rid,
                fake_runner.prompt_tokens(rid, 20),
                max_tokens,
                arrival_time=arrival,
                extra_args=extra,
                priority=priority,
            )
        )

    def step(self):
        before = set(self.s.requests)
        out = self.runner.step(self.s)
        self.admitted.extend(d.req_id for d in out.scheduled_new_reqs)
        if out.preempted_req_ids:
            self.preempted.append(sorted(out.preempted_req_ids))
        for rid in sorted(before - set(self.s.requests)):
            self.finished[rid] = self.runner.steps
        return out

    def run(self, limit=400):
        for _ in range(limit):
            self.step()
            if not self.s.has_requests():
                return self
        raise AssertionError("requests did not finish")


def _group_done(run, members):
    return max(run.finished[r] for r in members)


pytestmark_vllm = pytest.mark.vllm


@pytestmark_vllm
def test_vllm_priority_admits_and_preempts_by_priority(vllm_engine):
    r = _Run(vllm_engine, VllmPriorityPolicy())
    for rid, prio, t in (("p3", 3, 0.0), ("p1a", 1, 1.0), ("p1b", 1, 2.0), ("p2", 2, 3.0)):
        r.add(rid, 3, t, priority=prio)
    assert r.run().admitted == ["p1a", "p1b", "p2", "p3"]
    # preemption: 8 usable blocks, 4 requests of 31 prompt tokens need a third block at the second decode
    r = _Run(vllm_engine, VllmPriorityPolicy(), num_blocks=9, max_num_seqs=8)
    for i, prio in enumerate((0, 5, 1, 0)):
        r.s.add_request(
            vllm_engine.make_request(
                f"r{i}", fake_runner.prompt_tokens(f"v{i}", 31), 8, arrival_time=float(i), priority=prio
            )
        )
    while not r.preempted:
        r.step()
    # admitted by priority: running = r0, r3, r2, r1. r0 fails first: the max (priority, arrival) is r1;
    # then r2 (priority 1) fails and is the lowest priority left, so it preempts itself
    assert [c.request_id for c in r.s.running] == ["r0", "r3"]
    assert r.preempted[0] == ["r1", "r2"]
    assert r.s.requests["r1"].num_preemptions == 1
    r.run()


@pytestmark_vllm
def test_sjf_runs_shortest_first_and_aged_long_is_not_starved(vllm_engine):
    wl = pa.table({"session_id": ["L", "S1", "S2"], "turn": [0, 0, 0], "output_tokens": [12, 5, 3]})

    def run(max_wait_s):
        policy = create_policy("sjf-predicted", workload=wl, max_wait_s=max_wait_s)
        r = _Run(vllm_engine, policy)
        for rid, n, t in (("L", 12, 0.0), ("S1", 5, 8.0), ("S2", 3, 9.0)):
            r.add(rid, n, t, session_id=rid, turn=0)
        return r.run()

    assert run(None).admitted == ["S2", "S1", "L"]  # oracle SJF
    # L has waited 10 s >= max_wait_s: it goes first; the shorts (1-2 s) keep SJF order
    assert run(5.0).admitted == ["L", "S2", "S1"]


@pytestmark_vllm
def test_sjf_preempts_longest_predicted(vllm_engine):
    pred = TablePredictor({"r0": 8, "r1": 30, "r2": 8, "r3": 8})
    policy = ShortestPredictedFirstPolicy(length_predictor=pred, max_wait_s=5.0)
    r = _Run(vllm_engine, policy, num_blocks=9, max_num_seqs=8)
    # r0 and r1 have waited 10 s (starved: admitted first, FCFS), r2 and r3 1 s: running = r0, r1, r2, r3
    for i, t in enumerate((0.0, 0.0, 9.0, 9.0)):
        r.s.add_request(
            vllm_engine.make_request(
                f"r{i}", fake_runner.prompt_tokens(f"v{i}", 31), 30 if i == 1 else 8, arrival_time=t
            )
        )
    while not r.preempted:
        r.step()
    assert r.admitted == ["r0", "r1", "r2", "r3"]
    # r0 fails first; the longest remaining is r1 (stock vLLM takes the tail, r3, then r2); r3 then preempts itself
    assert r.preempted[0] == ["r1", "r3"]
    assert r.s.requests["r1"].num_preemptions == 1
    r.run()


@pytestmark_vllm
def test_sortedrl_finishes_a_nearly_complete_group_first(vllm_engine):
    lengths = {"a0": 2, "a1": 2, "a2": 8, "b0": 3, "b1": 3, "b2": 3}

    def run(policy):
        r = _Run(vllm_engine, policy)
        for t, (rid, n) in enumerate(lengths.items()):
            r.add(rid, n, float(t), group_id=rid[0], group_size=3)
        return r.run()

    s = run(SortedRLPolicy(length_predictor=TablePredictor(lengths)))
    # once A has 1 (then 2) of 3 finished, its long a2 outranks the fresh, shorter B
    assert s.admitted == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert _group_done(s, ["a0", "a1", "a2"]) < s.finished["b0"]
    plain = run(ShortestPredictedFirstPolicy(length_predictor=TablePredictor(lengths)))
    assert plain.admitted == ["a0", "a1", "b0", "b1", "b2", "a2"]
    assert _group_done(s, ["a0", "a1", "a2"]) < _group_done(plain, ["a0", "a1", "a2"])


@pytestmark_vllm
def test_heddle_admits_returning_turn_before_fresh_turns(vllm_engine):
    policy = ProgressivePriorityPolicy()
    r = _Run(vllm_engine, policy)
    r.add("S-t0", 4, 0.0, session_id="S", turn=0, tool="search")
    r.run()
    r.add("S-t1", 4, 1.0, session_id="S", turn=1, tool="search")
    r.run()
    assert policy.session_progress("S") == (2, 8)
    for i in range(3):
        r.add(f"F{i}", 2, 10.0 + i, session_id=f"F{i}", turn=0)
    r.add("S-t2", 4, 13.0, session_id="S", turn=2)
    r.run()
    assert r.admitted == ["S-t0", "S-t1", "S-t2", "F0", "F1", "F2"]


@pytestmark_vllm
def test_rolloutpipe_completes_frontier_groups_first(vllm_engine):
    lengths = {"A0": 2, "B0": 5, "C0": 6, "A1": 12, "B1": 5, "C1": 6}

    def run(policy):
        r = _Run(vllm_engine, policy, max_num_seqs=2)
        for t, (rid, n) in enumerate(lengths.items()):
            r.add(rid, n, float(t), group_id=rid[0], group_size=2)
        return r.run()

    fp = run(FrontierGroupPolicy(micro_batch_groups=1, length_predictor=TablePredictor(lengths)))
    assert fp.admitted == ["B0", "B1", "C0", "C1", "A0", "A1"]
    done = {g: _group_done(fp, [g + "0", g + "1"]) for g in "ABC"}
    assert sorted(done, key=done.get) == ["B", "C", "A"]
    assert fp.s.kvpilot_policy.completed == [("g", "B"), ("g", "C"), ("g", "A")]
    # the frontier group completes earlier than under SJF (which starts the short A0 first)
    sjf = run(ShortestPredictedFirstPolicy(length_predictor=TablePredictor(lengths)))
    assert sjf.admitted[:2] == ["A0", "B0"]
    assert done["B"] < _group_done(sjf, ["B0", "B1"])


@pytestmark_vllm
def test_seer_probes_each_group_then_runs_longest_group_first(vllm_engine):
    def run(max_num_seqs, groups, pred):
        r = _Run(vllm_engine, LongestGroupFirstPolicy(length_predictor=pred), max_num_seqs=max_num_seqs)
        t = 0.0
        for g, n in groups.items():
            for i in range(3):
                r.add(f"{g}{i}", n, t, group_id=g, group_size=3)
                t += 1.0
        return r.run()

    # The predictor is wrong (A long, B short); the probes' true lengths correct it.
    r = run(1, {"A": 3, "B": 12}, TablePredictor({"A0": 100, "A1": 100, "A2": 100}, default=1.0))
    assert r.admitted == ["A0", "B0", "B1", "B2", "A1", "A2"]
    # Three groups, two slots: one probe per group before any sibling (probes longest first: the predictor's
    # 10 is capped by max_tokens, which the FakeRunner makes exact), even though B's siblings are the longest.
    r = run(2, {"A": 3, "B": 12, "C": 6}, TablePredictor({}, default=10.0))
    assert r.admitted[:3] == ["B0", "C0", "A0"]
    # A0 finishes at step 9: B (running probe, estimate 10) > C (6, finished probe) > A (3): B1; B0 finishes
    # at 12 (estimate 12): B2; then C, then A
    assert r.admitted == ["B0", "C0", "A0", "B1", "B2", "C1", "C2", "A1", "A2"]
