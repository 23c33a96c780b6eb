"""The learned policy's hot-path sorts (policy.learned.sorting) give numpy's orders, in Python below PY_SORT_MAX."""

from __future__ import annotations

import numpy as np
import pytest

from policy.learned import sorting
from policy.learned.features import FEATURES, X, set_features
from policy.learned.sorting import PY_SORT_MAX, ascending, descending, first_come, oldest_first


def _numpy_descending(keys: np.ndarray, take: int, skip: list[int]) -> list[int]:
    k = -keys.astype(np.float64)
    k[skip] = np.inf
    return [i for i in np.argsort(k, kind="stable").tolist() if i not in set(skip)][:take]


@pytest.mark.parametrize("n", [0, 1, 7, 40, PY_SORT_MAX + 5])
def test_descending_is_numpys_stable_order_ties_by_position_nan_last(n: int) -> None:
    rng = np.random.default_rng(n)
    for trial in range(20):
        keys = rng.integers(0, 5, n).astype(np.float64)  # many ties
        if n and trial % 3 == 0:
            keys[rng.integers(0, n, 2)] = np.nan
        if n and trial % 4 == 0:
            keys[rng.integers(0, n)] = -np.inf
        skip = sorted(set(rng.integers(0, n, min(n, 3)).tolist())) if n and trial % 2 else []
        take = int(rng.integers(0, n + 2))
        assert descending(keys, take, skip) == _numpy_descending(keys, take, skip), (keys, take, skip)


@pytest.mark.parametrize("n", [0, 1, 9, 60, PY_SORT_MAX + 3])
def test_ascending_and_oldest_first_are_numpys_orders(n: int) -> None:
    """``ascending`` is a stable argsort (NaN last); ``oldest_first`` is lexsort by age, then key descending, then
    position (NaN keys last within their age)."""
    rng = np.random.default_rng(100 + n)
    for trial in range(20):
        keys = rng.integers(0, 4, n).astype(np.float64)
        if n and trial % 3 == 0:
            keys[rng.integers(0, n, 2)] = np.nan
        age = rng.integers(0, 3, n).astype(np.float64)
        assert ascending(keys) == np.argsort(keys, kind="stable").tolist(), keys
        assert oldest_first(age, keys) == np.lexsort((np.arange(n), -keys, age)).tolist(), (age, keys)


def test_first_come_orders_by_step_then_time_then_position(monkeypatch) -> None:
    steps, times = np.array([5.0, 3, 3, 5, 1]), np.array([1.0, 9.0, 2.0, 1.0, 0.5])
    pos = np.array([9, 4, 6, 2, 7])
    expected = pos[np.lexsort((pos, times, steps))].tolist()
    assert first_come(pos, steps, times) == expected == [7, 6, 4, 2, 9]
    monkeypatch.setattr(sorting, "PY_SORT_MAX", 2)  # numpy's lexsort past the limit: the same order
    assert first_come(pos, steps, times) == expected


def test_the_hot_path_never_calls_numpys_sorts(monkeypatch) -> None:
    """Below the limit no numpy sort runs (each would release the GIL inside vLLM's engine core)."""
    def refused(*args, **kwargs):
        raise AssertionError("a numpy sort in the hot path")

    for name in ("argsort", "lexsort", "argpartition"):
        monkeypatch.setattr(np, name, refused)
    keys = np.array([3.0, 1.0, 3.0, np.nan, 2.0])
    assert descending(keys, 4, [1]) == [0, 2, 4, 3]
    assert first_come(np.array([1, 0]), np.array([2.0, 1.0]), np.array([0.0, 0.0])) == [0, 1]
    assert ascending(keys) == [1, 4, 0, 2, 3]
    assert oldest_first(np.array([1.0, 0, 1, 0, 0]), keys) == [4, 1, 3, 0, 2]
    x = np.zeros((3, len(FEATURES)))
    set_features(x, np.array([2.0, 0.5, 1.0]))
    assert x[:, X["rank_pred_remaining"]].tolist() == [1.0, 0.0, 0.5]
