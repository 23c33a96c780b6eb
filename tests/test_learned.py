"""The learned policy: numpy and torch scorers agree, POLICY_DIR round trip and load errors, precedence of the
preempted and the starved."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from policy.interface import CandidateRequest, EngineState, Event, EventKind, RequestMeta, RequestStatus
from policy.learned.bundle import PolicyLoadError
from policy.learned.features import FEATURES
from policy.learned.policy import LearnedPolicy
from policy.learned.scorer import ADMIT, PREEMPT, NumpyScorer, build_scorer


def _state(step: int = 1, t: float = 0.0) -> EngineState:
    return EngineState(time_s=t, engine_step=step, num_running=2, num_waiting=5, num_free_blocks=100,
                       num_total_blocks=1000, num_pinned_blocks=0, kv_usage=0.9, block_size=16,
                       max_num_running=8, max_num_batched_tokens=8192)


def _cand(i: int, prompt: int = 100, max_tokens: int = 4000, status=RequestStatus.WAITING) -> CandidateRequest:
    return CandidateRequest(request_id=f"r{i}", meta=RequestMeta(domain="math", step=0, group_id=f"g{i}",
                                                                group_size=4, session_id=f"s{i}", turn=0),
                            status=status, prompt_token_ids=(), num_prompt_tokens=prompt, num_cached_tokens=0,
                            num_computed_tokens=0, num_output_tokens=0, max_tokens=max_tokens, arrival_s=0.0,
                            wait_s=0.0)


class FixedLengths:
    """A length predictor answering each request's p50 from a table (p90 = 1.5 p50)."""

    def __init__(self, lengths: dict[str, float]) -> None:
        self.lengths = lengths

    def predict(self, cands):
        return [(self.lengths[c.request_id], 1.5 * self.lengths[c.request_id]) for c in cands]

    def observe(self, event):
        return None


def _state_dict(seed: int = 0, remaining_weight: float | None = None) -> dict:
    """A scorer's weights: random, or (``remaining_weight``) admission score = w * standardised log remaining."""
    import torch

    torch.manual_seed(seed)
    s = build_scorer(len(FEATURES), (8,))
    if remaining_weight is not None:
        with torch.no_grad():
            for p in s.parameters():
                p.zero_()
            j = FEATURES.index("log_pred_remaining")
            s.net[0].weight[0, j] = 1.0
            s.net[0].bias[0] = 50.0  # keep the ReLU on
            s.net[2].weight[ADMIT, 0] = remaining_weight
            s.net[2].weight[PREEMPT, 0] = remaining_weight
    return {k: v.detach().numpy() for k, v in s.state_dict().items()}


