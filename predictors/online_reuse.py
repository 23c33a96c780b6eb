"""Reuse learning online from a run's own past (after LRB): a sliding window of labels, periodic LightGBM retraining.

Made for eviction on traces without session ids (Mooncake), where the only
signals are recency, frequency and the hash chains themselves. Everything is
learned from what the eviction lever and the events show, with no training data:

* **Objects and uses.** The eviction lever moves a prefix's *tail* (the
  blocks past those it shares with other cached prefixes), so the object
  scored is the tail, keyed by a *node*: the hash of its first block, rounded
  down the chain to the next recorded one (every ``chain_stride``-th block
  and each chain's last block are recorded). A request's chain becomes known
  when its prefix is first offered to ``evict()`` (the first step that evicts
  after it finished); its first scheduling (the ``SCHEDULED`` event) is then
  a *use* of every recorded node of its chain at that time. Uses are learned
  late, never early.
* **Samples and labels.** At each eviction call, ``samples_per_call`` random
  candidates are snapshotted (features at that time ``t``). A snapshot is
  labelled 1 as soon as a use of its node by another request, scheduled in
  ``(t, t + horizon_s]``, is learned; 0 once ``now >= t + horizon_s`` and no
  request scheduled by ``t + horizon_s`` is still unknown (every such request
  had its chain offered, or finished before the previous call and was never
  offered). So a label is formed only from what was known when it was formed;
  :attr:`OnlineReuseLearner.labelled` keeps ``(t, formed_s, label, use_s)``
  for the tests to check that.
* **Retraining.** The last ``window`` labels train a LightGBM classifier of
  P(use within ``horizon_s``) every ``retrain_every`` new labels, with few
  trees and ``num_threads`` threads (default 1). By default synchronously
  inside the eviction call (deterministic; its time is measured in
  :attr:`stats`); with ``background=True`` on one worker thread (LightGBM
  releases the GIL while it fits): the window is copied on the engine thread,
  and the new booster is swapped in at the first eviction call after the fit
  ends (one fit at a time; :meth:`wait` adopts one in flight). A window with
  one class, or any training error, is counted in ``train_failures`` and
  leaves the current model (none before the first success: the policy keeps
  LRU).
* **Memory.** A server runs for days: what the learner keeps per request (its first scheduling, its finish,
  whether its chain is known) and per recorded node (its uses) is bounded by ``max_requests`` and
  ``max_nodes``. Past a bound, half the bound is kept: the requests seen last, the nodes used most recently
  (a node used again later starts afresh).

Features (:data:`ONLINE_REUSE_FEATURES`), all from the known past: the tail
node's uses so far (``hits``), time since its last use or since the prefix was
freed, LRB's gaps between the last uses, decayed use counters (half-lives of
:data:`predictors.features.EDC_HALF_LIVES_S`); the leading block's uses
(``lead_hits``, ``lead_since_use``); the prefix's cached length, its tail's
start and length, prompt and output tokens, time since it was freed (``hits``
also counts the known chains through the tail node).
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import lightgbm as lgb
import numpy as np

from data.records import CachedPrefix, Event, EventKind, tail_starts
from predictors.features import EDC_HALF_LIVES_S

__all__ = ["ONLINE_REUSE_FEATURES", "OnlineReuseLearner", "OnlineReuseStats"]

ONLINE_REUSE_FEATURES: tuple[str, ...] = (
    "n_blocks", "tail_start", "tail_blocks", "prompt_tokens", "output_tokens", "idle_s", "hits", "since_use",
    "gap1", "gap2", "gap3", "edc_10", "edc_60", "edc_600", "lead_hits", "lead_since_use",
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
    label: Optional[float] = None


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
                 chain_stride: int = 8, background: bool = False, seed: int = 0, max_requests: int = 200_000,
                 max_nodes: int = 200_000) -> None:
        for name, v in (("horizon_s", horizon_s),):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"option {name} must be a finite number > 0, got {v!r}")
        for name, v in (("window", window), ("retrain_every", retrain_every), ("min_labels", min_labels),
                        ("samples_per_call", samples_per_call), ("num_trees", num_trees),
                        ("num_threads", num_threads), ("chain_stride", chain_stride), ("max_requests", max_requests),
                        ("max_nodes", max_nodes)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"option {name} must be a positive integer, got {v!r}")
        self.horizon_s = float(horizon_s)
        self.retrain_every, self.min_labels = retrain_every, min_labels
        self.samples_per_call, self.num_trees = samples_per_call, num_trees
        self.num_threads, self.chain_stride = num_threads, chain_stride
        self.max_requests, self.max_nodes = max_requests, max_nodes
        self.rng = random.Random(seed)
        self.model: Optional[lgb.Booster] = None
        self.stats = OnlineReuseStats()
        self.window: deque[tuple[list[float], float]] = deque(maxlen=window)
        #: (t, formed_s, label, use_s) of every label formed, for checks (use_s: the use that made it 1).
        self.labelled: deque[tuple[float, float, float, float]] = deque(maxlen=100_000)
        self.last_error: Optional[str] = None  # why the last retraining failed
        self._keys: dict[int, _Key] = {}  # recorded node (block hash) -> its uses
        self._known: dict[str, None] = {}  # requests whose chain was learned (an ordered set: oldest first)
        self._sched: dict[str, float] = {}  # request -> first scheduled time
        self._done: dict[str, tuple[float, int, int]] = {}  # request -> (finish, prompt, output tokens)
        self._unresolved: dict[str, float] = {}  # scheduled, chain not learned yet -> scheduled time
        self._pending: deque[_Sample] = deque()  # unlabelled snapshots, oldest first
        self._pending_by_key: dict[int, list[_Sample]] = {}
        self._new_labels = 0
        self._last_call_s = -math.inf
        #: with ``background``, fits run on one worker thread and the booster is swapped in at a later call
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvpilot-lrb-fit") if background else None
        self._training: Optional[Future] = None

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
    def node(self, hashes: Sequence[int], start: int) -> int:
        """The recorded node standing for the tail that starts at block ``start`` (``start < len(hashes)``)."""
        k = -(-start // self.chain_stride) * self.chain_stride
        return int(hashes[k] if k < len(hashes) else hashes[-1])

    def observe_candidates(self, prefixes: Sequence[CachedPrefix], tails: Sequence[int], now_s: float) -> None:
        """Learn the offered chains, form due labels, snapshot a few candidates, retrain when due.

        ``tails[i]`` is where prefix ``i``'s tail starts (:func:`data.records.tail_starts`).
        """
        t0 = time.perf_counter()
        self.stats.calls += 1
        for p in prefixes:
            if p.owner_request_id not in self._known and p.block_hashes:
                self._learn_chain(p, now_s)
        # requests that finished before the previous call and were never offered will not be
        for rid in [r for r in self._unresolved if self._done.get(r, (math.inf,))[0] < self._last_call_s]:
            del self._unresolved[rid]
        self._close_negatives(now_s)
        live = [i for i, p in enumerate(prefixes) if tails[i] < len(p.block_hashes)]
        for i in self.rng.sample(live, min(self.samples_per_call, len(live))):
            p, t = prefixes[i], tails[i]
            smp = _Sample(self.node(p.block_hashes, t), p.owner_request_id, now_s, self.features(p, t, now_s))
            self._pending.append(smp)
            self._pending_by_key.setdefault(smp.key, []).append(smp)
            self.stats.samples += 1
        self._last_call_s = now_s
        self._bound()
        self.stats.observe_s += time.perf_counter() - t0
        self._maybe_retrain()

    def _bound(self) -> None:
        """Keep the per-request and per-node records within ``max_requests`` and ``max_nodes`` (module doc)."""
        for d in (self._sched, self._done, self._known, self._unresolved):
            if len(d) > self.max_requests:
                for rid in list(d)[: len(d) - self.max_requests // 2]:  # dicts keep insertion order: oldest first
                    del d[rid]
        if len(self._keys) > self.max_nodes:  # the nodes used most recently stay, ties or not
            items = list(self._keys.items())
            lasts = np.fromiter((k.last for _, k in items), float, len(items))
            newer = np.argpartition(lasts, len(items) - self.max_nodes // 2)[len(items) - self.max_nodes // 2:]
            self._keys = dict(items[i] for i in np.sort(newer).tolist())

    def _learn_chain(self, p: CachedPrefix, now_s: float) -> None:
        rid = p.owner_request_id
        self._known[rid] = None
        self._unresolved.pop(rid, None)
        hashes = p.block_hashes
        use = self._sched.get(rid, p.last_used_s)
        nodes = list(hashes[:: self.chain_stride])
        if (len(hashes) - 1) % self.chain_stride:
            nodes.append(hashes[-1])
        pending = self._pending_by_key
        for h in nodes:
            key = int(h)
            self._keys.setdefault(key, _Key()).add(use)
            lst = pending.get(key)
            if lst is None:
                continue
            for smp in lst:
                if smp.label is None and smp.owner != rid and smp.t < use <= smp.t + self.horizon_s:
                    self._label(smp, 1.0, now_s, use)
            lst[:] = [x for x in lst if x.label is None]
            if not lst:
                del pending[key]

    def _close_negatives(self, now_s: float) -> None:
        horizon = self.horizon_s
        oldest_unknown = min(self._unresolved.values(), default=math.inf)
        q = self._pending
        while q and (q[0].label is not None or (q[0].t + horizon <= now_s and q[0].t + horizon < oldest_unknown)):
            smp = q.popleft()
            if smp.label is None:
                self._label(smp, 0.0, now_s, math.nan)
                lst = self._pending_by_key.get(smp.key)
                if lst is not None:
                    lst[:] = [x for x in lst if x is not smp]
                    if not lst:
                        del self._pending_by_key[smp.key]

    def _label(self, smp: _Sample, y: float, now_s: float, use_s: float) -> None:
        smp.label = y
        self.window.append((smp.x, y))
        self.labelled.append((smp.t, now_s, y, use_s))
        self._new_labels += 1
        self.stats.labels += 1
        self.stats.positives += int(y)

    # ------------------------------------------------------------------ features and scores
    def _uses(self, key: int, since: float, now_s: float) -> list[float]:
        """hits, time since the last use (or ``since``), three gaps and the decayed counters of one node."""
        nan = math.nan
        k = self._keys.get(key)
        if k is None or not k.hits:
            return [0.0, now_s - since, nan, nan, nan, *([0.0] * len(_RATES))]
        gaps, prev = [nan, nan, nan], now_s
        for j, u in enumerate(reversed(k.uses)):
            gaps[j] = prev - u
            prev = u
        edc = (k.edc * np.exp(-_RATES * max(now_s - k.last, 0.0))).tolist()
        return [float(k.hits), now_s - max(k.last, since), *gaps, *edc]

    def features(self, p: CachedPrefix, tail: int, now_s: float) -> list[float]:
        """:data:`ONLINE_REUSE_FEATURES` of the tail of ``p`` starting at block ``tail``, at ``now_s``
        (known past only)."""
        nan = math.nan
        hashes = p.block_hashes
        n = len(hashes)
        _, prompt, out = self._done.get(p.owner_request_id, (p.last_used_s, nan, nan))
        freed = p.last_used_s
        node = self.node(hashes, min(tail, n - 1)) if n else 0
        lead = self._uses(int(hashes[0]), freed, now_s) if n else [0.0, nan]
        return [float(n), float(tail), float(n - tail), float(prompt), float(out), now_s - freed,
                *self._uses(node, freed, now_s), lead[0], lead[1]]

    def reuse_probability(self, prefixes: Sequence[CachedPrefix], tails: Sequence[int],
                          now_s: float) -> Optional[np.ndarray]:
        """P(the tail's node is used within the horizon) per prefix; ``None`` before the first model."""
        if self.model is None:
            return None
        t0 = time.perf_counter()
        X = np.asarray([self.features(p, t, now_s) for p, t in zip(prefixes, tails)], dtype=np.float64)
        X = X.reshape(-1, len(ONLINE_REUSE_FEATURES))
        out = self.model.predict(X, num_threads=self.num_threads) if len(X) else np.empty(0)
        self.stats.score_calls += 1
        self.stats.score_s += time.perf_counter() - t0
        return out

    def next_use_s(self, prefixes: Sequence[CachedPrefix], now_s: float) -> list[float]:
        """:class:`policy.predictors.ReusePredictor`: a next-use time that only ranks
        (``now + H / p``); inf before a model."""
        p = self.reuse_probability(prefixes, tail_starts(prefixes), now_s)
        if p is None:
            return [math.inf] * len(prefixes)
        return [now_s + self.horizon_s / max(float(x), 1e-9) for x in p]

    # ------------------------------------------------------------------ training
    def retrain(self) -> bool:
        """Fit a fresh classifier on the window now; ``False`` (counted) when it is degenerate or fitting fails."""
        self._new_labels = 0
        return self._adopt(self._fit, self._snapshot())

    def _maybe_retrain(self) -> None:
        """Adopt a finished background fit; start a fit (here or in the background) when enough labels came."""
        job = self._training
        if job is not None and job.done():
            self._training = None
            self._adopt(job.result)
        if self._new_labels < self.retrain_every or len(self.window) < self.min_labels:
            return
        if self._executor is None:
            self.retrain()
        elif self._training is None:
            self._new_labels = 0
            self._training = self._executor.submit(self._fit, self._snapshot())

    def wait(self) -> None:
        """Block until a background fit in flight has finished and been adopted (tests, end of run)."""
        if self._training is not None:
            job, self._training = self._training, None
            self._adopt(job.result)

    def _snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        y = np.fromiter((lab for _, lab in self.window), float, len(self.window))
        return np.asarray([x for x, _ in self.window], dtype=np.float32).reshape(-1, len(ONLINE_REUSE_FEATURES)), y

    def _fit(self, data: tuple[np.ndarray, np.ndarray]) -> tuple[lgb.Booster, float]:
        """A classifier fitted on ``(X, y)`` and the seconds it took (raises on a one-class window)."""
        t0 = time.perf_counter()
        X, y = data
        if len(y) == 0 or y.min() == y.max():
            raise ValueError(f"the label window holds one class only ({len(y)} labels)")
        # leaves of at least 20 labels, fewer while the window is small (a warm-up of a few hundred)
        params = {**TRAIN_PARAMS, "num_threads": self.num_threads, "min_data_in_leaf": max(2, min(20, len(y) // 10))}
        ds = lgb.Dataset(X, label=y, feature_name=list(ONLINE_REUSE_FEATURES), free_raw_data=True)
        return lgb.train(params, ds, self.num_trees), time.perf_counter() - t0

    def _adopt(self, fit: Any, *args: Any) -> bool:
        """Swap in the model ``fit(*args)`` gives; on error keep the current one (or LRU) and count it."""
        t0 = time.perf_counter()
        try:
            model, seconds = fit(*args)
        except Exception as e:  # never into the engine
            self.stats.train_failures += 1
            self.stats.retrain_s.append(time.perf_counter() - t0)
            self.last_error = repr(e)
            return False
        self.model = model
        self.stats.retrains += 1
        self.stats.retrain_s.append(seconds)
        return True
