"""The learned policy's default admission order in one compiled pass: the few waiting requests with the least
predicted remaining output first.

:meth:`policy.learned.table.FeatureTable.shortest` calls it in every admission decision. The order is what
:meth:`~policy.learned.table.FeatureTable.remaining`, :meth:`~policy.learned.table.FeatureTable.first` and
:meth:`policy.learned.sampler.Sampler._order` give with a dozen numpy calls over the queue (a gather, a cast, the
remaining output, the keys with their tie-break, the starvation clocks and their minimum, a partition and a sort),
each cold in the CPU caches inside vLLM's step: about 100 µs a decision at 128 running agent sessions, a third of
it. Here one loop reads each row once. Where something goes before the order (a preempted or a starved request) or
a value is not a number it answers -1 and the caller takes the numpy path, which gives the same order from the
same table.
"""

from __future__ import annotations

import logging
import math

import numpy as np

try:  # numba ships with vLLM; without it the numpy path runs
    import numba
except ImportError:  # pragma: no cover
    numba = None

#: Longest order the loop keeps by insertion (an order lists 2 x the free slots + 8); longer ones take numpy's sort.
MAX_TAKE = 32


def _shortest_first(idx: np.ndarray, lr: np.ndarray, preempted: np.ndarray, since_step: np.ndarray,
                    since_s: np.ndarray, now_step: float, now_s: float, max_steps: float, max_s: float,
                    check_preempted: bool, top: np.ndarray, keys: np.ndarray, oldest: np.ndarray) -> int:
    """Write into ``top`` the places (in ``idx``) of the ``len(top)`` rows with the highest key, highest first, and
    return how many: a row's key is ``-expm1(float32(lr))`` (its predicted remaining output, as the scorer reads it)
    minus its place times 1e-9 (the queue's order breaks ties). On the way, start the starvation clock of the rows
    without one (``since_step``, ``since_s``: engine step, time) and write the oldest start of each into ``oldest``.

    -1: a preempted row (with ``check_preempted``), a starved one (waited ``max_steps`` steps or ``max_s`` seconds),
    or a key that is not a number; the clocks are then partly started (the numpy path starts the rest)."""
    n = idx.shape[0]
    oldest_step = math.inf
    oldest_s = math.inf
    for i in range(n):
        r = idx[i]
        if check_preempted and preempted[r]:
            return -1
        if since_step[r] != since_step[r]:
            since_step[r] = now_step
            since_s[r] = now_s
        if since_step[r] < oldest_step:
            oldest_step = since_step[r]
        if since_s[r] < oldest_s:
            oldest_s = since_s[r]
    oldest[0] = oldest_step
    oldest[1] = oldest_s
    if not (now_step - oldest_step < max_steps and now_s - oldest_s < max_s):
        return -1
    take = top.shape[0]
    got = 0
    for i in range(n):
        key = -math.expm1(np.float64(np.float32(lr[idx[i]]))) - i * 1e-9
        if key != key:
            return -1
        if got < take:
            j = got
            got += 1
        elif key > keys[take - 1]:
            j = take - 1
        else:
            continue
        while j > 0 and keys[j - 1] < key:
            keys[j] = keys[j - 1]
            top[j] = top[j - 1]
            j -= 1
        keys[j] = key
        top[j] = i
    return got


_compiled = numba.njit(cache=False)(_shortest_first) if numba is not None else None
_warm = False


def compiled_shortest_first():
    """The compiled :func:`_shortest_first` (compiled on the first call, not inside a scheduler step); None without
    numba, or where it does not compile (logged once: the numpy path runs)."""
    global _compiled, _warm
    if _compiled is not None and not _warm:
        try:
            _compiled(np.zeros(1, np.int64), np.zeros(1), np.zeros(1, bool), np.full(1, math.nan), np.full(1, math.nan),
                      0.0, 0.0, math.inf, math.inf, True, np.empty(1, np.int64), np.empty(1), np.empty(2))
        except Exception as e:  # never into the policy's construction: the numpy path gives the same order
            logging.getLogger(__name__).warning("kvpilot: the compiled admission order is off (%s: %s)",
                                                type(e).__name__, e)
            _compiled = None
        _warm = True
    return _compiled
