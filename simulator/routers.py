"""Routers that place each request on one of several replicas.

A :class:`Router` sees a :class:`RouteRequest` (its block-hash chain, see
:data:`data.schemas.WORKLOAD`) and the current :class:`ReplicaLoad` of every
replica it may choose, and returns the chosen replica's ``index``. ``route``
records its own choice (it calls :meth:`Router.on_routed`); a driver calls
``on_routed`` itself only for a request it placed without asking, such as a
session pinned to its replica. :meth:`Router.on_kv_event` receives the
replicas' KV-cache events (``stored`` / ``removed`` / ``cleared``, as in
:data:`data.schemas.KV_EVENTS`) for routers that track resident blocks.

Routers: ``round-robin``, ``least-loaded``, ``cache-aware`` (after SGLang's
``cache_aware`` policy, see :class:`CacheAwareRouter`), ``kv-aware`` (after
llm-d's precise prefix-cache scorer over KV events, see :class:`KVAwareRouter`),
``session-affinity`` (a session stays on its replica until that replica's queue
or KV pressure crosses a threshold, as RL stacks route, see
:class:`SessionAffinityRouter`) and ``kvpilot`` (placement by predicted KV
demand against each replica's working set, and priced moves of sessions whose
replica is over-committed, see :class:`KVPilotRouter`) and ``fewest-sessions`` (sticky sessions on the
replica with the fewest live sessions, see :class:`FewestSessionsRouter`); :func:`make_router`
builds one by name.

Sessions. A router with ``session_aware`` set sees every turn of a session, with
``RouteRequest.home`` the replica of its earlier turns, and may move it; the
fleet counts and prices each move (``session_moves`` in a run's summary). Other
routers see only a session's first request when sessions are sticky.
"""

from __future__ import annotations

import math
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
    "KVAwareRouter",
    "SessionAffinityRouter",
    "KVPilotRouter",
    "FewestSessionsRouter",
    "ROUTERS",
    "make_router",
]


@dataclass(frozen=True)
class RouteRequest:
    """What a router may know of a request: its prompt's block-hash chain and ids.

    ``stream`` is the trajectory it belongs to (a scoring request's is the trajectory it scores), ``home`` the
    replica of the stream's earlier requests (None for its first; set for session-aware routers only) and
    ``domain`` its workload domain, when known.
    """

    request_id: str
    block_hashes: Sequence[int]
    prompt_tokens: int
    block_size: int
    session_id: str | None = None
    stream: str | None = None
    home: int | None = None
    domain: str | None = None


@dataclass(frozen=True)
class ReplicaLoad:
    """One routable replica, its load (running plus waiting requests) and its KV cache (blocks; 0: unknown)."""

    index: int
    load: int
    kv_blocks: int = 0
    free_blocks: int = 0


class Router(ABC):
    """Chooses a replica for each request."""

    #: Sees every turn of a sticky session (``RouteRequest.home`` set) and may move it.
    session_aware: bool = False

    @abstractmethod
    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        """The ``index`` of the replica, among ``replicas``, that gets ``request``."""

    def on_routed(self, request: RouteRequest, replica: int) -> None:  # noqa: B027 (a no-op unless a router listens)
        """``request`` was placed on ``replica``."""

    def on_kv_event(self, replica: int, kind: str, block_hashes: Sequence[int]) -> None:  # noqa: B027 (a no-op unless a router listens)
        """``replica`` stored, removed or cleared (``kind``) the KV blocks ``block_hashes``."""

    def on_session_end(self, stream: str) -> None:  # noqa: B027 (a no-op unless a router listens)
        """The trajectory ``stream`` ended (done or aborted): none of its requests will come again."""


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


