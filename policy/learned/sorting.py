"""The hot path's sorts, with the GIL kept.

numpy's sorts (``argsort``, ``argpartition``, ``lexsort``, and ``isin`` through them) release the GIL whatever the
size of the array. Inside vLLM's engine core the API server's socket threads are waiting for it, and take it for up
to a switch interval (5 ms) before the scheduler gets it back: on vLLM's CPU server a step that sorted its queue
this way cost the learned policy up to 3 ms. A queue of a few hundred candidates sorts in Python's ``sorted`` in
microseconds, which keeps the GIL; longer ones take numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: 0, -1, -2, ...: admission keys (higher first) that keep the queue's order, read as slices by :func:`queue_keys`.
_QUEUE_KEYS = -np.arange(4096, dtype=np.float64)
_QUEUE_KEYS.flags.writeable = False


def queue_keys(n: int) -> np.ndarray:
    """Keys that keep the queue's order for ``n`` candidates (a read-only view). ``np.arange`` fills its array with
    the GIL released, and inside vLLM's engine core a GIL released for a microsecond goes to vLLM's socket threads
    for up to a millisecond (docs/results/2026-12-07-real-engine-engine-preset.md), so the hot path slices this."""
    global _QUEUE_KEYS
    if n > len(_QUEUE_KEYS):
        keys = -np.arange(1 << (n - 1).bit_length(), dtype=np.float64)
        keys.flags.writeable = False
        _QUEUE_KEYS = keys
    return _QUEUE_KEYS[:n]


#: Longest queue sorted in Python; above it numpy's sorts run (with the GIL released).
PY_SORT_MAX = 512


def descending(keys: np.ndarray, take: int, skip: Sequence[int] = ()) -> list[int]:
    """The positions of the ``take`` highest ``keys``, highest first, ties in position order, leaving out
    ``skip``; a key that is not a number ranks last (numpy's order)."""
    n = len(keys)
    if n > PY_SORT_MAX:
        k = -np.asarray(keys, dtype=np.float64)
        if len(skip):
            k[list(skip)] = np.inf
        top = np.argsort(k, kind="stable")[:take + len(skip)]
        left = set(skip)
        return [i for i in top.tolist() if i not in left][:take]
    values = keys.tolist()
    if any(v != v for v in values):  # NaN: after every number, as numpy sorts it
        values = [(True, v) if v == v else (False, 0.0) for v in values]
    rank = sorted(range(n), key=values.__getitem__, reverse=True)  # stable: ties keep their positions
    if len(skip):
        left = set(skip)
        rank = [i for i in rank if i not in left]
    return rank[:take]


def ascending(keys: np.ndarray) -> list[int]:
    """All positions by ascending ``keys``, ties in position order; a key that is not a number ranks last (numpy's
    stable ``argsort``)."""
    if len(keys) > PY_SORT_MAX:
        return np.argsort(keys, kind="stable").tolist()
    values = keys.tolist()
    if any(v != v for v in values):
        values = [(False, v) if v == v else (True, 0.0) for v in values]
    return sorted(range(len(values)), key=values.__getitem__)


def oldest_first(age: np.ndarray, keys: np.ndarray) -> list[int]:
    """Positions by ascending ``age``, then descending ``keys``, then position (``lexsort((-position, -keys,
    age))``)."""
    n = len(keys)
    if n > PY_SORT_MAX:
        return np.lexsort((np.arange(n), -keys, age)).tolist()
    neg = (-keys).tolist()
    if any(v != v for v in neg):  # NaN: after every number of its age, as lexsort puts it
        key = [(a, v != v, 0.0 if v != v else v) for a, v in zip(age.tolist(), neg)]
    else:
        key = list(zip(age.tolist(), neg))
    return sorted(range(n), key=key.__getitem__)


def first_come(positions: np.ndarray, steps: np.ndarray, times: np.ndarray) -> list[int]:
    """``positions`` ordered by when each (re-)entered the queue: its engine step (``steps``), then time
    (``times``), then the position."""
    if len(positions) > PY_SORT_MAX:
        return positions[np.lexsort((positions, times, steps))].tolist()
    key = list(zip(steps.tolist(), times.tolist(), positions.tolist()))
    return [k[2] for k in sorted(key)]