def test_numpy_scorer_matches_torch() -> None:
    import torch

    torch.manual_seed(3)
    s = build_scorer(len(FEATURES), (16, 8))
    with torch.no_grad():
        s.mean.normal_()
        s.scale.uniform_(0.5, 2.0)
    x = np.random.default_rng(0).normal(size=(257, len(FEATURES))).astype(np.float32)
    with torch.no_grad():
        want = s(torch.from_numpy(x)).numpy()
    got = NumpyScorer(s.state_dict())(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hidden", [(16, 8), (8,), ()])
def test_numpy_scorer_head_matches_torch_with_the_first_layer_kept(hidden) -> None:
    """``NumpyScorer.head`` (one head; with ``kept``, the first layer's non-step part kept per input array) gives
    the torch scores while only the step columns of the same array change, and recomputes for a new array."""
    import torch

    from policy.learned.features import STEP_X

    torch.manual_seed(4)
    s = build_scorer(len(FEATURES), hidden)
    with torch.no_grad():
        s.mean.uniform_(0.0, 10.0)
        s.scale.uniform_(0.5, 3.0)
    scorer = NumpyScorer(s.state_dict())
    rng = np.random.default_rng(1)
    step = list(STEP_X)
    for n in (1, 9, 600):  # 600: more rows than one product block
        x = (rng.random((n, len(FEATURES))) * 20).astype(np.float32)
        for _ in range(3):
            x[:, step] = rng.random((n, len(step))) * 20  # in place: what the feature table does per step
            with torch.no_grad():
                want = s(torch.from_numpy(x)).numpy().astype(np.float64)
            for head in (ADMIT, PREEMPT):
                for kept in (True, False):
                    got = scorer.head(x, head, kept=kept)
                    assert got.dtype == np.float64 and got.shape == (n,)
                    np.testing.assert_allclose(got, want[:, head], rtol=1e-5, atol=1e-5)


def test_admission_scores_are_reused_while_the_step_columns_move_less_than_the_tolerance() -> None:
    import dataclasses

    lengths = {f"r{i}": 100.0 * (i + 1) for i in range(4)}
    waiting = [_cand(i) for i in range(4)]
    for c in waiting:
        c.arrival_s = 0.0
    waiting[2].arrival_s = 9.0  # the youngest: its wait moves fastest
    lazy = LearnedPolicy(_state_dict(5), FixedLengths(lengths), rescore_tol=0.01)
    exact = LearnedPolicy(_state_dict(5), FixedLengths(lengths), rescore_tol=0.0)
    for p in (lazy, exact):  # an event: from now on the table's rows change only on events
        p.on_event(Event(EventKind.ARRIVED, 0.0, "r9", waiting[0].meta))

    def scores(p: LearnedPolicy, state: EngineState) -> np.ndarray:
        return p.scores(waiting, state, ADMIT)[0]

    first = scores(lazy, _state(1, 10.0))
    # the youngest wait goes 1.000 s -> 1.005 s: log1p moves by 0.0025 (the scale is 1)
    again = scores(lazy, _state(2, 10.005))
    assert again is first and (lazy.computed, lazy.reused) == (1, 1)
    assert np.abs(again - scores(exact, _state(2, 10.005))).max() > 0  # stale, by design
    # 1.000 s -> 1.05 s moves it by 0.024: computed, equal to the exact policy's
    got = scores(lazy, _state(3, 10.05))
    assert got is not first and lazy.computed == 2
    np.testing.assert_allclose(got, scores(exact, _state(3, 10.05)))
    # one more running request moves log1p(num_running) by 0.29: computed
    busier = dataclasses.replace(_state(4, 10.05), num_running=3)
    assert scores(lazy, busier) is not got and lazy.computed == 3
    np.testing.assert_allclose(scores(lazy, busier), scores(exact, busier))
    # an event (a candidate scheduled) refreshes the rows: computed
    same = scores(lazy, busier)
    lazy.on_event(Event(EventKind.SCHEDULED, 10.0, "r0", waiting[0].meta))
    assert scores(lazy, busier) is not same
    assert exact.reused == 0
    with pytest.raises(ValueError, match="rescore_tol"):
        LearnedPolicy(_state_dict(5), FixedLengths(lengths), rescore_tol=-1.0)


def test_serve_mode_ranks_by_score_and_preempts_the_top() -> None:
    lengths = {f"r{i}": 100.0 * (i + 1) for i in range(6)}
    pol = LearnedPolicy(_state_dict(remaining_weight=1.0), FixedLengths(lengths), admission="scorer")
    waiting = [_cand(i) for i in range(6)]
    dec = pol.admit(waiting, _state())
    assert list(dec.order)[:6] == [f"r{i}" for i in range(5, -1, -1)]  # longest predicted first
    log = LearnedPolicy(_state_dict(remaining_weight=1.0), FixedLengths(lengths), admission="scorer", mode="log")
    assert dec.predictions is None  # serving logs no features
    logged = log.admit(waiting, _state())
    assert logged.predictions["r0"] == {"len_p50": 100.0, "len_p90": 150.0}  # logged with the decision
    running = [_cand(i, status=RequestStatus.RUNNING) for i in range(6)]
    assert pol.preempt(running, _state()).victim == "r5"
    assert LearnedPolicy(_state_dict(remaining_weight=-1.0), FixedLengths(lengths)).preempt(
        running, _state()).victim == "r0"


def test_starvation_bound_in_steps_and_seconds() -> None:
    lengths = {f"r{i}": 100.0 * (i + 1) for i in range(4)}
    for kw, clock in (({"max_wait_steps": 3, "max_wait_s": None}, lambda k: (k, 0.0)),
                      ({"max_wait_steps": None, "max_wait_s": 3.0}, lambda k: (1, float(k)))):
        pol = LearnedPolicy(_state_dict(remaining_weight=1.0), FixedLengths(lengths), admission="scorer", **kw)
        waiting = [_cand(i) for i in range(4)]
        firsts = []
        for k in range(1, 7):
            step, t = clock(k)
            firsts.append(pol.admit(waiting, _state(step, t)).order[0])
        # r3 (longest) goes first until the bound; then the starved go first, FCFS by when they were first seen
        assert firsts[:3] == ["r3", "r3", "r3"], kw
        assert firsts[3] == "r0", kw
        # a scheduled request leaves the starvation clock
        pol.on_event(Event(EventKind.SCHEDULED, 0.0, "r0", waiting[0].meta))
        rest = [c for c in waiting if c.request_id != "r0"]
        assert pol.admit(rest, _state(*clock(7))).order[0] == "r1", kw


def test_a_preempted_request_goes_back_first_then_the_starved() -> None:
    """vLLM's precedence: a preempted request resumes before the scored order (unless switched off)."""
    lengths = {f"r{i}": 100.0 * (i + 1) for i in range(4)}

    def preempted(c: CandidateRequest) -> CandidateRequest:
        c.status, c.num_preemptions, c.num_output_tokens = RequestStatus.PREEMPTED, 1, 50
        return c

    for mode in ("serve", "log"):
        pol = LearnedPolicy(_state_dict(remaining_weight=1.0), FixedLengths(lengths), admission="scorer", mode=mode,
                            epsilon=0.0, max_wait_steps=None, max_wait_s=3.0)
        waiting = [_cand(i) for i in range(4)]
        first = pol.admit(waiting, _state(1, 0.0))
        assert first.order[0] == "r3"  # the longest predicted, by score
        assert mode == "serve" or first.propensity < 1.0
        # r3 and r1 run; r1 is preempted and comes back to the queue
        for c in (waiting[3], waiting[1]):
            pol.on_event(Event(EventKind.SCHEDULED, 0.5, c.request_id, c.meta))
        pol.on_event(Event(EventKind.PREEMPTED, 1.0, "r1", waiting[1].meta))
        queue = [waiting[0], preempted(waiting[1]), waiting[2]]
        dec = pol.admit(queue, _state(2, 1.0))
        assert dec.order[:3] == ["r1", "r2", "r0"], mode  # r1 first; then by score
        assert mode == "serve" or dec.propensity == 1.0  # deterministic, so logged as such
        # r0 starves (3 s since first seen): after the preempted request, before the scored rest
        assert pol.admit(queue, _state(3, 3.5)).order[:3] == ["r1", "r0", "r2"], mode
    off = LearnedPolicy(_state_dict(remaining_weight=1.0), FixedLengths(lengths), admission="scorer",
                        resume_preempted=False)
    waiting = [_cand(i) for i in range(4)]
    off.admit(waiting, _state(1, 0.0))
    off.on_event(Event(EventKind.PREEMPTED, 1.0, "r1", waiting[1].meta))
    assert off.admit([waiting[0], preempted(waiting[1]), waiting[2]], _state(2, 1.0)).order[0] == "r2"


def _async_cand(i: int, group: str, version: int | None) -> CandidateRequest:
    c = _cand(i)
    return dataclasses.replace(c, meta=dataclasses.replace(c.meta, group_id=group, weight_version=version))


def test_under_async_rl_the_oldest_group_is_admitted_first_and_its_contexts_kept() -> None:
    """Where requests carry weight versions (asynchronous RL), the group that started first goes first (shortest
    within it), and the youngest group's cached contexts leave first, on the CPU tier and, with ``gpu_eviction``
    "async", on the GPU; without weight versions the order is shortest first and the GPU stays vLLM's LRU."""
    from policy.interface import CachedPrefix, OwnerState

    lengths = {f"r{i}": 100.0 * (i + 1) for i in range(6)}
    pol = LearnedPolicy(_state_dict(remaining_weight=1.0), FixedLengths(lengths), offload=True,
                        gpu_eviction="async", reuse=StubNextUse({"old": 10.0, "young": 500.0, "mid": 50.0}))
    assert pol.uses_eviction and pol.uses_host_eviction
    sync_lengths = FixedLengths({f"r{i}": 100.0 * (i + 1) for i in range(6)})
    sync_pol = LearnedPolicy(_state_dict(remaining_weight=1.0), sync_lengths, offload=True, gpu_eviction="async",
                             reuse=StubNextUse({"old": 10.0}))
    sync = [_async_cand(i, g, None) for i, g in ((4, "g-a"), (0, "g-b"), (2, "g-a"))]
    assert list(sync_pol.admit(sync, _state()).order) == ["r0", "r2", "r4"]  # no weight versions: shortest first

    def cached(pid: str, group: str) -> CachedPrefix:
        return CachedPrefix(prefix_id=pid, owner_request_id=pid, owner_state=OwnerState.PAUSED_TOOL,
                            meta=RequestMeta(group_id=group, weight_version=None), block_ids=(1,), block_hashes=(1,),
                            last_used_s=0.0)

    # "async": vLLM's LRU without weight versions
    assert sync_pol.evict([cached("old", "g-a")], 1, _state()) is None
    assert pol.evict([cached("old", "g-a")], 1, _state()) is None  # (nor any request seen yet)
    first = [_async_cand(5, "g-old", 0), _async_cand(3, "g-old", 0)]  # the first group seen
    pol.admit(first, _state(2))
    later = [_async_cand(1, "g-mid", 0), _async_cand(0, "g-young", 1), _async_cand(5, "g-old", 0),
             _async_cand(3, "g-old", 0)]  # (groups are first seen in the order they start)
    assert list(pol.admit(later, _state(3)).order) == ["r3", "r5", "r1", "r0"]
    prefixes = []
    for pid, group in (("old", "g-old"), ("young", "g-young"), ("mid", "g-mid")):
        p = cached(pid, group)
        prefixes.append(dataclasses.replace(p, meta=dataclasses.replace(p.meta, weight_version=0)))
    # the youngest group's first, whatever the predicted next uses
    assert list(pol.evict_host(prefixes, 1, _state(3)).order) == ["young", "mid", "old"]
    pol.reuse = StubNextUse({"old": 900.0, "young": 1.0, "mid": 50.0})
    assert list(pol.evict(prefixes, 1, _state(3)).order) == ["young", "mid", "old"]
    off = LearnedPolicy(_state_dict(remaining_weight=1.0), FixedLengths(lengths), group_age=False)
    assert list(off.admit(later, _state(3)).order) == ["r0", "r1", "r3", "r5"]
    with pytest.raises(ValueError, match='gpu_eviction must be true, false or "async"'):
        LearnedPolicy(_state_dict(), FixedLengths(lengths), gpu_eviction="yes")


def test_a_groups_age_counts_from_its_arrival_and_ends_with_its_rows() -> None:
    """A group is ranked when its first request arrives (the ARRIVED event), offered or not; siblings with the same
    prediction keep the queue's order; once every versioned request has finished, ``gpu_eviction`` "async" is
    vLLM's LRU again."""
    from policy.interface import CachedPrefix, OwnerState

    lengths = {f"r{i}": 100.0 for i in range(6)}
    pol = LearnedPolicy(_state_dict(remaining_weight=1.0), FixedLengths(lengths), gpu_eviction="async",
                        reuse=StubNextUse({"p": 10.0}))
    early = _async_cand(4, "g-early", 0)
    pol.on_event(Event(EventKind.ARRIVED, 0.0, "r4", early.meta))  # arrived, never offered (e.g. a fallback step)
    later = [_async_cand(i, "g-late", 0) for i in (2, 0, 1)] + [early]
    assert list(pol.admit(later, _state(1)).order) == ["r4", "r2", "r0", "r1"]  # equal predictions: queue order
    cached = CachedPrefix(prefix_id="p", owner_request_id="p", owner_state=OwnerState.PAUSED_TOOL,
                          meta=RequestMeta(group_id="g-late", weight_version=0), block_ids=(1,), block_hashes=(1,),
                          last_used_s=0.0)
    assert pol.evict([cached], 1, _state(1)) is not None  # versioned rows live: ordered
    for c in later:
        pol.on_event(Event(EventKind.FINISHED, 1.0, c.request_id, c.meta, finish_reason="stop"))
    assert not pol.table.aged and pol.evict([cached], 1, _state(2)) is None  # none left: vLLM's LRU


class StubNextUse:
    """A reuse predictor answering each prefix's next use from a table."""

    def __init__(self, next_use: dict[str, float]) -> None:
        self.next_use = next_use

    def next_use_s(self, prefixes, now):
        return [self.next_use[p.prefix_id] for p in prefixes]


def test_shortest_admission_orders_by_predicted_remaining_whatever_the_scores() -> None:
    """``admission="shortest"`` (the default): the length model's predicted remaining output, shortest first, after the
    preempted (the same precedence as the scorer's order); the scorer would have put the longest first."""
    lengths = {f"r{i}": 100.0 * (i + 1) for i in range(5)}
    waiting = [_cand(i) for i in (3, 0, 4, 1, 2)]
    pol = LearnedPolicy(_state_dict(remaining_weight=1.0), FixedLengths(lengths))
    assert pol.admission == "shortest"  # the default
    assert list(pol.admit(waiting, _state()).order) == ["r0", "r1", "r2", "r3", "r4"]
    assert list(LearnedPolicy(_state_dict(remaining_weight=1.0), FixedLengths(lengths), admission="scorer").admit(
        waiting, _state()).order)[0] == "r4"
    waiting[0].status, waiting[0].num_preemptions = RequestStatus.PREEMPTED, 1  # r3, preempted: it goes first
    pol.on_event(Event(EventKind.PREEMPTED, 1.0, "r3", waiting[0].meta))
    assert list(pol.admit(waiting, _state(2, 1.0)).order)[:2] == ["r3", "r0"]
    with pytest.raises(ValueError, match="option admission must be one of scorer, shortest"):
        LearnedPolicy(_state_dict(), FixedLengths(lengths), admission="lpt")


def test_the_trained_admission_residual_moves_the_prior_order() -> None:
    """``admission_residual``: the prior's key (shortest predicted remaining first) plus trained weights on the
    standardised features and on the scorer's admission head. Empty or zero it is the prior's order exactly; with
    weight on the group's progress, or on a scorer that ranks longest first, the network reorders the queue."""
    lengths = {f"r{i}": 100.0 * (i + 1) for i in range(5)}
    waiting = [_cand(i) for i in (3, 0, 4, 1, 2)]
    waiting[4].group_finished = 3  # r2: three of its group of four finished (the hook counts them)
    prior = ["r0", "r1", "r2", "r3", "r4"]

    def order(residual: dict, state: dict | None = None) -> list[str]:
        pol = LearnedPolicy(state or _state_dict(remaining_weight=1.0), FixedLengths(lengths),
                            admission_residual=residual)
        return list(pol.admit(waiting, _state()).order)

    assert order({}) == order({"turn": 0.0, "scorer": 0.0}) == prior
    assert order({"scorer": 50.0})[0] == "r4"  # the scorer's head ranks the longest first: it now leads
    assert order({"scorer": -50.0}) == prior  # against the head: shortest first still
    by_group = order({"group_done_frac": 50.0})
    assert by_group[0] == "r2" and by_group[1:] == ["r0", "r1", "r3", "r4"], by_group
    for bad, why in (({"nope": 1.0}, "unknown input 'nope'"), ({"turn": float("nan")}, "finite number"),
                     ([1.0], "must map feature names")):
        with pytest.raises(ValueError, match=why):
            LearnedPolicy(_state_dict(), FixedLengths(lengths), admission_residual=bad)
    with pytest.raises(ValueError, match="needs admission"):
        LearnedPolicy(_state_dict(), FixedLengths(lengths), admission="scorer", admission_residual={"turn": 1.0})
    from policy.catalog import LEARNED_ABLATIONS
    from policy.learned.policy import ABLATIONS

    assert LEARNED_ABLATIONS == tuple(ABLATIONS)  # the catalog lists every ablation the policy defines


# ------------------------------------------------------------------------------------ POLICY_DIR


@pytest.fixture(scope="module")
def predictors_dir(tmp_path_factory) -> Path:
    """A length model trained on a tiny workload's true lengths (no simulation needed)."""
    from data.io import write_workload
    from predictors.logs import load_logs
    from predictors.pipeline import train_bundle
    from tests.learned_logs import tiny_workload

    d = tmp_path_factory.mktemp("pred")
    write_workload(tiny_workload(5), d / "w.parquet")
    bundle = train_bundle(load_logs([d / "w.parquet"]), num_trees=10, reuse=False)
    return bundle.save(d / "model")


@pytest.fixture()
def policy_dir(tmp_path: Path, predictors_dir: Path) -> Path:
    from predictors.length import LengthModel

    pol = LearnedPolicy(_state_dict(7), LengthModel.load(predictors_dir / "length"), predictors_dir=predictors_dir,
                        manifest={"config": {"runtime": {"epsilon": 0.2}}, "trained_on": {"logs": ["x"]}})
    return pol.save(tmp_path / "pol")


def test_a_save_cut_short_over_a_policy_dir_leaves_one_that_refuses_to_load(policy_dir: Path, predictors_dir: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Saving over an existing POLICY_DIR: a write cut short after the new weights never loads as the old manifest
    over them."""
    import shutil

    from policy.learned.bundle import PolicyLoadError

    pol = LearnedPolicy.load(policy_dir)
    pol.predictors_dir = predictors_dir  # (copied into the folder again: the step that fails below)

    def cut(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(shutil, "copytree", cut)
    with pytest.raises(OSError, match="disk full"):
        pol.save(policy_dir)
    with pytest.raises(PolicyLoadError, match="policy.json: missing"):
        LearnedPolicy.load(policy_dir)
    monkeypatch.undo()
    assert LearnedPolicy.load(pol.save(policy_dir)).epsilon == 0.2  # a full save restores it


def test_save_load_round_trip(policy_dir: Path) -> None:
    m = json.loads((policy_dir / "policy.json").read_text())
    assert m["format"] == "kvpilot-policy" and m["format_version"] == 1 and m["policy"] == "learned"
    assert m["feature_schema"]["features"] == list(FEATURES)
    assert (policy_dir / "predictors" / "length").is_dir()
    a = LearnedPolicy.load(policy_dir)
    b = LearnedPolicy.load(policy_dir, mode="log")
    assert a.epsilon == 0.2 and b.mode == "log"
    assert not a.uses_preemption  # vLLM's victim by default
    with_head = LearnedPolicy.load(a.save(policy_dir.parent / "head"), preempt=True)
    assert with_head.uses_preemption
    assert LearnedPolicy.load(with_head.save(policy_dir.parent / "head2")).uses_preemption  # saved with the option
    assert not a.uses_offload  # no CPU offload tier by default
    tier = LearnedPolicy.load(a.save(policy_dir.parent / "tier"), offload=True)
    assert tier.uses_offload and LearnedPolicy.load(tier.save(policy_dir.parent / "tier2")).uses_offload
    x = np.random.default_rng(1).normal(size=(10, len(FEATURES))).astype(np.float32)
    np.testing.assert_allclose(a.scorer(x), NumpyScorer(_state_dict(7))(x), rtol=1e-6)
    waiting = [_cand(i, prompt=50 * (i + 1)) for i in range(5)]
    assert a.admit(waiting, _state()).order == LearnedPolicy.load(policy_dir).admit(waiting, _state()).order
    again = a.save(policy_dir.parent / "again")  # a loaded policy saves a complete POLICY_DIR
    assert LearnedPolicy.load(again).admit(waiting, _state()).order == a.admit(waiting, _state()).order


def test_the_host_tier_reuse_predictor_is_the_session_state_by_default_or_online_or_trained(
        policy_dir: Path, tmp_path: Path, predictors_dir: Path) -> None:
    from policy.predictors import OnlineNextUse
    from policy.session_reuse import SessionStateNextUse
    from predictors.features import prepare_requests
    from predictors.reuse import ReuseModel
    from tests.test_predictors_features import fake_telemetry, small_workload

    tier = LearnedPolicy.load(policy_dir, offload=True)
    assert tier.uses_host_eviction and isinstance(tier.reuse, SessionStateNextUse)
    assert isinstance(LearnedPolicy.load(policy_dir, offload=True, reuse_predictor="online").reuse, OnlineNextUse)
    # "trained" with no reuse model in the bundle: vLLM's LRU in the tier
    assert not LearnedPolicy.load(policy_dir, offload=True, reuse_predictor="trained").uses_host_eviction
    w = small_workload(steps=2, prompts=4)
    ReuseModel.fit(prepare_requests(fake_telemetry(w), w), num_trees=5).save(policy_dir / "predictors" / "reuse")
    trained = LearnedPolicy.load(policy_dir, offload=True, reuse_predictor="trained")
    assert isinstance(trained.reuse, ReuseModel)
    with pytest.raises(PolicyLoadError, match="reuse_predictor must be one of session-state, session-trained, online"):
        LearnedPolicy.load(policy_dir, offload=True, reuse_predictor="oracle")
    # "session-trained" needs the tier model `kvpilot train` fits: a bundle without one says so
    with pytest.raises(PolicyLoadError, match="tier_reuse: missing"):
        LearnedPolicy.load(policy_dir, offload=True, reuse_predictor="session-trained")


def test_gpu_eviction_orders_the_gpu_by_the_same_reuse_predictor(policy_dir: Path) -> None:
    """``gpu_eviction``: the GPU's cached prefixes leave furthest predicted next use first (ties: vLLM's LRU order),
    with or without the tier, from the one reuse model the tier uses; off by default (vLLM's LRU)."""
    from policy.session_reuse import SessionStateNextUse
    from tests.test_baselines_retention import INF, StubReuse, engine_state, prefix

    assert not LearnedPolicy.load(policy_dir, offload=True).uses_eviction
    gpu = LearnedPolicy.load(policy_dir, gpu_eviction=True)
    assert gpu.uses_eviction and not gpu.uses_host_eviction and isinstance(gpu.reuse, SessionStateNextUse)
    both = LearnedPolicy.load(policy_dir, gpu_eviction=True, offload=True)
    assert both.uses_eviction and both.uses_host_eviction
    gpu.reuse = StubReuse({"a": 1005.0, "b": INF, "c": 1100.0, "d": 1005.0})
    ps = [prefix("a", last_used=3), prefix("b", last_used=4), prefix("c", last_used=1), prefix("d", last_used=2)]
    assert list(gpu.evict(ps, 4, engine_state()).order) == ["b", "c", "d", "a"]
    assert gpu.evict([], 4, engine_state()) is None


def test_registry_builds_learned_and_logging(policy_dir: Path) -> None:
    from policy.catalog import create_policy

    assert isinstance(create_policy("learned", model=str(policy_dir)), LearnedPolicy)
    assert create_policy("logging").name == "logging"
    # the exploring policy logs over the CPU tier by default (the plain recipe trains a policy over it)
    assert create_policy("logging").uses_offload and not create_policy("logging", offload=False).uses_offload
    with pytest.raises(ValueError, match="model=POLICY_DIR"):
        create_policy("learned")


def _break(policy_dir: Path, what: str) -> str:
    """Damage ``policy_dir``; returns the file the error must name."""
    man = policy_dir / "policy.json"
    if what == "missing manifest":
        man.unlink()
        return "policy.json"
    if what == "corrupt manifest":
        man.write_text("{not json")
        return "policy.json"
    if what in ("schema version", "feature schema", "format version"):
        m = json.loads(man.read_text())
        if what == "schema version":
            m["telemetry_schema_version"] = -1
        elif what == "format version":
            m["format_version"] = 99
        else:
            m["feature_schema"]["features"] = m["feature_schema"]["features"][:-1]
        man.write_text(json.dumps(m))
        return "policy.json"
    if what == "missing weights":
        (policy_dir / "policy.pt").unlink()
        return "policy.pt"
    if what == "corrupt weights":
        (policy_dir / "policy.pt").write_bytes(b"garbage")
        return "policy.pt"
    if what == "wrong weights":
        import torch

        sd = torch.load(policy_dir / "policy.pt", weights_only=True)
        sd["net.0.weight"] = sd["net.0.weight"][:, :-1]
        torch.save(sd, policy_dir / "policy.pt")
        return "policy.pt"
    if what == "missing predictors":
        shutil.rmtree(policy_dir / "predictors")
        return "length"
    if what == "predictor schema":
        f = policy_dir / "predictors" / "length" / "manifest.json"
        m = json.loads(f.read_text())
        m["features"] = ["x"]
        f.write_text(json.dumps(m))
        return "length"
    raise AssertionError(what)


@pytest.mark.parametrize("what", ["missing manifest", "corrupt manifest", "schema version", "format version",
                                  "feature schema", "missing weights", "corrupt weights", "wrong weights",
                                  "missing predictors", "predictor schema"])
def test_load_fails_loudly_naming_the_file(policy_dir: Path, what: str) -> None:
    name = _break(policy_dir, what)
    with pytest.raises(PolicyLoadError, match=name):
        LearnedPolicy.load(policy_dir)


def test_the_width_holds_under_async_rl_and_its_sessions_survive_a_hot_swap() -> None:
    """Under asynchronous RL the learned policy's admission holds the younger group's turns that do not fit
    (policy.group_width.WidthHolds); a successor taking its state holds the same; ``width=False`` holds none."""
    def event(kind: str, rid: str, group: str, prompt: int = 0, output: int = 0, reason: str | None = None) -> Event:
        meta = RequestMeta(group_id=group, session_id=rid[:2], weight_version=0)
        return Event(EventKind(kind), 0.0, rid, meta, num_prompt_tokens=prompt, num_output_tokens=output,
                     finish_reason=reason)

    lengths = {f"{s}-t{k}": 50.0 for s in ("a0", "a1", "b0", "b1") for k in (0, 1)}
    pols = [LearnedPolicy(_state_dict(), FixedLengths(lengths), width=w) for w in (True, False)]
    for pol in pols:
        for rid in ("a0-t0", "a1-t0", "b0-t0", "b1-t0"):
            pol.on_event(event("arrived", rid, rid[0], prompt=200))
            pol.on_event(event("scheduled", rid, rid[0]))
            pol.on_event(event("finished", rid, rid[0], prompt=200, output=100, reason="tool_call"))
        for rid in ("b0-t1", "a0-t1", "a1-t1", "b1-t1"):
            pol.on_event(event("arrived", rid, rid[0], prompt=350))
    waiting = [dataclasses.replace(_cand(0), request_id=rid, meta=RequestMeta(group_id=rid[0], session_id=rid[:2],
                                                                               weight_version=0))
               for rid in ("b0-t1", "a0-t1", "a1-t1", "b1-t1")]
    state = dataclasses.replace(_state(), num_total_blocks=64, block_size=16)  # 1,024 tokens: 1,400 in flight
    on, off = (pol.admit(waiting, state) for pol in pols)
    assert set(on.hold) == {"b0-t1", "b1-t1"} and not off.hold
    successor = LearnedPolicy(_state_dict(), FixedLengths(lengths), width=True)
    successor.import_state(pols[0].export_state())
    assert set(successor.admit(waiting, state).hold) == {"b0-t1", "b1-t1"}
