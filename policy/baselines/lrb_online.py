"""Learned sampled eviction that trains itself online from the run's own past, after LRB.

**Idea and source.** LRB (Learning Relaxed Belady, NSDI'20) keeps a sliding
window of recent requests, labels each sampled object with its time to next
request once it is known, retrains a GBDT on recency and frequency features
periodically, and at eviction time scores a random sample of cached objects
and evicts the one predicted furthest. It needs no prior training data.

**Mechanism as implemented.** :class:`predictors.online_reuse.OnlineReuseLearner`
learns, from the eviction lever's candidates and the hook's events only,
P(a prefix's *tail* is used again within ``horizon_s``); the tail is what the
lever moves: the blocks past those the prefix shares with other candidates
(:func:`data.records.tail_starts`). See the learner for the
objects, labels (never from the future), features and retraining. Until its
first model (``min_labels`` labels of both classes), and whenever a
retraining has never succeeded, ``evict()`` answers ``None``: vLLM's LRU.
With a model, it draws ``sample_size`` candidates among those with a tail (as
the ``lrb`` baseline does), scores them in one batched LightGBM call, and
lists the least likely to be reused first until their tails cover
``cover_blocks`` (default: what one engine step can allocate,
``max_num_batched_tokens / block_size``, since the order holds for the whole
step; at least the allocation that triggered the call); the rest keep LRU
order.

**Simplified.** A classifier of "used within H" (LRB regresses log time to
next request); one sample per engine step; a tail is keyed by one recorded
block (every ``chain_stride``-th, see the learner), so a use of a chain that
branches off inside the first stride of the tail counts. The model is
retrained inside the eviction call by default (small window, few trees, one
thread: its time is measured in :attr:`learner.stats`; deterministic given
the seed, propensity 1.0); ``background=True`` fits on a worker thread and
swaps the booster in when it is ready, as a server would (then which calls
see which model depends on timing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from data.records import tail_starts
from policy.baselines.lrb import SampledNextUseEvictionPolicy
from policy.interface import CachedPrefix, EngineState, EvictionDecision
from policy.options import check_count
from predictors.online_reuse import OnlineReuseLearner


class OnlineLrbEvictionPolicy(SampledNextUseEvictionPolicy):
    """LRB with its reuse model trained online: LRU during warm-up, then the sampled least-likely-reused first."""

    name = "lrb-online"
    version = "1"

    def __init__(
        self,
        sample_size: int = 64,
        seed: int = 0,
        horizon_s: float = 30.0,
        window: int = 4096,
        retrain_every: int = 512,
        min_labels: int = 256,
        samples_per_call: int = 8,
        num_trees: int = 32,
        num_threads: int = 1,
        chain_stride: int = 8,
        background: bool = False,
        max_requests: int = 200_000,
        max_nodes: int = 200_000,
        cover_blocks: Optional[int] = None,
        max_candidates: Optional[int] = None,
    ) -> None:
        learner = OnlineReuseLearner(
            horizon_s=horizon_s, window=window, retrain_every=retrain_every, min_labels=min_labels,
            samples_per_call=samples_per_call, num_trees=num_trees, num_threads=num_threads,
            chain_stride=chain_stride, background=background, seed=seed, max_requests=max_requests,
            max_nodes=max_nodes,
        )
        super().__init__(sample_size=sample_size, seed=seed, reuse_predictor=learner, max_candidates=max_candidates)
        self.learner = learner
        self.cover_blocks = check_count("cover_blocks", cover_blocks, allow_none=True)
        #: eviction calls answered with LRU because no model was trained yet
        self.lru_calls = 0

    def evict(
        self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int, state: EngineState
    ) -> Optional[EvictionDecision]:
        tails = tail_starts(prefixes)
        self.learner.observe_candidates(prefixes, tails, state.time_s)
        if not prefixes:
            return None
        if self.learner.model is None:
            self.lru_calls += 1
            return None
        cover = self.cover_blocks or state.max_num_batched_tokens // max(state.block_size, 1)
        need = max(1, int(num_blocks_needed), cover)
        own = {p.prefix_id: p.num_blocks - t for p, t in zip(prefixes, tails) if t < p.num_blocks}
        sample = self.sample([p for p in prefixes if p.prefix_id in own])
        self.last_sample = [p.prefix_id for p in sample]
        if not sample:
            return None
        start = {p.prefix_id: t for p, t in zip(prefixes, tails)}
        prob = self.learner.reuse_probability(sample, [start[p.prefix_id] for p in sample], state.time_s)
        ranked = sorted(range(len(sample)), key=lambda i: (prob[i], sample[i].last_used_s, sample[i].prefix_id))
        order: list[str] = []
        covered = 0
        for i in ranked:
            order.append(sample[i].prefix_id)
            covered += own[sample[i].prefix_id]
            if covered >= need:
                break
        return EvictionDecision(order=order)

    def summary(self) -> dict[str, Any]:
        """The learner's counters and timings, and how often the policy answered LRU."""
        return {**self.learner.stats.as_dict(), "lru_calls": self.lru_calls}
