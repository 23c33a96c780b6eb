"""Routers that place each request on one of several replicas.

A :class:`Router` sees a :class:`RouteRequest` (its block-hash chain, see
:data:`data.schemas.WORKLOAD`) and the current :class:`ReplicaLoad` of every
replica it may choose, and returns the chosen replica's ``index``. ``route``
records its own choice (it calls :meth:`Router.on_routed`); a driver calls
``on_routed`` itself only for a request it placed without asking, such as a
session pinned to its replica. :meth:`Router.on_kv_event` receives the
replicas' KV-cache events (``stored`` / ``removed`` / ``cleared``, as in
:data:`data.schemas.KV_EVENTS`) for routers that track resident blocks.

Routers: ``round-robin``, ``least-loaded`` and ``cache-aware`` (after SGLang's
``cache_aware`` policy, see :class:`CacheAwareRouter`); :func:`make_router`
builds one by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RouteRequest",
    "ReplicaLoad",
    "Router",
    "RoundRobinRouter",
    "LeastLoadedRouter",
    "CacheAwareRouter",
    "ROUTERS",
    "make_router",
]


@dataclass(frozen=True)
class RouteRequest:
    """What a router may know of a request: its prompt's block-hash chain and ids."""

    request_id: str
    block_hashes: Sequence[int]
    prompt_tokens: int
    block_size: int
    session_id: str | None = None


@dataclass(frozen=True)
class ReplicaLoad:
    """One routable replica and its load (running plus waiting requests)."""

    index: int
    load: int


class Router(ABC):
    """Chooses a replica for each request."""

    @abstractmethod
    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        """The ``index`` of the replica, among ``replicas``, that gets ``request``."""

    def on_routed(self, request: RouteRequest, replica: int) -> None:
        """``request`` was placed on ``replica``."""

    def on_kv_event(self, replica: int, kind: str, block_hashes: Sequence[int]) -> None:
        """``replica`` stored, removed or cleared (``kind``) the KV blocks ``block_hashes``."""


def _least_loaded(replicas: Sequence[ReplicaLoad]) -> ReplicaLoad:
    """The replica with the lowest load, ties to the lowest index."""
    if not replicas:
        raise ValueError("no replica to route to")
    return min(replicas, key=lambda r: (r.load, r.index))


class RoundRobinRouter(Router):
    """Cycles through the replicas in the order given."""

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        if not replicas:
            raise ValueError("no replica to route to")
        chosen = replicas[self._next % len(replicas)].index
        self._next += 1
        self.on_routed(request, chosen)
        return chosen


class LeastLoadedRouter(Router):
    """Sends each request to the least-loaded replica (ties to the lowest index)."""

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        chosen = _least_loaded(replicas).index
        self.on_routed(request, chosen)
        return chosen


