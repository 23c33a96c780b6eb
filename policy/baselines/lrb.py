"""Sampled eviction by predicted time to next use, after LRB.

**Idea and source.** LRB (Learning Relaxed Belady, NSDI'20) approximates
Belady's rule (evict the object re-requested furthest in the future) for CDN
caches: gradient-boosted trees predict each object's time to next request
from recency deltas and decayed frequency counters; at eviction time it
samples 64 cached objects at random and evicts the one predicted furthest. It
only needs to beat the "Belady boundary", not to rank everything. LPC
(NeurIPS'25, same group) carries the idea to LLM prefix caches.

**Mechanism as implemented.** On kvpilot's eviction lever: when an
allocation is about to evict cached blocks, draw ``sample_size`` (default 64)
candidates uniformly without replacement (a ``random.Random(seed)`` owned by
the policy, so runs repeat), predict their next use with the
``reuse_predictor`` (default ``"auto"``: ``"oracle"`` from the simulated ``workload`` where one is given,
else ``"online"``, the online reuse model that works in a server; or any
:class:`policy.predictors.ReusePredictor` object), and list the sampled
prefixes furthest-first until their blocks cover the allocation
(``num_blocks_needed``; at least one prefix). Prefixes not listed keep LRU
order behind them. Only the sample is scored, so the predictor's cost is
bounded by ``sample_size`` whatever the cache size. ``max_candidates`` caps
what the hook offers (least recently freed first); the sample is drawn from
those.

**Simplified.** One sample per engine step (the hook asks at most once per
step) instead of a fresh sample per evicted object; what the listed prefixes
do not cover is evicted LRU. The predictor is the oracle in this issue,
not LRB's GBDT on recency/frequency features (the learned reuse predictor
plugs in here later). Prefixes, not objects: a listed prefix loses its
deepest blocks first. Propensity is reported as 1.0: the decision is
deterministic given the seed, and the randomness is not over actions the log
can re-weight.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Optional

from policy.baselines._eviction import ReuseEventsMixin, resolve_reuse_predictor
from policy.common import furthest_first
from policy.interface import CachedPrefix, EngineState, EvictionDecision, Policy
from policy.options import check_count


class SampledNextUseEvictionPolicy(ReuseEventsMixin, Policy):
    """Sample ``sample_size`` cached prefixes; evict the one predicted to be used furthest in the future."""

    name = "lrb"
    version = "1"
    uses_eviction = True
    uses_events = True

    def __init__(
        self,
        sample_size: int = 64,
        seed: int = 0,
        reuse_predictor: Any = "auto",
        max_candidates: Optional[int] = None,
        workload: Any = None,
    ):
        self.sample_size = check_count("sample_size", sample_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"option seed must be an integer, got {seed!r}")
        self.seed = seed
        self.rng = random.Random(seed)
        self.reuse = resolve_reuse_predictor(reuse_predictor, workload, policy=type(self).__name__)
        self.max_eviction_candidates = check_count("max_candidates", max_candidates, allow_none=True)
        #: The ids of the last sample (for tests and debugging).
        self.last_sample: list[str] = []

    def sample(self, prefixes: Sequence[CachedPrefix]) -> list[CachedPrefix]:
        """The sampled candidates, in the order the hook offered them."""
        n = len(prefixes)
        if n <= self.sample_size:
            return list(prefixes)
        idx = sorted(self.rng.sample(range(n), self.sample_size))
        return [prefixes[i] for i in idx]

    def order(self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int, now_s: float) -> list[str]:
        sample = self.sample(prefixes)
        self.last_sample = [p.prefix_id for p in sample]
        ranked = furthest_first(sample, self.reuse.next_use_s(sample, now_s))
        blocks = {p.prefix_id: p.num_blocks for p in sample}
        out: list[str] = []
        covered = 0
        for pid in ranked:
            out.append(pid)
            covered += blocks[pid]
            if covered >= num_blocks_needed:
                break
        return out

    def evict(self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int, state: EngineState):
        if not prefixes:
            return None
        return EvictionDecision(order=self.order(prefixes, max(1, int(num_blocks_needed)), state.time_s))
