"""The learned policy's scorer: a small torch MLP, and its forward pass in numpy for the scheduler.

A small MLP (:func:`build_scorer`, torch) maps each candidate's
:data:`policy.learned.features.FEATURES` (its own features, the LightGBM length
model's p50 / p90 and the predicted remaining output, and an engine-state
summary: KV usage, pinned blocks, running / waiting counts, the RL step's
phase) to two scores: one for admission (higher = admitted first) and one for
preemption (higher = the victim). All candidates of a decision go through one
forward pass; inside the scheduler the forward pass runs in numpy from the
torch weights (:class:`NumpyScorer`, the same numbers: a test checks), since
torch's per-call overhead is larger than the MLP itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

from policy.learned.features import FEATURES, STEP_X

__all__ = ["ADMIT", "PREEMPT", "build_scorer", "NumpyScorer"]

#: Score heads of the scorer.
ADMIT, PREEMPT = 0, 1


def build_scorer(n_in: int = len(FEATURES), hidden: Sequence[int] = (32, 32)):
    """A fresh scorer module (torch is imported only here, in the POLICY_DIR I/O and in training)."""
    import torch

    nn = torch.nn

    class Scorer(nn.Module):
        """Standardise, then an MLP with ReLU: (n, n_in) -> (n, 2) scores [admit, preempt]."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", torch.zeros(n_in))
            self.register_buffer("scale", torch.ones(n_in))
            layers: list = []
            d = n_in
            for h in hidden:
                layers += [nn.Linear(d, h), nn.ReLU()]
                d = h
            layers.append(nn.Linear(d, 2))
            self.net = nn.Sequential(*layers)

        def forward(self, x):
            return self.net((x - self.mean) / self.scale)

    return Scorer()


#: Rows per matrix product in :class:`NumpyScorer`: above about this size OpenBLAS starts its threads for these
#: small products, which on a busy machine cost ~100x more (measured: 1.5 ms CPU for 512x32 @ 32x32, 15 us at 256).
BLOCK = 256


class NumpyScorer:
    """The scorer's forward pass in numpy, from its state_dict (serving: no torch call per step)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        def arr(v: Any) -> np.ndarray:
            return np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v, dtype=np.float32)

        self.mean = arr(state["mean"])
        self.inv_scale = 1.0 / arr(state["scale"])
        idx = sorted({int(k.split(".")[1]) for k in state if k.startswith("net.") and k.endswith(".weight")})
        self.layers = [(arr(state[f"net.{i}.weight"]).T.copy(), arr(state[f"net.{i}.bias"])) for i in idx]
        if not self.layers or self.layers[0][0].shape[0] != self.mean.shape[0]:
            raise ValueError("scorer state_dict: layer shapes do not match the feature count")
        if self.layers[-1][0].shape[1] != 2:
            raise ValueError("scorer state_dict: the last layer must have 2 outputs (admit, preempt)")
        # :meth:`head`'s split of the first layer: the STEP_X columns' part (standardisation folded into the
        # weights; the other columns' rows 0, so that one product over the whole input gives it), and the others'
        n = self.n_in
        step = np.array([i for i in STEP_X if i < n], dtype=np.intp)
        const = np.setdiff1d(np.arange(n), step)
        w1, b1 = self.layers[0]
        self._step_w = np.zeros_like(w1)
        self._step_w[step] = w1[step] * self.inv_scale[step, None]
        self._step_b = b1 - (self.mean[step] * self.inv_scale[step]) @ w1[step]
        self._const = const
        self._const_mean, self._const_inv, self._const_w = self.mean[const], self.inv_scale[const], w1[const].copy()
        self._last_heads = [(w[:, h].copy(), b[h:h + 1].copy()) for w, b in self.layers[-1:] for h in range(2)]
        # ReLU's 0 as a row (measured: numpy's maximum against a row is ~1.5x faster than against a scalar)
        self._zeros = [np.zeros(w.shape[1], dtype=np.float32) for w, _ in self.layers]
        self._kept: Optional[tuple[np.ndarray, np.ndarray]] = None  # (input array, its first layer's fixed part)

    @property
    def n_in(self) -> int:
        return int(self.mean.shape[0])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if len(x) <= BLOCK:
            return self._forward(x)
        return np.concatenate([self._forward(x[i:i + BLOCK]) for i in range(0, len(x), BLOCK)])

    def head(self, x: np.ndarray, head: int, kept: bool = False) -> np.ndarray:
        """``self(x)[:, head]`` as float64 (equal within float32 rounding), computing only that head.

        ``kept``: ``x`` may be the array of the last ``kept`` call with only its :data:`STEP_X` columns changed
        since (the feature table's assembled input): then the first layer's part from the other columns,
        ``((x - mean) * inv_scale) @ W1 + b1`` over them, is kept between calls, per array object, and a call
        computes only the step columns' part and the layers after the first (9 numpy calls in all: inside the
        scheduler each costs microseconds, as vLLM's ``schedule()`` leaves numpy's code and data out of the
        CPU caches).
        """
        if len(self.layers) < 2:
            return self(x)[:, head].astype(np.float64)
        x = np.asarray(x, dtype=np.float32)
        k = self._kept
        if kept and k is not None and k[0] is x:
            fixed = k[1]
        else:
            c = x[:, self._const]
            c -= self._const_mean
            c *= self._const_inv
            fixed = _matmul(c, self._const_w)
            fixed += self._step_b
            if kept:
                self._kept = (x, fixed)
        zeros = self._zeros
        h = _matmul(x, self._step_w)
        h += fixed
        np.maximum(h, zeros[0], out=h)
        for i in range(1, len(self.layers) - 1):
            w, b = self.layers[i]
            h = _matmul(h, w)
            h += b
            np.maximum(h, zeros[i], out=h)
        w, b = self._last_heads[head]
        out = _matmul(h, w)
        out += b
        return out.astype(np.float64)

    def _forward(self, x: np.ndarray) -> np.ndarray:
        h = x - self.mean
        h *= self.inv_scale
        last = len(self.layers) - 1
        for i, (w, b) in enumerate(self.layers):
            h = h @ w
            h += b
            if i < last:
                np.maximum(h, 0.0, out=h)
        return h


def _matmul(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``a @ w`` in blocks of :data:`BLOCK` rows (see there)."""
    if len(a) <= BLOCK:
        return a @ w
    return np.concatenate([a[i:i + BLOCK] @ w for i in range(0, len(a), BLOCK)])