class KVAwareRouter(Router):
    """KV-cache-aware routing after llm-d's precise prefix-cache scorer, over replicas' KV events.

    Index. Per replica, the set of block hashes it holds, built ONLY from KV
    events (:meth:`on_kv_event`): ``stored`` adds the hashes, ``removed``
    deletes them, ``cleared`` empties the replica; any other kind raises
    ``ValueError``. Routing never touches the index (:meth:`on_routed` is the
    base no-op), which is what sets this router apart from ``cache-aware``. A
    hash is resident or not, as in llm-d's block index (key -> pods): if vLLM
    holds two physical copies of one hash and evicts one, the hash leaves the
    index; vLLM's ``BlockStored`` re-announcements of reused blocks are
    idempotent here. The event's ``medium`` is not tracked.

    Scoring. For each candidate replica ``r`` with ``m_r`` = the longest leading
    run of ``request.block_hashes`` resident on ``r`` (llm-d-kv-cache-manager
    ``LongestPrefixScorer``: consecutive hits from block 0)::

        score_r = prefix_weight * prefix_r + load_weight * load_r

    * ``prefix_score="fraction"`` (default): ``prefix_r = m_r / len(block_hashes)``
      (0 for an empty chain), the fraction of the request's prefix blocks
      resident as a leading run. ``"min-max"``: llm-d's own normalisation
      (``indexedScoresToNormalizedScoredPods`` in llm-d-inference-scheduler
      ``pkg/plugins/scorer/utils.go``): among candidates with ``m_r >= 1``,
      ``(m_r - min) / (max - min)``, or 1.0 when they are all equal; 0.0 for
      candidates with no hit. (llm-d takes min and max over every pod with a
      hit, candidate or not; here over candidates only.)
    * ``load_score="max"`` (default): ``load_r = 1 - load_r / max_load`` over the
      candidates (1.0 for all when ``max_load == 0``). ``"min-max"``: the
      Gateway API Inference Extension ``queue-scorer``,
      ``(max_load - load_r) / (max_load - min_load)``, 1.0 for all when equal.
      Load is the simulator's running plus waiting count (llm-d's
      queue-scorer reads the waiting queue only).
    * Defaults ``prefix_weight=2.0``, ``load_weight=1.0``: llm-d's sample
      precise-prefix config (llm-d-inference-scheduler
      ``deploy/config/epp-precise-prefix-cache-config.yaml``) weights
      ``precise-prefix-cache-scorer`` 2.0 against ``queue-scorer`` 1.0 and
      ``kv-cache-utilization-scorer`` 1.0; the simulator has no utilisation
      signal, so that third term is left out.
    * The highest score wins; ties go to the lower load, then the lower index
      (llm-d's ``max-score-picker`` breaks ties at random).

    Hash contract. ``RouteRequest.block_hashes`` must live in the same hash
    space as the KV events: the signed int64 form
    (:func:`serving_hook.events.hash_to_int64`) of vLLM's own block hashes of
    the prompt's full blocks, in order, at vLLM's hash block size (16 unless
    configured), with vLLM's hash algorithm and ``NONE_HASH`` seed (sha256 and
    ``"vllm-none-hash"`` unless ``PYTHONHASHSEED`` is set). These are NOT the
    workload table's ``block_hashes`` nor :func:`simulator.tokens.block_keys`
    (the simulator's own prefix keys): the simulator expands a workload
    request into token ids (:mod:`simulator.tokens`) and hashes them with
    :func:`simulator.engine.vllm_block_hashes`, or takes ``hash_to_int64`` of
    the vLLM ``Request.block_hashes`` it builds (``simulator.engine.make_request``,
    :func:`simulator.engine.prompt_block_hashes`), which are equal. The
    fraction's denominator is ``len(block_hashes)``, so pass full blocks only
    (``num_prompt_tokens // block_size`` hashes, as ``serving_hook`` logs
    them); ``prompt_tokens`` and ``block_size`` are not used.
    """

    PREFIX_SCORES = ("fraction", "min-max")
    LOAD_SCORES = ("max", "min-max")
    EVENT_KINDS = ("stored", "removed", "cleared")

    def __init__(
        self,
        prefix_weight: float = 2.0,
        load_weight: float = 1.0,
        prefix_score: str = "fraction",
        load_score: str = "max",
    ) -> None:
        if not (prefix_weight >= 0 and load_weight >= 0) or math.isinf(prefix_weight) or math.isinf(load_weight):
            raise ValueError("prefix_weight and load_weight must be finite and >= 0")
        if prefix_score not in self.PREFIX_SCORES:
            raise ValueError(f"prefix_score must be one of {self.PREFIX_SCORES}, got {prefix_score!r}")
        if load_score not in self.LOAD_SCORES:
            raise ValueError(f"load_score must be one of {self.LOAD_SCORES}, got {load_score!r}")
        self.prefix_weight = float(prefix_weight)
        self.load_weight = float(load_weight)
        self.prefix_score = prefix_score
        self.load_score = load_score
        # Per replica: the block hashes its KV events say are resident.
        self._index: dict[int, set[int]] = {}

    def on_kv_event(self, replica: int, kind: str, block_hashes: Sequence[int]) -> None:
        if kind == "stored":
            self._index.setdefault(replica, set()).update(int(h) for h in block_hashes)
        elif kind == "removed":
            resident = self._index.get(replica)
            if resident:
                resident.difference_update(int(h) for h in block_hashes)
        elif kind == "cleared":
            self._index.pop(replica, None)
        else:
            raise ValueError(f"unknown KV event kind {kind!r}; expected one of {', '.join(self.EVENT_KINDS)}")

    def resident_blocks(self, replica: int) -> int:
        """Number of block hashes ``replica``'s KV events say it holds."""
        return len(self._index.get(replica, ()))

    def is_resident(self, replica: int, block_hash: int) -> bool:
        """Whether ``replica``'s index holds ``block_hash``."""
        return int(block_hash) in self._index.get(replica, ())

    def matched_blocks(self, replica: int, block_hashes: Sequence[int]) -> int:
        """Length of the longest leading run of ``block_hashes`` resident on ``replica``."""
        resident = self._index.get(replica)
        if not resident:
            return 0
        n = 0
        for h in block_hashes:
            if int(h) not in resident:
                break
            n += 1
        return n

    def prefix_scores(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> dict[int, float]:
        """Prefix score in [0, 1] of each candidate, per ``prefix_score``."""
        matched = {r.index: self.matched_blocks(r.index, request.block_hashes) for r in replicas}
        if self.prefix_score == "fraction":
            n = len(request.block_hashes)
            return {i: (m / n if n else 0.0) for i, m in matched.items()}
        hits = [m for m in matched.values() if m > 0]
        if not hits:
            return {i: 0.0 for i in matched}
        lo, hi = min(hits), max(hits)
        return {i: (0.0 if m == 0 else 1.0 if hi == lo else (m - lo) / (hi - lo)) for i, m in matched.items()}

    def load_scores(self, replicas: Sequence[ReplicaLoad]) -> dict[int, float]:
        """Load score in [0, 1] of each candidate (higher is less loaded), per ``load_score``."""
        loads = [r.load for r in replicas]
        lo, hi = min(loads), max(loads)
        if self.load_score == "max":
            return {r.index: (1.0 - r.load / hi if hi > 0 else 1.0) for r in replicas}
        return {r.index: ((hi - r.load) / (hi - lo) if hi > lo else 1.0) for r in replicas}

    def scores(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> dict[int, float]:
        """``prefix_weight * prefix + load_weight * load`` of each candidate."""
        if not replicas:
            raise ValueError("no replica to route to")
        prefix = self.prefix_scores(request, replicas)
        load = self.load_scores(replicas)
        return {r.index: self.prefix_weight * prefix[r.index] + self.load_weight * load[r.index] for r in replicas}

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        score = self.scores(request, replicas)
        chosen = min(replicas, key=lambda r: (-score[r.index], r.load, r.index))
        self.on_routed(request, chosen.index)
        return chosen.index


def _pressure(r: ReplicaLoad) -> float:
    """The share of ``r``'s KV blocks in use (0.0 when its size is unknown)."""
    return 1.0 - r.free_blocks / r.kv_blocks if r.kv_blocks > 0 else 0.0


class SessionAffinityRouter(Router):
    """Session affinity with load awareness, as RL rollout stacks route multi-turn sessions.

    A session's first request goes to the least-loaded replica (ties: more free KV, then the lower index); its
    later turns stay on that replica, where their prefix is cached, unless the replica is overloaded: its load
    exceeds ``max_load_ratio`` x the lightest replica's load plus ``min_load_gap`` requests, or its KV use is at
    least ``max_kv_usage`` while another replica's is below it. An overloaded session's turn moves to the
    least-loaded replica, and later turns stay there. The move costs the turn its cached prefix: the fleet counts
    it and the new replica recomputes that KV (``session_moves``, ``session_move_tokens``).
    """

    session_aware = True

    def __init__(self, max_load_ratio: float = 2.0, min_load_gap: int = 8, max_kv_usage: float = 0.98) -> None:
        if not max_load_ratio >= 1.0 or min_load_gap < 0 or not 0.0 < max_kv_usage <= 1.0:
            raise ValueError("max_load_ratio must be >= 1, min_load_gap >= 0 and max_kv_usage in (0, 1]")
        self.max_load_ratio = float(max_load_ratio)
        self.min_load_gap = int(min_load_gap)
        self.max_kv_usage = float(max_kv_usage)

    def overloaded(self, home: ReplicaLoad, replicas: Sequence[ReplicaLoad]) -> bool:
        """Whether ``home`` is past the queue or the KV threshold, against the other replicas."""
        lightest = min(r.load for r in replicas)
        if home.load > self.max_load_ratio * lightest + self.min_load_gap:
            return True
        return _pressure(home) >= self.max_kv_usage and any(_pressure(r) < self.max_kv_usage for r in replicas)

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        if not replicas:
            raise ValueError("no replica to route to")
        home = next((r for r in replicas if r.index == request.home), None)
        if home is not None and not self.overloaded(home, replicas):
            chosen = home.index
        else:
            chosen = min(replicas, key=lambda r: (r.load, -r.free_blocks, r.index)).index
        self.on_routed(request, chosen)
        return chosen


class KVPilotRouter(KVAwareRouter):
    """kvpilot's router: places sessions by predicted KV demand and moves a session only when the move pays.

    It keeps a ledger of the live sessions on each replica (resident or paused on a tool) and each one's
    predicted KV demand: the larger of its context so far and its domain's predicted peak context, learned
    online from the sessions that ended (the mean of their peaks; before any ended, the context so far). A
    replica's committed demand over its KV capacity is its pressure; its prefix index comes from the replicas'
    KV events, as :class:`KVAwareRouter`'s.

    * A new session goes to the replica whose pressure, with the session's demand added, is lowest; a replica
      holding at least ``locality_share`` of its prompt (a GRPO sibling's) wins if its pressure is within
      ``locality_slack`` of that.
    * A later turn stays home, except when home is over-committed (pressure above 1: its sessions' KV cannot all
      stay, and the overflow share ``1 - 1 / pressure`` of what this turn has cached there is expected to be
      evicted and recomputed) and another replica takes the session without going over. The move is priced in
      tokens: it pays if the cached prefix it gives up on home, less what the target holds, is below the
      expected loss of staying. A session whose prefix home already evicted moves for free to a replica with
      more room.
    """

    session_aware = True

    def __init__(self, locality_share: float = 0.5, locality_slack: float = 0.05) -> None:
        super().__init__()
        if not 0.0 <= locality_share <= 1.0 or locality_slack < 0:
            raise ValueError("locality_share must be in [0, 1] and locality_slack >= 0")
        self.locality_share = float(locality_share)
        self.locality_slack = float(locality_slack)
        # stream -> (replica, context so far, domain, the demand it adds to its replica's committed demand)
        self._sessions: dict[str, tuple[int, int, str | None, float]] = {}
        self._committed: dict[int, float] = {}  # replica -> predicted KV demand of its live sessions, tokens
        self._peaks: dict[str | None, tuple[float, int]] = {}  # domain -> (sum of ended sessions' peaks, count)

    def predicted_demand(self, context: int, domain: str | None) -> float:
        """A session's predicted peak KV, tokens: its context so far or its domain's mean peak, the larger."""
        total, n = self._peaks.get(domain, (0.0, 0))
        return max(float(context), total / n if n else 0.0)

    def committed(self, replica: int) -> float:
        """Predicted KV demand, tokens, of the live sessions on ``replica``."""
        return self._committed.get(replica, 0.0)

    def _capacity(self, r: ReplicaLoad, block_size: int) -> float:
        return float(r.kv_blocks * block_size) if r.kv_blocks > 0 else math.inf

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        if not replicas:
            raise ValueError("no replica to route to")
        bs = request.block_size
        stream = request.stream if request.stream is not None else request.request_id
        entry = self._sessions.get(stream)
        own = self.predicted_demand(request.prompt_tokens, request.domain) if entry is None else \
            self.predicted_demand(max(entry[1], request.prompt_tokens), entry[2])
        if entry is not None:  # its own demand is not load on the replica it would leave
            self._committed[entry[0]] -= entry[3]

        def pressure_with(r: ReplicaLoad) -> float:
            return (self.committed(r.index) + own) / self._capacity(r, bs)

        kept = {r.index: min(self.matched_blocks(r.index, request.block_hashes) * bs, request.prompt_tokens)
                for r in replicas}
        home = next((r for r in replicas if r.index == request.home), None)
        roomiest = min(replicas, key=lambda r: (pressure_with(r), -kept[r.index], r.load, r.index))
        if home is None:
            chosen = roomiest
            local = max(replicas, key=lambda r: (kept[r.index], -pressure_with(r), -r.index))
            if kept[local.index] >= self.locality_share * request.prompt_tokens > 0 and \
                    pressure_with(local) <= pressure_with(roomiest) + self.locality_slack:
                chosen = local
        else:
            chosen = home
            p_home = pressure_with(home)
            if p_home > 1.0 and roomiest.index != home.index and pressure_with(roomiest) <= 1.0:
                expected_loss = kept[home.index] * (1.0 - 1.0 / p_home)
                if kept[home.index] - kept[roomiest.index] <= expected_loss:
                    chosen = roomiest
        domain = request.domain if entry is None else entry[2]
        self._sessions[stream] = (chosen.index, max(request.prompt_tokens, entry[1] if entry else 0), domain, own)
        self._committed[chosen.index] = self.committed(chosen.index) + own
        self.on_routed(request, chosen.index)
        return chosen.index

    def on_session_end(self, stream: str) -> None:
        entry = self._sessions.pop(stream, None)
        if entry is None:
            return
        replica, context, domain, demand = entry
        self._committed[replica] -= demand
        total, n = self._peaks.get(domain, (0.0, 0))
        self._peaks[domain] = (total + context, n + 1)


class FewestSessionsRouter(Router):
    """Sticky sessions placed on the replica with the fewest active sessions (SkyRL #1791, prime-rl's default).

    A session's first request goes to the replica with the fewest live sessions (ties: lower load, then the
    lower index); the fleet keeps its later turns there (sticky sessions). A session is live from its first
    request until its trajectory ends (:meth:`Router.on_session_end`).
    """

    def __init__(self) -> None:
        self._home: dict[str, int] = {}  # live stream -> its replica
        self._count: dict[int, int] = {}  # replica -> live sessions

    def active_sessions(self, replica: int) -> int:
        return self._count.get(replica, 0)

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        if not replicas:
            raise ValueError("no replica to route to")
        chosen = min(replicas, key=lambda r: (self.active_sessions(r.index), r.load, r.index)).index
        self.on_routed(request, chosen)
        return chosen

    def on_routed(self, request: RouteRequest, replica: int) -> None:
        stream = request.stream if request.stream is not None else request.request_id
        if stream not in self._home:
            self._home[stream] = replica
            self._count[replica] = self._count.get(replica, 0) + 1

    def on_session_end(self, stream: str) -> None:
        replica = self._home.pop(stream, None)
        if replica is not None:
            self._count[replica] -= 1


ROUTERS: dict[str, Callable[..., Router]] = {
    "round-robin": RoundRobinRouter,
    "least-loaded": LeastLoadedRouter,
    "cache-aware": CacheAwareRouter,
    "kv-aware": KVAwareRouter,
    "session-affinity": SessionAffinityRouter,
    "kvpilot": KVPilotRouter,
    "fewest-sessions": FewestSessionsRouter,
}


def make_router(name: str, **kwargs: Any) -> Router:
    """Build the router registered as ``name`` with ``kwargs``."""
    try:
        factory = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}; known routers: {', '.join(sorted(ROUTERS))}") from None
    return factory(**kwargs)
