"""``lrb-online``: LRU until it has learned, labels from the known past only, retraining cadence, safe failures.

The real-scheduler scenario: a hot 48-token prompt H recurs every round, beside
one-off prompts C and a 144-token filler that forces an eviction each round.
Then, on a fresh scheduler with the same policy, H then a new one-off C are
cached (3 blocks each, H the older) and a filler needs 3 cached blocks: LRU
evicts H, the trained policy evicts C.
"""

from __future__ import annotations

import math

import pytest

from data.records import tail_starts
from policy.baselines.lrb_online import OnlineLrbEvictionPolicy
from policy.catalog import create_policy
from policy.interface import CachedPrefix, Event, EventKind, OwnerState, RequestMeta
from predictors.online_reuse import ONLINE_REUSE_FEATURES, OnlineReuseLearner
from simulator import fake_runner
from tests.hooks import hook_scheduler as _hook
from tests.hooks import stock_scheduler as _stock

H = 10.0  # horizon (s) of the scenario; the fake clock moves 1 s per engine step


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _run(engine, s, runner, clock, rid, prompt, max_tokens=2, limit=50):
    s.add_request(engine.make_request(rid, prompt, max_tokens))
    for _ in range(limit):
        runner.step(s)
        clock.t += 1.0
        if not s.has_requests():
            return
    raise AssertionError(f"{rid} did not finish")


def _cached(engine, s, prompt):
    return s.kv_cache_manager.get_computed_blocks(engine.make_request("probe", prompt + [1], 1))[1]


def _learn(engine, policy, clock, rounds, hot=True):
    """Rounds of (H or a one-off), a one-off C and a filler F on 12 usable blocks: each F evicts.

    ``policy`` runs through the hook; ``None`` runs stock vLLM.
    """
    s = engine.make_scheduler(_hook(policy) if policy is not None else _stock(), num_blocks=13, max_num_seqs=4)
    if policy is not None:
        s.kvpilot_clock = clock
    runner = fake_runner.FakeRunner()
    hot_prompt = fake_runner.prompt_tokens("lo-hot", 48)
    for i in range(rounds):
        _run(engine, s, runner, clock, f"H{i}", hot_prompt if hot else fake_runner.prompt_tokens(f"lo-x{i}", 48))
        _run(engine, s, runner, clock, f"C{i}", fake_runner.prompt_tokens(f"lo-c{i}", 48))
        _run(engine, s, runner, clock, f"F{i}", fake_runner.prompt_tokens(f"lo-f{i}", 144))
    return s, hot_prompt


def _final(engine, cls, clock, hot_prompt):
    """H then a new one-off C cached (H older), 6 blocks empty; a 144-token filler needs 9: 3 cached go."""
    s = engine.make_scheduler(cls, num_blocks=13, max_num_seqs=4)
    if cls is not _stock():
        s.kvpilot_clock = clock
    runner = fake_runner.FakeRunner()
    c = fake_runner.prompt_tokens("lo-cnew", 48)
    _run(engine, s, runner, clock, "Hz", hot_prompt)
    _run(engine, s, runner, clock, "Cz", c)
    _run(engine, s, runner, clock, "Fz", fake_runner.prompt_tokens("lo-fz", 144), max_tokens=1)
    return s, {"H": _cached(engine, s, hot_prompt), "C": _cached(engine, s, c)}


def _policy(**kw):
    opts = dict(horizon_s=H, min_labels=24, retrain_every=24, samples_per_call=4, seed=0)
    opts.update(kw)
    return OnlineLrbEvictionPolicy(**opts)


@pytest.mark.vllm
def test_starts_as_lru_then_learns_to_keep_the_hot_prefix(vllm_engine):
    engine = vllm_engine
    clock = Clock()
    policy = _policy()

    # before any label: LRU (evict answers None), the cache as stock vLLM leaves it
    s, hot = _learn(engine, policy, clock, rounds=2)
    assert policy.learner.model is None and policy.lru_calls == s.kvpilot_stats.eviction_calls > 0
    assert s.kvpilot_stats.eviction_orders == 0 and not s.kvpilot_stats.fallbacks
    s_stock, _ = _learn(engine, None, Clock(), rounds=2)
    for p in (hot, fake_runner.prompt_tokens("lo-c1", 48), fake_runner.prompt_tokens("lo-f1", 144)):
        assert _cached(engine, s, p) == _cached(engine, s_stock, p)

    s, _ = _learn(engine, policy, clock, rounds=14)
    st = policy.learner.stats
    assert policy.learner.model is not None and st.retrains >= 1 and st.train_failures == 0
    assert 0 < st.positives < st.labels
    assert not s.kvpilot_stats.fallbacks

    _, lru = _final(engine, _stock(), Clock(), hot)
    assert lru == {"H": 0, "C": 48}  # LRU evicts the older, hot prefix
    s, learned = _final(engine, _hook(policy), clock, hot)
    assert learned == {"H": 48, "C": 0}  # the learned order evicts the never-reused one
    assert s.kvpilot_stats.eviction_orders == 1 and not s.kvpilot_stats.fallbacks