class CacheAwareRouter(Router):
    """SGLang's ``cache_aware`` routing rules over block-hash chains.

    Rules (sgl-router ``select_generate_worker_from_text`` and the
    ``CacheAware`` doc comment in its ``router.rs``):

    1. Load is imbalanced iff ``max_load - min_load > balance_abs_threshold``
       and ``max_load > balance_rel_threshold * min_load``. Then the request
       goes to the least-loaded replica (shortest queue).
    2. Otherwise the request is matched against each replica's approximate
       tree, the prefixes this router has sent there. If the best
       ``matched / len`` is above ``cache_threshold`` it goes to the replica
       with the longest match, else to the replica with the smallest tree.
    3. The request's prefix is then inserted into the chosen replica's tree.

    Defaults are SGLang's (``RouterArgs``): cache_threshold 0.5,
    balance_abs_threshold 32, balance_rel_threshold 1.0001; the slime RL
    framework runs it with balance_abs_threshold 16.

    Differences from SGLang, all deliberate:

    * Granularity. SGLang matches the prompt's characters in a radix tree. Here
      a tree is the set of block hashes (hashes of whole prefixes, since they
      are chained), so the match is the longest leading run of the request's
      blocks present in a replica's tree, and a partial match inside a block
      counts as none of it.
    * The fraction is over tokens: ``min(matched_blocks * block_size,
      prompt_tokens) / prompt_tokens`` (the chain's last block may be partial).
      A request with no tokens matches nothing.
    * Tree size is counted in blocks, and ``max_tree_blocks`` caps each tree
      with LRU eviction at insertion time, where SGLang evicts LRU leaves down
      to ``max_tree_size`` (2**24 characters) every ``eviction_interval`` (60
      s). A routed chain is touched leaf first, so its root ends most recent and
      a chain loses its tail before its head, as with leaf eviction. The
      default, 262,144 blocks, is SGLang's 2**24 characters at ~4 characters
      per token in 16-token blocks; in front of replicas of known size, pass
      their KV capacity in blocks.
    * Load is the simulator's running plus waiting count of each replica, where
      SGLang counts the requests it has routed and not yet seen finish.
    * Ties, which SGLang breaks by hash-map order, go to the lower load, then
      the lower index: for the longest match, the smallest tree and the
      least-loaded replica alike.
    """

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
        max_tree_blocks: int = 262_144,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if balance_abs_threshold < 0 or balance_rel_threshold < 0:
            raise ValueError("balance thresholds must be >= 0")
        if max_tree_blocks < 1:
            raise ValueError("max_tree_blocks must be >= 1")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_blocks = max_tree_blocks
        # Per replica: block hash -> None, in LRU order (least recently routed first).
        self._trees: dict[int, OrderedDict[int, None]] = {}

    def is_imbalanced(self, replicas: Sequence[ReplicaLoad]) -> bool:
        """SGLang's imbalance test: both the absolute and the relative gap exceed their thresholds."""
        loads = [r.load for r in replicas]
        max_load, min_load = max(loads), min(loads)
        return (
            max_load - min_load > self.balance_abs_threshold
            and max_load > self.balance_rel_threshold * min_load
        )

    def matched_blocks(self, replica: int, block_hashes: Sequence[int]) -> int:
        """Length of the longest leading run of ``block_hashes`` in ``replica``'s tree."""
        tree = self._trees.get(replica)
        if not tree:
            return 0
        n = 0
        for h in block_hashes:
            if h not in tree:
                break
            n += 1
        return n

    def tree_blocks(self, replica: int) -> int:
        """Number of blocks in ``replica``'s tree."""
        return len(self._trees.get(replica, ()))

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        if not replicas:
            raise ValueError("no replica to route to")
        if self.is_imbalanced(replicas):
            chosen = _least_loaded(replicas)
        else:
            matched = {r.index: self.matched_blocks(r.index, request.block_hashes) for r in replicas}
            best = min(replicas, key=lambda r: (-matched[r.index], r.load, r.index))
            tokens = min(matched[best.index] * request.block_size, request.prompt_tokens)
            fraction = tokens / request.prompt_tokens if request.prompt_tokens > 0 else 0.0
            if fraction > self.cache_threshold:
                chosen = best
            else:
                chosen = min(replicas, key=lambda r: (self.tree_blocks(r.index), r.load, r.index))
        self.on_routed(request, chosen.index)
        return chosen.index

    def on_routed(self, request: RouteRequest, replica: int) -> None:
        tree = self._trees.setdefault(replica, OrderedDict())
        for h in reversed(request.block_hashes):
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self.max_tree_blocks:
            tree.popitem(last=False)


ROUTERS: dict[str, Callable[..., Router]] = {
    "round-robin": RoundRobinRouter,
    "least-loaded": LeastLoadedRouter,
    "cache-aware": CacheAwareRouter,
}


def make_router(name: str, **kwargs: Any) -> Router:
    """Build the router registered as ``name`` with ``kwargs``."""
    try:
        factory = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}; known routers: {', '.join(sorted(ROUTERS))}") from None
    return factory(**kwargs)
