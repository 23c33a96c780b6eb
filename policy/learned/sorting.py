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


def first_come(positions: np.ndarray, steps: np.ndarray, times: np.ndarray) -> list[int]:
    """``positions`` ordered by when each (re-)entered the queue: its engine step (``steps``), then time
    (``times``), then the position."""
    if len(positions) > PY_SORT_MAX:
        return positions[np.lexsort((positions, times, steps))].tolist()
    key = list(zip(steps.tolist(), times.tolist(), positions.tolist()))
    return [k[2] for k in sorted(key)]
