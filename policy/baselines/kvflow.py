"""Next-use-distance eviction, after KVFlow.

**Idea and source.** KVFlow (workflow-aware KV-cache management for
multi-agent LLM serving) replaces SGLang's LRU eviction of its radix cache: it
reads the agents' workflow graph, computes for every cached agent prefix its
*steps-to-execution* (how many scheduling steps until that agent runs again)
and evicts the prefix whose next use is furthest away. It also prefetches
evicted prefixes back from CPU memory ahead of their use. Reported 1.83-2.19x
over SGLang with LRU.

**Mechanism as implemented.** On kvpilot's eviction lever
(:meth:`policy.interface.Policy.evict`): when an allocation is about to evict
cached blocks, every cached prefix with a free block is a candidate; a
:class:`policy.predictors.ReusePredictor` predicts each one's next-use time,
and the order is furthest first (never used again first), ties broken by LRU.
Every candidate is listed, so the order replaces LRU completely among the
prefixes the hook tracks (finished requests' prefixes). ``reuse_predictor``:
``"auto"`` (the default: the hindsight oracle where a simulated ``workload`` is given, else ``"online"``),
``"oracle"`` (:class:`policy.predictors.OracleReusePredictor` from the
simulated ``workload``: hindsight, as in this issue), ``"online"`` (the online reuse model
:class:`policy.predictors.OnlineNextUse`: works in a server) or any predictor object
(the learned reuse model later). ``max_candidates`` caps the candidates (the
least recently freed ones).

**Simplified.** Next use is a predicted *time*, not a count of steps of an
agent graph (RL rollouts have no explicit graph; a session's next turn comes
after its tool, a sibling or a scorer when admitted). No CPU offload and no
prefetch: an evicted prefix is recomputed. Prefixes are whole requests'
contexts, so an order evicts a prefix's deepest blocks first rather than
radix-tree leaves. Deterministic (propensity 1.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from policy.baselines._eviction import ReuseEventsMixin, resolve_reuse_predictor
from policy.common import furthest_first
from policy.interface import CachedPrefix, EngineState, EvictionDecision, Policy
from policy.options import check_count


class NextUseEvictionPolicy(ReuseEventsMixin, Policy):
    """Evict the cached prefix whose predicted next use is furthest away."""

    name = "kvflow"
    version = "1"
    uses_eviction = True
    uses_events = True  # the predictor learns which requests arrived / ran / finished

    def __init__(self, reuse_predictor: Any = "auto", max_candidates: Optional[int] = None, workload: Any = None):
        self.reuse = resolve_reuse_predictor(reuse_predictor, workload, policy=type(self).__name__)
        self.max_eviction_candidates = check_count("max_candidates", max_candidates, allow_none=True)

    def order(self, prefixes: Sequence[CachedPrefix], now_s: float) -> list[str]:
        """All prefix ids, furthest predicted next use first."""
        return furthest_first(prefixes, self.reuse.next_use_s(prefixes, now_s))

    def evict(self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int, state: EngineState):
        if not prefixes:
            return None
        return EvictionDecision(order=self.order(prefixes, state.time_s))
