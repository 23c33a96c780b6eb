"""Reuse learning online from a run's own past (after LRB): a sliding window of labels, periodic LightGBM retraining.

Made for eviction on traces without session ids (Mooncake), where the only
signals are recency, frequency and the hash chains themselves. Everything is
learned from what the eviction lever and the events show, with no training data:

* **Objects and uses.** A cached prefix's *key* is its leading block hash, as
  in :mod:`predictors.features` when no group id is known (and as the
  hindsight oracle's next use is defined). A request's chain becomes known
  when its prefix is first offered to ``evict()`` (the first step that evicts
  after it finished); its first scheduling (the ``SCHEDULED`` event) is then a
  *use* of its key at that time. Uses are learned late, never early.
* **Samples and labels.** At each eviction call, ``samples_per_call`` random
  candidates are snapshotted (features at that time ``t``). A snapshot is
  labelled 1 as soon as a use of its key by another request, scheduled in
  ``(t, t + horizon_s]``, is learned (with ``label_depth`` > 0, only a use
  whose chain shares at least that fraction of the prefix's cached blocks:
  the deep blocks are the ones eviction takes first); 0 once ``now >= t + horizon_s`` and no
  request scheduled by ``t + horizon_s`` is still unknown (every such request
  had its chain offered, or finished before the previous call and was never
  offered). So a label is formed only from what was known when it was formed;
  :attr:`OnlineReuseLearner.labelled` keeps ``(t, formed_s, label, use_s)``
  for the tests to check that.
* **Retraining.** The last ``window`` labels train a LightGBM classifier of
  P(use within ``horizon_s``) every ``retrain_every`` new labels, with few
  trees and ``num_threads`` threads (default 1), synchronously inside the
  eviction call (its time is measured and counted in :attr:`stats`). A window
  with one class, or any training error, is counted in ``train_failures`` and
  leaves the current model (none before the first success: the policy keeps
  LRU).

Features (:data:`ONLINE_REUSE_FEATURES`), all from the known past: the key's
uses so far (``hits``), time since its last use or since the prefix was freed,
LRB's gaps between the last uses, decayed use counters (half-lives of
:data:`predictors.features.EDC_HALF_LIVES_S`); the prefix's cached length,
prompt and output tokens, time since it was freed; and chain features: how
many known chains contain its leading block (``fanout``), and how deep its
chain is shared with another known chain (``shared_depth`` in blocks,
``shared_frac``), counted on every ``chain_stride``-th block.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import lightgbm as lgb
import numpy as np

from policy.interface import CachedPrefix, Event, EventKind
from predictors.features import EDC_HALF_LIVES_S

__all__ = ["ONLINE_REUSE_FEATURES", "OnlineReuseLearner", "OnlineReuseStats"]

ONLINE_REUSE_FEATURES: tuple[str, ...] = (
    "n_blocks", "prompt_tokens", "output_tokens", "idle_s", "hits", "since_use", "gap1", "gap2", "gap3",
    "edc_10", "edc_60", "edc_600", "fanout", "shared_depth", "shared_frac",
)
_RATES = np.log(2) / np.asarray(EDC_HALF_LIVES_S)
TRAIN_PARAMS: dict[str, Any] = {
    "objective": "binary", "learning_rate": 0.1, "num_leaves": 15, "max_bin": 63,
    "feature_fraction": 1.0, "lambda_l2": 1.0, "verbose": -1, "seed": 0, "deterministic": True,
}


class _Key:
    """Uses of one key (leading block): count, last few times, decayed counters at the latest use."""

    __slots__ = ("hits", "uses", "last", "edc")

    def __init__(self) -> None:
        self.hits = 0
        self.uses: list[float] = []  # the last few use times, sorted
        self.last = -math.inf
        self.edc = np.zeros(len(_RATES))

    def add(self, t: float) -> None:
        """A use at ``t`` (possibly learned after later ones: the decayed sum stays exact)."""
        self.hits += 1
        if t >= self.last:
            self.edc = 1.0 + (self.edc * np.exp(-_RATES * (t - self.last)) if self.hits > 1 else 0.0)
            self.last = t
        else:
            self.edc = self.edc + np.exp(-_RATES * (self.last - t))
        self.uses.append(t)
        self.uses.sort()
        if len(self.uses) > 3:
            del self.uses[0]


@dataclass
class _Sample:
    key: int
    owner: str
    t: float
    x: list[float]
    chain: tuple = ()
    label: Optional[float] = None


def _shared(chain: Sequence[int], other: set) -> int:
    """Leading blocks of ``chain`` in ``other`` (chained hashes: a shared block's whole prefix is shared)."""
    lo, hi = 0, len(chain)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chain[mid - 1] in other:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class OnlineReuseStats:
    """Counters and timings of an :class:`OnlineReuseLearner` (seconds are wall time)."""

    calls: int = 0
    samples: int = 0
    labels: int = 0
    positives: int = 0
    retrains: int = 0
    train_failures: int = 0
    retrain_s: list[float] = field(default_factory=list)
    score_calls: int = 0
    score_s: float = 0.0
    observe_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        r = self.retrain_s
        return {
            "calls": self.calls, "samples": self.samples, "labels": self.labels, "positives": self.positives,
            "retrains": self.retrains, "train_failures": self.train_failures,
            "retrain_mean_s": float(np.mean(r)) if r else 0.0, "retrain_max_s": max(r) if r else 0.0,
            "retrain_total_s": float(sum(r)), "score_calls": self.score_calls,
            "score_mean_s": self.score_s / self.score_calls if self.score_calls else 0.0,
            "observe_mean_s": self.observe_s / self.calls if self.calls else 0.0,
        }


class OnlineReuseLearner:
    """Learns P(a cached prefix's key is used again within ``horizon_s``) from the run itself; see the module doc."""

    def __init__(self, horizon_s: float = 30.0, window: int = 4096, retrain_every: int = 512,
                 min_labels: int = 256, samples_per_call: int = 8, num_trees: int = 32, num_threads: int = 1,
                 chain_stride: int = 8, label_depth: float = 0.0, seed: int = 0) -> None:
        for name, v in (("horizon_s", horizon_s),):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"option {name} must be a finite number > 0, got {v!r}")
        for name, v in (("window", window), ("retrain_every", retrain_every), ("min_labels", min_labels),
                        ("samples_per_call", samples_per_call), ("num_trees", num_trees),
                        ("num_threads", num_threads), ("chain_stride", chain_stride)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"option {name} must be a positive integer, got {v!r}")
        if isinstance(label_depth, bool) or not isinstance(label_depth, (int, float)) or not 0 <= label_depth <= 1:
            raise ValueError(f"option label_depth must be a number in [0, 1], got {label_depth!r}")
        self.horizon_s = float(horizon_s)
        self.label_depth = float(label_depth)
        self.retrain_every, self.min_labels = retrain_every, min_labels
        self.samples_per_call, self.num_trees = samples_per_call, num_trees
        self.num_threads, self.chain_stride = num_threads, chain_stride
        self.rng = random.Random(seed)
        self.model: Optional[lgb.Booster] = None
        self.stats = OnlineReuseStats()
        self.window: deque[tuple[list[float], float]] = deque(maxlen=window)
        #: (t, formed_s, label, use_s) of every label formed, for checks (use_s: the use that made it 1).
        self.labelled: deque[tuple[float, float, float, float]] = deque(maxlen=100_000)
        self.last_error: Optional[str] = None  # why the last retraining failed
        self._keys: dict[int, _Key] = {}
        self._nodes: dict[int, int] = {}  # strided chain block hash -> known chains containing it
        self._known: set[str] = set()  # requests whose chain was learned
        self._sched: dict[str, float] = {}  # request -> first scheduled time
        self._done: dict[str, tuple[float, int, int]] = {}  # request -> (finish, prompt, output tokens)
        self._unresolved: dict[str, float] = {}  # scheduled, chain not learned yet -> scheduled time
        self._pending: deque[_Sample] = deque()  # unlabelled snapshots, oldest first
        self._pending_by_key: dict[int, list[_Sample]] = {}
        self._new_labels = 0
        self._last_call_s = -math.inf

    # ------------------------------------------------------------------ events
    def observe(self, event: Event) -> None:
        rid = event.request_id
        if event.kind is EventKind.SCHEDULED:
            if rid not in self._sched:
                self._sched[rid] = event.time_s
                if rid not in self._known:
                    self._unresolved[rid] = event.time_s
        elif event.kind is EventKind.FINISHED:
            self._done[rid] = (event.time_s, event.num_prompt_tokens, event.num_output_tokens)

    # ------------------------------------------------------------------ one eviction call
    def observe_candidates(self, prefixes: Sequence[CachedPrefix], now_s: float) -> None:
        """Learn the offered chains, form due labels, snapshot a few candidates, retrain when due."""
        t0 = time.perf_counter()
        self.stats.calls += 1
        for p in prefixes:
            if p.owner_request_id not in self._known and p.block_hashes:
                self._learn_chain(p, now_s)
        # requests that finished before the previous call and were never offered will not be
        for rid in [r for r in self._unresolved if self._done.get(r, (math.inf,))[0] < self._last_call_s]:
            del self._unresolved[rid]
        self._close_negatives(now_s)
        if prefixes:
            k = min(self.samples_per_call, len(prefixes))
            for p in self.rng.sample(list(prefixes), k):
                s = _Sample(int(p.block_hashes[0]), p.owner_request_id, now_s, self.features(p, now_s),
                            p.block_hashes if self.label_depth > 0 else ())
                self._pending.append(s)
                self._pending_by_key.setdefault(s.key, []).append(s)
                self.stats.samples += 1
        self._last_call_s = now_s
        self.stats.observe_s += time.perf_counter() - t0
        if self._new_labels >= self.retrain_every and len(self.window) >= self.min_labels:
            self.retrain()

    def _learn_chain(self, p: CachedPrefix, now_s: float) -> None:
        rid = p.owner_request_id
        self._known.add(rid)
        self._unresolved.pop(rid, None)
        hashes = p.block_hashes
        for h in hashes[:: self.chain_stride]:
            self._nodes[h] = self._nodes.get(h, 0) + 1
        key = int(hashes[0])
        use = self._sched.get(rid, p.last_used_s)
        self._keys.setdefault(key, _Key()).add(use)
        mine = set(hashes) if self.label_depth > 0 else None
        for s in self._pending_by_key.get(key, ()):
            if s.label is None and s.owner != rid and s.t < use <= s.t + self.horizon_s:
                if mine is None or _shared(s.chain, mine) >= self.label_depth * len(s.chain):
                    self._label(s, 1.0, now_s, use)
        lst = self._pending_by_key.get(key)
        if lst is not None:
            lst[:] = [s for s in lst if s.label is None]
            if not lst:
                del self._pending_by_key[key]

    def _close_negatives(self, now_s: float) -> None:
        horizon = self.horizon_s
        oldest_unknown = min(self._unresolved.values(), default=math.inf)
        q = self._pending
        while q and (q[0].label is not None or (q[0].t + horizon <= now_s and q[0].t + horizon < oldest_unknown)):
            s = q.popleft()
            if s.label is None:
                self._label(s, 0.0, now_s, math.nan)
                lst = self._pending_by_key.get(s.key)
                if lst is not None:
                    lst[:] = [x for x in lst if x is not s]
                    if not lst:
                        del self._pending_by_key[s.key]

    def _label(self, s: _Sample, y: float, now_s: float, use_s: float) -> None:
        s.label = y
        self.window.append((s.x, y))
        self.labelled.append((s.t, now_s, y, use_s))
        self._new_labels += 1
        self.stats.labels += 1
        self.stats.positives += int(y)

    # ------------------------------------------------------------------ features and scores
    def features(self, p: CachedPrefix, now_s: float) -> list[float]:
        """:data:`ONLINE_REUSE_FEATURES` of one prefix at ``now_s`` (known past only)."""
        nan = math.nan
        hashes = p.block_hashes
        n = len(hashes)
        k = self._keys.get(int(hashes[0])) if n else None
        fin, prompt, out = self._done.get(p.owner_request_id, (p.last_used_s, nan, nan))
        freed = p.last_used_s
        if k is not None and k.hits:
            last = k.last
            gaps, prev = [nan, nan, nan], now_s
            for j, u in enumerate(reversed(k.uses)):
                gaps[j] = prev - u
                prev = u
            edc = (k.edc * np.exp(-_RATES * max(now_s - last, 0.0))).tolist()
            hits = float(k.hits)
        else:
            last, gaps, edc, hits = -math.inf, [nan, nan, nan], [0.0] * len(_RATES), 0.0
        nodes, stride = self._nodes, self.chain_stride
        fanout = float(nodes.get(hashes[0], 0)) if n else 0.0
        depth = 0
        for j in range(0, n, stride):
            if nodes.get(hashes[j], 0) < 2:
                break
            depth = min(j + stride, n)
        return [float(n), float(prompt), float(out), now_s - freed, hits, now_s - max(last, freed), *gaps, *edc,
                fanout, float(depth), depth / n if n else 0.0]

    def reuse_probability(self, prefixes: Sequence[CachedPrefix], now_s: float) -> Optional[np.ndarray]:
        """P(use within the horizon) per prefix; ``None`` before the first model."""
        if self.model is None:
            return None
        t0 = time.perf_counter()
        X = np.asarray([self.features(p, now_s) for p in prefixes], dtype=np.float64).reshape(-1, len(ONLINE_REUSE_FEATURES))
        out = self.model.predict(X, num_threads=self.num_threads) if len(X) else np.empty(0)
        self.stats.score_calls += 1
        self.stats.score_s += time.perf_counter() - t0
        return out

    def next_use_s(self, prefixes: Sequence[CachedPrefix], now_s: float) -> list[float]:
        """:class:`policy.predictors.ReusePredictor`: a next-use time that only ranks (``now + H / p``); inf before a model."""
        p = self.reuse_probability(prefixes, now_s)
        if p is None:
            return [math.inf] * len(prefixes)
        return [now_s + self.horizon_s / max(float(x), 1e-9) for x in p]

    # ------------------------------------------------------------------ training
    def retrain(self) -> bool:
        """Fit a fresh classifier on the window; ``False`` (counted) when the window is degenerate or fitting fails."""
        self._new_labels = 0
        t0 = time.perf_counter()
        try:
            y = np.fromiter((lab for _, lab in self.window), float, len(self.window))
            if len(y) == 0 or y.min() == y.max():
                raise ValueError(f"the label window holds one class only ({len(y)} labels)")
            X = np.asarray([x for x, _ in self.window], dtype=np.float32)
            # leaves of at least 20 labels, fewer while the window is small (a warm-up of a few hundred)
            params = {**TRAIN_PARAMS, "num_threads": self.num_threads, "min_data_in_leaf": max(2, min(20, len(y) // 10))}
            ds = lgb.Dataset(X, label=y, feature_name=list(ONLINE_REUSE_FEATURES), free_raw_data=True)
            self.model = lgb.train(params, ds, self.num_trees)
        except Exception as e:  # never into the engine: keep the current model (or LRU), count it
            self.stats.train_failures += 1
            self.last_error = repr(e)
            return False
        finally:
            self.stats.retrain_s.append(time.perf_counter() - t0)
        self.stats.retrains += 1
        return True
