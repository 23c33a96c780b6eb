"""The learned policy's per-request feature table gives the scorer the same input as building it afresh.

Run through vLLM's real scheduler (the hook's candidates, events and preemptions), both in serving mode
(learned) and in the behaviour policy's log mode, on a workload that preempts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from policy.learned.exploring import LoggingPolicy
from policy.learned.features import FEATURES, model_features
from policy.learned.policy import LearnedPolicy
from policy.learned.sampler import _predict, candidate_raw
from policy.learned.scorer import build_scorer
from tests.learned_logs import KV_FRACTION, tiny_workload
from tests.test_learned import FixedLengths


class Lengths(FixedLengths):
    """Predictions that change when a sibling finishes (as the LightGBM model's do), else fixed per request."""

    def __init__(self) -> None:
        super().__init__({})

    def predict(self, cands):
        return [(100.0 + len(c.request_id) * 7 + 50 * c.group_finished, 300.0 + 90 * c.group_finished)
                for c in cands]


def _checked(policy, both: bool = False):
    """Wrap ``policy.table.features`` and ``policy.table.remaining`` to compare each decision's input (or
    predicted remaining output) with the full, from-scratch build; ``both``: each remaining call is followed by a
    features call on the same candidates (rows it refreshed without their features are read)."""
    table = policy.table
    features, remaining = table.features, table.remaining
    seen = {"calls": 0, "rows": 0, "incremental": 0, "remaining": 0}
    col = FEATURES.index("log_pred_remaining")

    def fresh(cands, state):
        return model_features(candidate_raw(cands, _predict(policy.lengths, cands), state, policy.phase))

    def check(cands, state, refresh=False):
        tracking = table.tracking
        x, idx = features(cands, state, refresh)
        np.testing.assert_array_equal(x, fresh(cands, state))
        seen["calls"] += 1
        seen["rows"] += len(cands)
        seen["incremental"] += tracking and not refresh
        return x, idx

    def check_remaining(cands, state, refresh=False):
        tracking = table.tracking
        rem, idx = remaining(cands, state, refresh)
        np.testing.assert_array_equal(rem, np.expm1(fresh(cands, state)[:, col].astype(np.float64)))
        seen["remaining"] += tracking and not refresh
        seen["rows"] += len(cands)
        if both:
            check(cands, state, refresh)
            rem, idx = remaining(cands, state, refresh)
        return rem, idx

    table.features = check
    table.remaining = check_remaining
    return seen


@pytest.mark.parametrize("kind", ["learned", "learned-scorer", "logging", "both"])
def test_table_features_equal_a_fresh_build(vllm_engine, tmp_path: Path, kind: str) -> None:
    """Every decision's input equals a fresh build: the scorer's order (features), the default order by
    predicted remaining output with the preemption head's features in between (remaining rows, then features of
    running ones), the behaviour policy's (remaining), and both read in turn from the same rows."""
    import torch

    from simulator.simulation import run_simulation

    if kind == "logging":
        policy = LoggingPolicy(Lengths())
    else:
        torch.manual_seed(0)
        state = {k: v.detach().numpy() for k, v in build_scorer().state_dict().items()}
        policy = LearnedPolicy(state, Lengths(), preempt=True,
                               admission="scorer" if kind == "learned-scorer" else "shortest")
    seen = _checked(policy, both=kind == "both")
    res = run_simulation(tiny_workload(5), policy, kv_fraction=KV_FRACTION, out_dir=tmp_path, progress=False)
    assert seen["rows"] > 200, seen
    assert seen["incremental" if kind == "learned-scorer" else "remaining"] > 20, seen
    if kind == "both":
        assert seen["incremental"] > 20, seen
    if kind != "logging":
        assert seen["calls"] > 5, seen  # the preemption head read the running rows' features
    assert res.summary.metrics.preemptions > 0  # running rows were preempted back into the queue


def _recorded(policy, kinds: set) -> list:
    """Wrap ``policy``'s decisions to record each one's candidates and answer (``kinds``: the candidates' types)."""
    log: list = []
    for name in ("admit", "preempt"):
        fn = getattr(policy, name)

        def wrapper(cands, state, _fn=fn, _name=name):
            kinds.add(type(cands).__name__)
            dec = _fn(cands, state)
            ids = list(cands.request_ids) if hasattr(cands, "request_ids") else [c.request_id for c in cands]
            log.append((_name, state.engine_step, ids, getattr(dec, "order", None), getattr(dec, "victim", None)))
            return dec

        setattr(policy, name, wrapper)
    return log


def test_lazy_candidates_decide_the_same(vllm_engine, tmp_path: Path) -> None:
    """The hook's candidates on demand (``lazy_candidates``) give the learned policy the decisions of the full
    candidate lists, step by step, on vLLM's real scheduler (with preemption, the learned preemption head on)."""
    import torch

    from simulator.simulation import run_simulation

    torch.manual_seed(0)
    state = {k: v.detach().numpy() for k, v in build_scorer().state_dict().items()}
    runs = {}
    for lazy in (True, False):
        policy = LearnedPolicy(state, Lengths(), preempt=True)
        assert policy.lazy_candidates
        policy.lazy_candidates = lazy
        kinds: set = set()
        log = _recorded(policy, kinds)
        res = run_simulation(tiny_workload(5), policy, kv_fraction=KV_FRACTION, out_dir=tmp_path / str(lazy),
                             progress=False)
        assert kinds == ({"LazyCandidates"} if lazy else {"list"})
        runs[lazy] = (log, res.summary)
    (lazy_log, lazy_sum), (full_log, full_sum) = runs[True], runs[False]
    assert len(lazy_log) > 50 and any(d[0] == "preempt" for d in full_log)
    assert lazy_log == full_log
    lazy_m, full_m = lazy_sum.metrics, full_sum.metrics
    assert lazy_m.makespan_s == full_m.makespan_s and lazy_m.preemptions == full_m.preemptions


def test_light_values_equal_the_raw_matrix_path() -> None:
    """The light refill's values (remaining output, running, preempted) are those of the raw matrix, at every edge:
    unknown and infinite predictions, p90 below p50, output past p50 / p90 / max_tokens, no max_tokens."""
    from policy.interface import CandidateRequest, EngineState, RequestMeta, RequestStatus
    from policy.learned.features import R, light_values, log_remaining
    from policy.learned.sampler import StepPhase

    nan, inf = float("nan"), float("inf")
    cases = [  # (p50, p90, output so far, max_tokens, status, preemptions)
        (100.0, 300.0, 0, 1000, RequestStatus.WAITING, 0), (100.0, 300.0, 150, 1000, RequestStatus.RUNNING, 0),
        (100.0, 300.0, 400, 1000, RequestStatus.RUNNING, 1), (100.0, 300.0, 990, 1000, RequestStatus.PREEMPTED, 2),
        (nan, nan, 0, 512, RequestStatus.WAITING, 0), (inf, inf, 7, 0, RequestStatus.WAITING, 0),
        (nan, 50.0, 3, None, RequestStatus.PREEMPTED, 1), (300.0, 100.0, 120, 2000, RequestStatus.WAITING, 0),
        (80.0, inf, 90, 85, RequestStatus.RUNNING, 0), (1.0, 1.0, 5, 4, RequestStatus.WAITING, 0),
    ]
    cands = [CandidateRequest(request_id=f"r{i}", meta=RequestMeta(), status=st, prompt_token_ids=(),
                              num_prompt_tokens=10, num_cached_tokens=-1, num_computed_tokens=0, num_output_tokens=o,
                              max_tokens=mx, arrival_s=0.0, wait_s=0.0, num_preemptions=pre)
             for i, (_, _, o, mx, st, pre) in enumerate(cases)]
    preds = [(a, b) for a, b, *_ in cases]
    state = EngineState(time_s=1.0, engine_step=1, num_running=1, num_waiting=1, num_free_blocks=1,
                        num_total_blocks=10, num_pinned_blocks=0, kv_usage=0.5, block_size=16, max_num_running=8,
                        max_num_batched_tokens=64)
    raw = candidate_raw(cands, preds, state, StepPhase())
    lr, running, preempted = light_values(cands, preds)
    np.testing.assert_array_equal(lr, log_remaining(raw))
    assert running == (raw[:, R["is_running"]] > 0).tolist()
    assert preempted == ((raw[:, R["preemptions"]] > 0) & (raw[:, R["is_running"]] == 0)).tolist()
    assert preempted == [False, False, False, True, False, False, True, False, False, False]


def test_shortest_first_orders_as_numpy_does() -> None:
    """The compiled default order: the same places as the numpy keys and sort, every clock started as
    ``_start_clocks`` starts them, and -1 where a preempted or starved row goes first or a key is not a number."""
    from policy.learned.shortest_first import compiled_shortest_first

    kernel = compiled_shortest_first()
    if kernel is None:
        pytest.skip("numba is not installed: the numpy path runs")
    rng = np.random.default_rng(0)
    inf = float("inf")
    for trial in range(300):
        cap, n = 64, int(rng.integers(1, 60))
        idx = rng.permutation(cap)[:n].astype(np.int64)
        lr = np.round(rng.random(cap) * 8, int(rng.integers(0, 3)))  # rounded: equal predictions occur
        since = np.where(rng.random((cap, 1)) < 0.3, np.nan, rng.integers(0, 50, (cap, 1)).astype(float))
        since = np.hstack([since, since * 0.02])
        pre = np.zeros(cap, bool)
        if trial % 5 == 0:
            pre[idx[int(rng.integers(n))]] = True
        max_steps = inf if trial % 3 else 40.0
        take = int(rng.integers(1, min(n, 32) + 1))
        want_since = since.copy()
        s = want_since[idx]
        s[np.isnan(s[:, 0])] = (60.0, 1.2)
        want_since[idx] = s
        top, oldest, got_since = np.empty(take, np.int64), np.empty(2), since.copy()
        steps, times = got_since[:, 0].copy(), got_since[:, 1].copy()  # (the table's two 1-d clocks)
        got = kernel(idx, lr, pre, steps, times, 60.0, 1.2, max_steps, inf, True, top, np.empty(take), oldest)
        got_since = np.column_stack([steps, times])
        if pre[idx].any():
            assert got == -1
            continue
        np.testing.assert_array_equal(got_since, want_since)
        if not 60.0 - s[:, 0].min() < max_steps:
            assert got == -1  # a starved row goes first
            continue
        assert tuple(oldest) == (s[:, 0].min(), s[:, 1].min())
        keys = -np.expm1(lr[idx].astype(np.float32).astype(np.float64)) - np.arange(n) * 1e-9
        assert got == take and top.tolist() == np.argsort(-keys, kind="stable")[:take].tolist()
    lr = np.array([1.0, np.nan])
    assert kernel(np.array([0, 1]), lr, np.zeros(2, bool), np.zeros(2), np.zeros(2), 0.0, 0.0, inf, inf, True,
                  np.empty(1, np.int64), np.empty(1), np.empty(2)) == -1


def test_shortest_first_decides_as_the_numpy_path(vllm_engine, tmp_path: Path, monkeypatch) -> None:
    """The learned policy's default order in one compiled pass gives the decisions of the numpy path, step by step,
    on vLLM's real scheduler, with preemptions (the numpy path then takes over for the preempted requests). The
    queue's ids (the hook's offer) are read only for the arrivals where the queue is the last order's less its head
    plus arrivals; they and the table's rows equal a full read at every decision."""
    import torch

    from serving_hook import translate
    from simulator.simulation import run_simulation

    offer, shifts = translate.Translator.offer, []

    def checked_offer(self, reqs, now, lazy):
        cands = offer(self, reqs, now, lazy)
        assert cands.request_ids == tuple(r.request_id for r in reqs)
        return cands

    def counted_shift(last, now, _fn=translate.shifted):
        k = _fn(last, now)
        shifts.append(k >= 0)
        return k

    monkeypatch.setattr(translate.Translator, "offer", checked_offer)
    monkeypatch.setattr(translate, "shifted", counted_shift)
    torch.manual_seed(0)
    state = {k: v.detach().numpy() for k, v in build_scorer().state_dict().items()}
    runs = {}
    for compiled in (True, False):
        policy = LearnedPolicy(state, Lengths(), preempt=True)
        if compiled:
            assert policy.table._shortest_first is not None, "numba ships with vLLM"
        else:
            policy.table._shortest_first = None
        shortest, answers = policy.table.shortest, []

        def counted(*a, _fn=shortest, _answers=answers):
            out = _fn(*a)
            _answers.append(out is not None)
            return out

        policy.table.shortest = counted
        rows = policy.table._rows

        def checked_rows(cands, ids, _fn=rows, _table=policy.table):
            idx = _fn(cands, ids)
            assert idx.tolist() == [_table.rows[rid] for rid in ids]
            return idx

        policy.table._rows = checked_rows
        log = _recorded(policy, set())
        res = run_simulation(tiny_workload(5), policy, kv_fraction=KV_FRACTION, out_dir=tmp_path / str(compiled),
                             progress=False)
        runs[compiled] = (log, res.summary.metrics, answers)
    (log, m, answers), (numpy_log, numpy_m, numpy_answers) = runs[True], runs[False]
    assert sum(answers) > 20 and not all(answers), "both paths ran"
    assert not any(numpy_answers)
    assert sum(shifts) > 10, "ids were read for the arrivals alone"
    assert log == numpy_log
    assert m.makespan_s == numpy_m.makespan_s and m.preemptions == numpy_m.preemptions > 0


def test_an_admission_order_that_does_not_compile_leaves_the_numpy_path(monkeypatch, caplog) -> None:
    """Where numba fails to compile the order, the policy is still built (logged once) and orders through numpy."""
    from policy.learned import shortest_first

    def broken(*args):
        raise TypeError("no such loop")

    monkeypatch.setattr(shortest_first, "_compiled", broken)
    monkeypatch.setattr(shortest_first, "_warm", False)
    with caplog.at_level("WARNING"):
        policy = LearnedPolicy({k: v.detach().numpy() for k, v in build_scorer().state_dict().items()}, Lengths())
    assert policy.table._shortest_first is None and "compiled admission order is off" in caplog.text
    assert shortest_first.compiled_shortest_first() is None  # (once: not tried again)
