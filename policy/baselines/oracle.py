"""The hindsight oracle: true lengths for admission, Belady for eviction. A reference, not deployable.

**Idea and source.** An upper reference built from what a simulator knows
in hindsight: every request's true output length, and when each cached
prefix will be needed again. Belady's MIN rule (evict the entry whose next
use is furthest in the future) is the optimal eviction for unit-size entries;
shortest-remaining-processing-time first (SRPT) is the classic hindsight
admission rule for mean completion time. "Tail-aware scheduling" (arXiv
2606.18431) shows that even perfect lengths lose at p99 once memory pressure
couples decode dynamics; kvpilot's learned policy is measured against this
reference, and can imitate it offline.

**Mechanism as implemented.** Built from the simulated ``workload`` (the
registry passes it; without one the factory fails):

* *Admission* (``admission``): ``"srpt"`` (default) orders waiting requests
  by true remaining output (``output_tokens - generated``, from
  :class:`policy.predictors.OracleLengthPredictor`), shortest first, ties by
  arrival; ``"lpt"`` longest first (the classic makespan heuristic for a
  synchronous RL step); ``"chain"`` the longest remaining session first: this
  turn's remaining output plus every later turn's of its session (critical path
  first, the makespan heuristic for chains of turns; a request without a session
  is its own chain); ``"fcfs"`` keeps vLLM's order (isolates the cache
  levers). SRPT is the default because it is the hindsight rule the field
  compares against; which rule gives the best makespan on a given workload is
  an empirical question for the simulator runs: compare ``srpt`` and ``lpt``
  there and report the better one as the reference.
* *Eviction*: Belady. Every cached prefix is a candidate, and the order is
  furthest next use first, never-used-again first, ties by LRU. The lever
  moves only a prefix's *exclusive tail* (the blocks no other cached chain
  goes through, :func:`serving_hook.block_pool.exclusive_tail`). With
  ``eviction="prefix"`` (default) a prefix's next use comes from
  :class:`policy.predictors.OracleReusePredictor` (the first future request
  sharing its leading block, timed from the workload's tool latencies and the
  observed finish times; see there for what is estimated). With
  ``eviction="block"`` it is the next use of the first block of its tail, by
  :class:`BlockNextUse` (the first request still to be scheduled that would
  hit that 16-token block, in arrival order): Belady on the blocks the lever
  can move, for trace replays such as Mooncake.
* *Retention*: a prefix whose owner paused on a tool is pinned when its next
  use (the session's next turn: owner finish + the tool's true latency) falls
  within ``max_ttl_s``; the TTL is the time to that use plus
  ``ttl_margin_s``. A pinned prefix is released as soon as its next use is
  beyond ``max_ttl_s`` (typically: the next turn was scheduled and took its
  own references) and renewed if its next use moved later. With
  ``demote_unused=True``, a freed prefix that nothing will use again is
  demoted at once (evicted first).

**Simplified.** Next-use times of requests that have not arrived are
estimated without generation and queueing time (they depend on the
schedule): far uses look nearer than they are. Belady is optimal for
equal-size entries only; prefixes here differ in size and share blocks.
Preemption is left to vLLM. Deterministic (propensity 1.0). Block mode is
Belady at the lever's granularity: each listed tail moves as a whole (deepest
block first), so within one engine step the blocks of two tails are not
interleaved by next use as a per-block Belady would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

from data.hashing import VLLM_BLOCK_SIZE
from data.records import tail_starts
from policy.baselines._eviction import resolve_reuse_predictor
from policy.common import furthest_first, resolve_length_predictor
from policy.interface import (
    AdmissionDecision,
    CachedPrefix,
    CandidateRequest,
    EngineState,
    Event,
    EventKind,
    EvictionDecision,
    OwnerState,
    Policy,
    Retention,
    RetentionAction,
    RetentionDecision,
)
from policy.predictors import row_key

ADMISSION_RULES = ("srpt", "lpt", "chain", "fcfs")
EVICTION_MODES = ("prefix", "block")


def later_output(workload: Any) -> dict[tuple[str, int], int]:
    """``(session, turn)`` -> the output tokens of that session's later turns, from the simulated workload."""
    cols = workload.select(["session_id", "turn", "output_tokens"]).to_pydict()
    turns: dict[str, list[tuple[int, int]]] = {}
    for s, t, o in zip(cols["session_id"], cols["turn"], cols["output_tokens"]):
        if s is not None:
            turns.setdefault(s, []).append((t or 0, o))
    out: dict[tuple[str, int], int] = {}
    for s, rows in turns.items():
        after = 0
        for t, o in sorted(rows, reverse=True):
            out[(s, t)] = after
            after += o
    return out


