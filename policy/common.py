"""Helpers shared by kvpilot's policies (the baselines and the learned policy).

* :func:`resolve_length_predictor` turns the ``length_predictor`` option (a name
  or a predictor object) into a :class:`policy.predictors.LengthPredictor`.
* :class:`LengthCache` predicts each request once (on first sight) and again
  only when its group's information changes (a sibling finished), so a policy
  never re-predicts every waiting request every engine step.
* :func:`remaining_tokens` turns a (p50, p90) prediction into the predicted
  remaining output of a request that has already generated some tokens.
* :func:`group_key` / :func:`group_size` give every request a group: its
  ``group_id``, or a group of its own when it has none (no metadata must never
  make a policy fail).
* :class:`PredictedLengthPolicy` is the base of the baselines that rank by
  predicted length: it owns the predictor and the cache, caches each request's
  rank key (:meth:`PredictedLengthPolicy.cached_keys`, recomputed only when the
  request's group counts or output change), and forwards events to the
  predictor (the per-domain mean learns from ``FINISHED`` events).
* :func:`admission_limit` / :func:`top_ids`: an admission order lists only as
  many requests as vLLM can admit in the step (a partial selection, not a full
  sort of thousands of waiting requests).
* :func:`furthest_first` orders prefixes by predicted next use, the furthest
  first (never used = ``inf`` first), ties broken by LRU (least recently
  freed first), then by id, so an order is deterministic.

Everything here is plain Python and cheap: dictionary look-ups per candidate
and at most one ``predict`` call per engine step, over the requests not seen
before (about 2-4 ms per step for 6,400 waiting requests on one core).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any, Optional

from policy.interface import CachedPrefix, CandidateRequest, EngineState, Event, EventKind, Policy
from policy.predictors import LENGTH_PREDICTOR, UNKNOWN, LengthPredictor, resolve_predictor

__all__ = [
    "resolve_length_predictor",
    "LengthCache",
    "remaining_tokens",
    "group_key",
    "group_size",
    "group_progress",
    "PredictedLengthPolicy",
    "admission_limit",
    "top_ids",
    "furthest_first",
]

def resolve_length_predictor(spec: Any, workload: Any = None, *, policy: str = "policy") -> LengthPredictor:
    """The ``length_predictor`` option's predictor: ``"oracle"`` (true lengths from ``workload``; a hindsight
    reference), ``"domain-mean"`` (no training) or an object with ``predict(requests)`` (the LightGBM model)."""
    return resolve_predictor(LENGTH_PREDICTOR, spec, workload, policy=policy)


def admission_limit(state: EngineState, n: int) -> int:
    """How many waiting requests an admission order needs to list this step.

    vLLM admits at most ``max_num_running - num_running`` requests in a step, so
    the order lists twice that plus a margin (vLLM may skip some, e.g. those
    whose grammar is not ready); the rest keep vLLM's order and are ranked
    again at the next step. This keeps a step's cost O(n log k), not
    O(n log n), with thousands of waiting requests.
    """
    slots = max(1, state.max_num_running - state.num_running)
    return min(n, 2 * slots + 8)


def top_ids(keys: list, limit: int) -> list[str]:
    """Request ids (the last element of each key) of the ``limit`` smallest keys, in order."""
    if limit >= len(keys):
        keys = sorted(keys)
    else:
        keys = heapq.nsmallest(limit, keys)
    return [k[-1] for k in keys]


def to_front(seq: Any, picked: Sequence[int]) -> Any:
    """``seq`` (a list or a tuple) with the items at places ``picked`` first, in that order, then the rest in their
    own: what an admission order does to a queue. The rest is copied in slices between the picked places."""
    out = type(seq)(seq[i] for i in picked)
    start = 0
    for i in sorted(picked):
        out += seq[start:i]
        start = i + 1
    return out + seq[start:]


def shifted(last: Sequence[Any], now: Sequence[Any], within: int = 16) -> int:
    """How many items left the head of ``last`` when ``now`` is what stayed of it followed by new items (``last[k:]``
    then a tail); -1 otherwise, or where more than ``within`` left. Items compare by identity first (C slices)."""
    n = len(last)
    if not n or not now:
        return -1
    head = now[0]
    for k in range(min(n, within)):
        if last[k] is head:
            return k if now[:n - k] == last[k:] else -1
    return -1


def _as_time(x: Any) -> float:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return math.inf
    return math.inf if math.isnan(f) else f


def furthest_first(prefixes: Sequence[CachedPrefix], next_uses: Sequence[float]) -> list[str]:
    """Prefix ids, the furthest predicted next use first; ties: least recently freed first."""
    if len(next_uses) != len(prefixes):
        raise ValueError(f"reuse predictor returned {len(next_uses)} values for {len(prefixes)} prefixes")
    keyed = sorted(  # (a float that is not NaN is its own time: no conversion, the common case)
        ((-(t if type(t) is float and t == t else _as_time(t)), p.last_used_s, p.prefix_id)
         for p, t in zip(prefixes, next_uses)),
    )
    return [pid for _, _, pid in keyed]


def _as_float(x: Any) -> float:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return UNKNOWN
    return UNKNOWN if math.isnan(f) else f


class LengthCache:
    """Per-request (p50, p90) predictions, computed once and refreshed on group change.

    An entry is keyed by request id and stamped with the request's
    ``group_finished`` count: when a sibling finishes (new
    ``sibling_output_tokens``, the strongest feature of a learned predictor),
    the entry is recomputed; otherwise it is reused. A new turn is a new
    request, so it is predicted on first sight. :meth:`forget` drops a finished
    request; the cache is also bounded (``max_entries``; the oldest half goes
    when it is full), so it stays small even without events.
    """

    __slots__ = ("predictor", "max_entries", "_cache", "rows_predicted", "predict_calls")

    def __init__(self, predictor: LengthPredictor, max_entries: int = 1 << 17) -> None:
        self.predictor = predictor
        self.max_entries = int(max_entries)
        #: request id -> (group_finished, p50, p90, remaining output before the first token)
        self._cache: dict[str, tuple[int, float, float, float]] = {}
        #: Counters (tests and benchmarks): rows sent to the predictor, and calls.
        self.rows_predicted = 0
        self.predict_calls = 0

    def __len__(self) -> int:
        return len(self._cache)

    def lookup(self, cands: Sequence[CandidateRequest]) -> list[tuple[float, float]]:
        """(p50, p90) for each candidate; one ``predict`` call for the misses, if any."""
        cache = self._cache
        out: list[Any] = [None] * len(cands)
        miss: list[int] = []
        for i, c in enumerate(cands):
            e = cache.get(c.request_id)
            if e is not None and e[0] == c.group_finished:
                out[i] = (e[1], e[2])
            else:
                miss.append(i)
        if miss:
            rows = [cands[i] for i in miss]
            preds = self.predictor.predict(rows)
            self.predict_calls += 1
            self.rows_predicted += len(rows)
            if len(preds) != len(rows):
                raise ValueError(f"length predictor returned {len(preds)} predictions for {len(rows)} requests")
            if len(cache) + len(rows) > self.max_entries:
                for k in list(islice(cache, max(len(cache) // 2, 1))):
                    del cache[k]
            for i, c, p in zip(miss, rows, preds):
                try:
                    p50, p90 = _as_float(p[0]), _as_float(p[1])
                except (TypeError, IndexError):
                    p50 = p90 = UNKNOWN
                if p90 < p50:
                    p90 = p50
                cache[c.request_id] = (c.group_finished, p50, p90, remaining_tokens(p50, p90, 0, c.max_tokens))
                out[i] = (p50, p90)
        return out

    def remaining(self, cands: Sequence[CandidateRequest]) -> list[float]:
        """Predicted remaining output of each candidate (:func:`remaining_tokens`), from the cache."""
        get = self._cache.get
        out: list[Any] = []
        miss = False
        for c in cands:
            e = get(c.request_id)
            if e is not None and e[0] == c.group_finished:
                o = c.num_output_tokens
                out.append(e[3] if not o else remaining_tokens(e[1], e[2], o, c.max_tokens))
            else:
                out.append(None)
                miss = True
        if miss:
            idx = [i for i, r in enumerate(out) if r is None]
            sub = [cands[i] for i in idx]
            for i, c, (p50, p90) in zip(idx, sub, self.lookup(sub)):
                out[i] = remaining_tokens(p50, p90, c.num_output_tokens, c.max_tokens)
        return out

    def forget(self, request_id: str) -> None:
        self._cache.pop(request_id, None)


def remaining_tokens(p50: float, p90: float, generated: int, max_tokens: int) -> float:
    """Predicted output still to come for a request that generated ``generated`` tokens.

    ``p50 - generated`` while the request is below its median; past the median,
    ``p90 - generated``; past p90 (deep in the tail), ``p90 - p50`` more (at
    least one token). Always capped by what ``max_tokens`` still allows, so an
    unknown prediction (inf) ranks by the request's remaining budget (inf only
    when ``max_tokens`` is unknown too).
    """
    cap = float(max(0, max_tokens - generated)) if max_tokens and max_tokens > 0 else UNKNOWN
    if generated < p50:
        r = p50 - generated
    elif generated < p90:
        r = p90 - generated
    else:
        r = max(p90 - p50, 1.0)
    return float(min(r, cap))


def group_key(c: CandidateRequest) -> tuple[str, str]:
    """The request's group: its ``group_id``, or a group of its own."""
    gid = c.meta.group_id
    return ("g", gid) if gid is not None else ("r", c.request_id)