@pytest.mark.vllm
def test_labels_use_only_what_was_known_when_formed(vllm_engine):
    policy = _policy()
    _learn(vllm_engine, policy, Clock(), rounds=10)
    labelled = list(policy.learner.labelled)
    assert labelled and {y for _, _, y, _ in labelled} == {0.0, 1.0}
    for t, formed, y, use in labelled:
        assert formed >= t
        if y == 1.0:  # the use that made it positive happened after the snapshot, within H, and before the label
            assert t < use <= t + H and use <= formed
        else:  # a negative waits for the whole horizon to pass
            assert formed >= t + H and math.isnan(use)


@pytest.mark.vllm
def test_degenerate_window_falls_back_to_lru_and_is_counted(vllm_engine):
    """Nothing is ever reused: every label is 0, training cannot fit, the engine runs on with LRU."""
    engine = vllm_engine
    policy = _policy(min_labels=8, retrain_every=8)
    s, _ = _learn(engine, policy, Clock(), rounds=8, hot=False)
    st = policy.learner.stats
    assert st.labels >= 8 and st.positives == 0
    assert st.train_failures >= 1 and st.retrains == 0 and policy.learner.model is None
    assert "one class" in policy.learner.last_error
    assert policy.lru_calls == s.kvpilot_stats.eviction_calls and not s.kvpilot_stats.fallbacks
    s_stock, _ = _learn(engine, None, Clock(), rounds=8, hot=False)
    for i in range(8):
        p = fake_runner.prompt_tokens(f"lo-c{i}", 48)
        assert _cached(engine, s, p) == _cached(engine, s_stock, p)


# ------------------------------------------------------------------ the learner alone (no vLLM)


def _prefix(rid: str, lead: int, depth: int, freed: float) -> CachedPrefix:
    hashes = tuple(lead * 1000 + j for j in range(depth))
    return CachedPrefix(rid, rid, OwnerState.FINISHED, RequestMeta(), tuple(range(depth)), hashes, freed)


def _use(learner: OnlineReuseLearner, rid: str, t: float) -> None:
    learner.observe(Event(EventKind.SCHEDULED, t, rid, RequestMeta()))
    learner.observe(Event(EventKind.FINISHED, t + 0.5, rid, RequestMeta(), num_prompt_tokens=48, num_output_tokens=2))


def test_a_label_waits_for_the_use_to_be_learned():
    """A use scheduled within the horizon is unknown until its chain is offered; the label waits for it."""
    lr = OnlineReuseLearner(horizon_s=5.0, samples_per_call=1, min_labels=1, retrain_every=100)
    _use(lr, "a", 0.0)
    lr.observe_candidates([_prefix("a", 1, 3, 0.5)], [0], 1.0)  # snapshot of a at t=1
    lr.observe(Event(EventKind.SCHEDULED, 3.0, "b", RequestMeta()))  # b shares a's lead; still running at 10
    lr.observe_candidates([_prefix("z", 9, 1, 9.0)], [0], 10.0)
    assert lr.stats.labels == 0  # past the horizon, but b (scheduled by then) is not known yet: no negative
    lr.observe(Event(EventKind.FINISHED, 12.0, "b", RequestMeta()))
    lr.observe_candidates([_prefix("b", 1, 3, 12.0)], [0], 13.0)
    t, formed, y, use = lr.labelled[0]
    assert (t, formed, y, use) == (1.0, 13.0, 1.0, 3.0)


def test_retraining_follows_the_cadence():
    lr = OnlineReuseLearner(horizon_s=2.0, samples_per_call=4, min_labels=16, retrain_every=16, seed=1)
    at_last, history = 0, []
    for i in range(60):
        t = float(i)
        _use(lr, f"h{i}", t)  # the hot key recurs every second
        _use(lr, f"c{i}", t)
        lr.observe_candidates([_prefix(f"h{i}", 1, 4, t + 0.5), _prefix(f"c{i}", 100 + i, 4, t + 0.5)], [0, 0], t + 0.6)
        history.append((lr.stats.labels, lr.stats.retrains + lr.stats.train_failures))
    retrains = 0
    for labels, n in history:
        if n > retrains:  # retrained in this call: enough new labels had come
            assert labels - at_last >= 16 and labels >= 16
            at_last, retrains = labels, n
        else:
            assert labels - at_last < 16  # never skipped once due
    assert retrains >= 3 and lr.stats.train_failures == 0
    X = [lr.features(_prefix("q", 1, 4, 60.0), 0, 61.0), lr.features(_prefix("q2", 999, 4, 60.0), 0, 61.0)]
    assert len(X[0]) == len(ONLINE_REUSE_FEATURES)
    p_hot, p_cold = lr.model.predict(X)
    assert p_hot > 0.5 > p_cold