class BlockNextUse:
    """Hindsight next use of each cached 16-token block, from the workload's hash chains (a reference).

    Request ``i`` (rows in arrival order) would hit the leading
    ``(prompt_tokens - 1) // 16`` vLLM blocks of its prompt. Block ``d`` of
    a request's prompt is the ``d % R``-th 16-token block of its workload block
    ``hashes[d // R]`` (``R = block_size / 16``; equal hashes mean equal
    prefixes), so a later request with that hash at that index and more than
    ``d`` hittable blocks uses it. A block past its owner's prompt (its output)
    is used only by a later turn of the same session covering it. The next use
    is the arrival rank of the first such request not yet scheduled
    (``SCHEDULED`` events), ``inf`` when none is left.
    """

    def __init__(self, workload: Any) -> None:
        cols = workload.select(["session_id", "turn", "prompt_tokens", "block_size", "block_hashes"]).to_pydict()
        n = len(cols["session_id"])
        arrival = workload.column("arrival_s").to_pylist() if "arrival_s" in workload.column_names else [None] * n
        order = sorted(range(n), key=lambda i: (arrival[i] is None, arrival[i] or 0.0, i))
        self.rank: dict[tuple[str, int], int] = {}
        self.rows: list[tuple[int, int, int, list]] = []  # (hittable blocks, full blocks, R, hashes) by rank
        self._by_hash: dict[tuple[int, int], list[int]] = {}  # (workload hash, index) -> ranks using it
        self._by_session: dict[str, list[int]] = {}
        for r, i in enumerate(order):
            key = (cols["session_id"][i], cols["turn"][i] or 0)
            prompt = int(cols["prompt_tokens"][i])
            hit = max(0, (prompt - 1) // VLLM_BLOCK_SIZE)
            per = max(1, int(cols["block_size"][i]) // VLLM_BLOCK_SIZE)
            hashes = list(cols["block_hashes"][i] or ())
            self.rank[key] = r
            self.rows.append((hit, prompt // VLLM_BLOCK_SIZE, per, hashes))
            for k, h in enumerate(hashes[: -(-hit // per)]):
                self._by_hash.setdefault((h, k), []).append(r)
            self._by_session.setdefault(key[0], []).append(r)
        self._done: set[int] = set()
        self._start: dict[Any, int] = {}  # list id -> first index not known to be done

    def observe(self, event: Event) -> None:
        if event.kind is EventKind.SCHEDULED:
            r = self.rank.get(row_key(event.meta)) if event.meta.session_id is not None else None
            if r is not None:
                self._done.add(r)

    def _first(self, lid: Any, ranks: Sequence[int], owner: int, depth: int) -> float:
        done, rows = self._done, self.rows
        j, n = self._start.get(lid, 0), len(ranks)
        while j < n and ranks[j] in done:
            j += 1
        self._start[lid] = j
        for m in range(j, n):
            r = ranks[m]
            if r != owner and r not in done and rows[r][0] > depth:
                return float(r)
        return math.inf

    def next_use(self, meta: Any, depth: int) -> float:
        """Arrival rank of the next request to hit block ``depth`` of ``meta``'s request; ``inf`` for none."""
        owner = self.rank.get(row_key(meta)) if meta.session_id is not None else None
        if owner is None:
            return math.inf
        _, full, per, hashes = self.rows[owner]
        k = depth // per
        if depth < full and k < len(hashes):
            lid = (hashes[k], k)
            ranks = self._by_hash.get(lid, ())
        else:  # past the prompt: only the session's (later) turns extend it
            lid = meta.session_id
            ranks = self._by_session.get(lid, ())
        return self._first(lid, ranks, owner, depth) if ranks else math.inf


class HindsightOraclePolicy(Policy):
    """True lengths for admission (SRPT), Belady's next use for eviction, pins for known returns."""

    name = "oracle"
    version = "1"
    uses_admission = True
    uses_retention = True
    uses_eviction = True
    uses_events = True
    #: A reference, not deployable: its look-ups may take longer than a serving
    #: policy's (an overrun would silently turn it into LRU for that step). The
    #: simulator charges engine time by its cost model, not by wall time. Above the
    #: simulator's own budget (simulator.config.SIM_DECISION_BUDGET_S): at 0.1 s, on a
    #: loaded 2-core machine 32 of 1,816 steps of a 32B agentic run fell back to LRU.
    decision_budget_s = 10.0

    def __init__(
        self,
        admission: str = "srpt",
        max_ttl_s: float = 60.0,
        ttl_margin_s: float = 0.5,
        demote_unused: bool = False,
        length_predictor: Any = "oracle",
        reuse_predictor: Any = "oracle",
        eviction: str = "prefix",
        workload: Any = None,
    ) -> None:
        if eviction not in EVICTION_MODES:
            raise ValueError(f"option eviction must be one of {', '.join(EVICTION_MODES)}, got {eviction!r}")
        if eviction == "block" and workload is None:
            raise ValueError("eviction='block' needs the simulated workload (its hash chains)")
        if admission == "chain" and workload is None:
            raise ValueError("admission='chain' needs the simulated workload (its sessions' later turns)")
        if admission not in ADMISSION_RULES:
            raise ValueError(f"option admission must be one of {', '.join(ADMISSION_RULES)}, got {admission!r}")
        for name, v in (("max_ttl_s", max_ttl_s), ("ttl_margin_s", ttl_margin_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"option {name} must be a finite number >= 0, got {v!r}")
        self.admission = admission
        self.uses_admission = admission != "fcfs"
        self.max_ttl_s = float(max_ttl_s)
        self.ttl_margin_s = float(ttl_margin_s)
        self.demote_unused = bool(demote_unused)
        self.lengths = resolve_length_predictor(length_predictor, workload, policy=type(self).__name__)
        self.reuse = resolve_reuse_predictor(reuse_predictor, workload, policy=type(self).__name__)
        self.eviction = eviction
        self.blocks = BlockNextUse(workload) if eviction == "block" else None
        self.later = later_output(workload) if admission == "chain" else {}

    # ------------------------------------------------------------ admission
    def remaining(self, waiting: Sequence[CandidateRequest]) -> list[float]:
        """True remaining output tokens (inf when the workload does not know the request)."""
        preds = self.lengths.predict(waiting)
        return [max(0.0, float(p[0]) - c.num_output_tokens) for c, p in zip(waiting, preds)]

    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        if self.admission == "fcfs" or not waiting:
            return None
        rem = self.remaining(waiting)
        if self.admission == "chain":  # the session's remaining output, this turn and every later one: longest first
            later = self.later
            rem = [r + later.get(row_key(c.meta), 0) for c, r in zip(waiting, rem)]
        if self.admission in ("lpt", "chain"):
            # longest first; unknown lengths (inf) go last, in arrival order
            keys = [(0 if math.isfinite(r) else 1, -r if math.isfinite(r) else 0.0, c.arrival_s, i)
                    for i, (c, r) in enumerate(zip(waiting, rem))]
        else:
            keys = [(0, r, c.arrival_s, i) for i, (c, r) in enumerate(zip(waiting, rem))]
        keys.sort()
        return AdmissionDecision(order=[waiting[k[-1]].request_id for k in keys])

    # ------------------------------------------------------------ retention
    def retain(self, prefixes: Sequence[CachedPrefix], state: EngineState) -> Optional[RetentionDecision]:
        if not prefixes:
            return None
        now = state.time_s
        nxt = self.reuse.next_use_s(prefixes, now)
        actions: dict[str, Retention] = {}
        release = []
        for p, t in zip(prefixes, nxt):
            dt = t - now
            if p.protected_until_s is not None:
                if not dt <= self.max_ttl_s:
                    release.append(p.prefix_id)
                elif t + self.ttl_margin_s > p.protected_until_s:
                    actions[p.prefix_id] = Retention(RetentionAction.PROTECT, ttl_s=max(dt, 0.0) + self.ttl_margin_s)
                continue
            if p.owner_state is OwnerState.PAUSED_TOOL and dt <= self.max_ttl_s:
                actions[p.prefix_id] = Retention(RetentionAction.PROTECT, ttl_s=max(dt, 0.0) + self.ttl_margin_s)
            elif self.demote_unused and math.isinf(t):
                actions[p.prefix_id] = Retention(RetentionAction.DEMOTE)
        if not actions and not release:
            return None
        return RetentionDecision(actions=actions, release=frozenset(release))

    # ------------------------------------------------------------- eviction
    def evict(self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int, state: EngineState):
        if not prefixes:
            return None
        if self.blocks is None:
            return EvictionDecision(order=furthest_first(prefixes, self.reuse.next_use_s(prefixes, state.time_s)))
        nxt = self.blocks.next_use
        keys = [nxt(p.meta, t) if t < p.num_blocks else -math.inf for p, t in zip(prefixes, tail_starts(prefixes))]
        return EvictionDecision(order=furthest_first(prefixes, keys))

    def evict_host(self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int, state: EngineState):
        """Belady on the CPU tier: the owner used furthest in the future leaves first (a store further off is
        skipped); used by ``oracle-offload`` (:attr:`uses_host_eviction`)."""
        if not prefixes:
            return None
        return EvictionDecision(order=furthest_first(prefixes, self.reuse.next_use_s(prefixes, state.time_s)))

    def on_event(self, event: Event) -> None:
        self.reuse.observe(event)
        if self.blocks is not None:
            self.blocks.observe(event)
        obs = getattr(self.lengths, "observe", None)
        if obs is not None:
            obs(event)