def group_size(c: CandidateRequest) -> Optional[int]:
    """The group's size: ``group_size``, 1 without a group, None when a group has no size."""
    if c.meta.group_id is None:
        return 1
    n = c.meta.group_size
    return n if n and n > 0 else None


def group_progress(c: CandidateRequest, count_running: bool = False) -> float:
    """Fraction of the request's group already finished (and, optionally, running), 0..1.

    Without a group size the fraction is ``done / (done + 1)`` (grows with the
    number of finished siblings); without a group it is 0.
    """
    if c.meta.group_id is None:
        return 0.0
    done = c.group_finished + (c.group_running if count_running else 0)
    n = group_size(c)
    if n is None:
        return done / (done + 1.0)
    return min(1.0, done / n)


class PredictedLengthPolicy(Policy):
    """Base of the baselines that rank by predicted length.

    Owns the predictor (``self.predictor``) and its :class:`LengthCache`
    (``self.lengths``). It declares ``uses_events`` so finished requests leave
    the cache and the predictor sees events (``observe``).
    """

    uses_events = True

    def __init__(self, length_predictor: Any = "oracle", workload: Any = None) -> None:
        self.predictor = resolve_length_predictor(length_predictor, workload, policy=type(self).__name__)
        self.lengths = LengthCache(self.predictor)
        #: request id -> (group_finished, group_running, generated, rank key); see cached_keys
        self._keys: dict[str, tuple] = {}
        self._observe = getattr(self.predictor, "observe", None)
        if not callable(self._observe):
            self._observe = None

    def remaining(self, cands: Sequence[CandidateRequest]) -> list[float]:
        """Predicted remaining output tokens of each candidate (see :func:`remaining_tokens`)."""
        return self.lengths.remaining(cands)

    def cached_keys(self, cands: Sequence[CandidateRequest], compute: Callable[[list], list]) -> list:
        """Per-request rank keys, recomputed (by ``compute(stale_cands)``) only when the
        request's group counts or its generated tokens changed since the last call."""
        cache = self._keys
        get = cache.get
        keys: list[Any] = []
        stale: Optional[list[int]] = None
        for i, c in enumerate(cands):
            e = get(c.request_id)
            if e is not None and e[0] == c.group_finished and e[1] == c.group_running and e[2] == c.num_output_tokens:
                keys.append(e[3])
            else:
                keys.append(None)
                if stale is None:
                    stale = []
                stale.append(i)
        if stale:
            sub = [cands[i] for i in stale]
            if len(cache) + len(sub) > self.lengths.max_entries:
                for k in list(islice(cache, max(len(cache) // 2, 1))):
                    del cache[k]
            for i, c, k in zip(stale, sub, compute(sub)):
                cache[c.request_id] = (c.group_finished, c.group_running, c.num_output_tokens, k)
                keys[i] = k
        return keys

    def on_event(self, event: Event) -> None:
        if self._observe is not None:
            self._observe(event)
        if event.kind is EventKind.FINISHED:
            self.lengths.forget(event.request_id)
            self._keys.pop(event.request_id, None)