def test_records_stay_within_their_bounds_and_the_hot_key_is_kept():
    """A long run keeps at most max_requests per-request records and max_nodes nodes; the hot node (used in every
    call) survives every pruning, so the model still tells it from the cold ones."""
    lr = OnlineReuseLearner(horizon_s=2.0, samples_per_call=4, min_labels=16, retrain_every=16, seed=1,
                            max_requests=64, max_nodes=48)
    sizes = []
    for i in range(300):
        t = float(i)
        _use(lr, f"h{i}", t)
        _use(lr, f"c{i}", t)
        lr.observe_candidates([_prefix(f"h{i}", 1, 4, t + 0.5), _prefix(f"c{i}", 100 + i, 4, t + 0.5)], [0, 0], t + 0.6)
        sizes.append((len(lr._sched), len(lr._done), len(lr._known), len(lr._keys)))
    assert max(s[0] for s in sizes) <= 64 and max(s[1] for s in sizes) <= 64 and max(s[2] for s in sizes) <= 64
    assert max(s[3] for s in sizes) <= 48
    assert min(s[3] for s in sizes[100:]) < max(s[3] for s in sizes[100:])  # it was pruned, more than once
    hot = lr._keys.get(1000)  # the hot chains' leading block (_prefix: lead * 1000)
    assert hot is not None and hot.hits > 100
    p_hot, p_cold = lr.model.predict([lr.features(_prefix("q", 1, 4, 300.0), 0, 301.0),
                                      lr.features(_prefix("q2", 9999, 4, 300.0), 0, 301.0)])
    assert p_hot > 0.5 > p_cold
    with pytest.raises(ValueError, match="max_nodes"):
        OnlineReuseLearner(max_nodes=0)
    burst = OnlineReuseLearner(max_requests=8, max_nodes=4)  # one call over the bounds, every use at one time
    for i in range(10):
        _use(burst, f"b{i}", 0.0)
    burst.observe_candidates([_prefix(f"b{i}", 10 + i, 1, 0.5) for i in range(10)], [0] * 10, 1.0)
    assert len(burst._keys) == 2 and len(burst._sched) == len(burst._done) == len(burst._known) == 4
    assert list(burst._sched) == ["b6", "b7", "b8", "b9"]  # the requests seen last


def test_registered_with_options():
    p = create_policy("lrb-online", horizon_s=5.0, window=100, max_nodes=1000)
    assert isinstance(p, OnlineLrbEvictionPolicy) and p.learner.horizon_s == 5.0 and p.learner.window.maxlen == 100
    assert p.learner.max_nodes == 1000 and p.learner.max_requests == 200_000
    with pytest.raises(ValueError, match="retrain_every"):
        create_policy("lrb-online", retrain_every=0)


def test_a_tail_is_used_only_by_a_chain_that_reaches_it():
    """a's first 8 blocks are shared with another candidate: its tail starts at block 8, keyed by that block.

    A later request sharing a's first 4 blocks only does not make the snapshot positive; one through block 8 does.
    """
    lr = OnlineReuseLearner(horizon_s=5.0, samples_per_call=2, chain_stride=4)
    _use(lr, "a", 0.0)
    _use(lr, "o", 0.0)
    other = CachedPrefix("o", "o", OwnerState.FINISHED, RequestMeta(), tuple(range(8)), tuple(range(1000, 1008)), 0.5)
    a = _prefix("a", 1, 12, 0.5)  # 1000..1011
    tails = tail_starts([a, other])
    assert tails == [8, 8]
    lr.observe_candidates([a, other], tails, 1.0)
    assert lr.node(a.block_hashes, 8) == 1008 and lr.node(a.block_hashes, 5) == 1008
    _use(lr, "b", 2.0)
    lr.observe_candidates([_prefix("b", 1, 4, 2.5)], [0], 3.0)  # 1000..1003: not through 1008
    assert lr.stats.labels == 0
    _use(lr, "c", 4.0)
    lr.observe_candidates([_prefix("c", 1, 10, 4.5)], [0], 5.0)  # 1000..1009: through 1008
    assert [lab for lab in lr.labelled if lab[0] == 1.0] == [(1.0, 5.0, 1.0, 4.0)]


def test_background_fit_is_swapped_in_at_a_later_call():
    """With ``background=True`` the call that starts a fit returns without a model; a later call adopts it."""
    lr = OnlineReuseLearner(horizon_s=2.0, samples_per_call=4, min_labels=16, retrain_every=16, seed=1,
                            background=True)
    started = None
    for i in range(60):
        t = float(i)
        _use(lr, f"h{i}", t)
        _use(lr, f"c{i}", t)
        lr.observe_candidates([_prefix(f"h{i}", 1, 4, t + 0.5), _prefix(f"c{i}", 100 + i, 4, t + 0.5)], [0, 0], t + 0.6)
        if started is None and lr._training is not None:
            started = i
            assert lr.model is None and lr.stats.retrains == 0  # fitting off this thread
            lr._training.result()  # let it finish: the next call swaps it in
        elif started is not None and i == started + 1:
            assert lr.model is not None and lr.stats.retrains == 1
    lr.wait()
    assert started is not None and lr.model is not None and lr.stats.retrains >= 2 and lr.stats.train_failures == 0
    p_hot, p_cold = lr.model.predict([lr.features(_prefix("q", 1, 4, 60.0), 0, 61.0),
                                      lr.features(_prefix("q2", 999, 4, 60.0), 0, 61.0)])
    assert p_hot > 0.5 > p_cold
