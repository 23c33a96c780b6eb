"""Recency plus FLOPs-saved-per-byte eviction, after Marconi.

**Idea and source.** Marconi (prefix caching for hybrid attention/SSM LLMs,
MLSys'25) evicts by a utility score that mixes recency with *FLOP
efficiency*: the compute a cache hit on the entry saves, per byte of memory
the entry holds. ``score = recency + alpha * flop_efficiency`` (both
normalised over the candidates); the lowest score is evicted. Long prefixes
save super-linearly more compute (attention is quadratic in length) for
linearly more memory, so they are worth more per byte than LRU thinks.
Marconi tunes ``alpha`` online by replaying recent requests.

**Mechanism as implemented.** On kvpilot's eviction lever, for each cached
prefix of ``L = num_blocks * block_size`` tokens:

* FLOPs a hit saves (its prefill from scratch, dense transformer):
  ``2*N*L`` for the GEMMs plus ``4*layers*hidden * L*(L+1)/2`` for attention
  (QK^T and PV over the causal pairs);
* bytes it holds: ``L * kv_bytes_per_token``;
* ``flop_efficiency = FLOPs / bytes = (2N + 2*layers*hidden*(L+1)) / kv_bytes_per_token``,
  which grows with ``L``;
* ``recency`` = the prefix's last use (when it was freed);
* both are min-max normalised to [0, 1] over the candidates, and
  ``score = recency + alpha * flop_efficiency``; prefixes are listed lowest
  score first (all of them), ties broken by LRU.

Defaults are Qwen2.5-7B (28 layers, hidden 3584, 6.53e9 non-embedding
parameters, 4 KV heads x 128 head dim in BF16: 57,344 KV bytes per token),
the simulator's default model; set them as options for another model.

**Simplified.** A fixed ``alpha`` (option, default 1.0) instead of Marconi's
online tuning. For a pure transformer the FLOPs per byte grow only linearly
(and slowly) with length; Marconi's large gains come from SSM layers whose
state has a fixed size. Min-max normalisation makes even small differences in
length count in full against recency (Marconi also normalises). Deterministic
(propensity 1.0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

from policy.interface import CachedPrefix, EngineState, EvictionDecision, Policy
from policy.options import check_count


def _check_positive(name: str, value: Any, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"option {name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"option {name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def _minmax(xs: list[float]) -> list[float]:
    lo, hi = min(xs), max(xs)
    if hi <= lo:
        return [0.0] * len(xs)
    span = hi - lo
    return [(x - lo) / span for x in xs]


class FlopsAwareEvictionPolicy(Policy):
    """Evict the lowest ``recency + alpha * FLOPs-saved-per-byte`` first."""

    name = "marconi"
    version = "1"
    uses_eviction = True

    def __init__(
        self,
        alpha: float = 1.0,
        n_params: float = 6.53e9,
        num_layers: int = 28,
        hidden_size: int = 3584,
        kv_bytes_per_token: float = 57344.0,
        max_candidates: Optional[int] = None,
    ):
        self.alpha = _check_positive("alpha", alpha, allow_zero=True)
        self.n_params = _check_positive("n_params", n_params)
        self.num_layers = check_count("num_layers", num_layers)
        self.hidden_size = check_count("hidden_size", hidden_size)
        self.kv_bytes_per_token = _check_positive("kv_bytes_per_token", kv_bytes_per_token)
        self.max_eviction_candidates = check_count("max_candidates", max_candidates, allow_none=True)

    def prefill_flops(self, num_tokens: int) -> float:
        """FLOPs to prefill ``num_tokens`` tokens from scratch (GEMMs + causal attention)."""
        n = float(num_tokens)
        return 2.0 * self.n_params * n + 4.0 * self.num_layers * self.hidden_size * n * (n + 1.0) / 2.0

    def flops_per_byte(self, num_tokens: int) -> float:
        """FLOPs a hit on a ``num_tokens``-token prefix saves, per byte of KV it holds."""
        if num_tokens <= 0:
            return 0.0
        return self.prefill_flops(num_tokens) / (num_tokens * self.kv_bytes_per_token)

    def scores(self, prefixes: Sequence[CachedPrefix], block_size: int) -> list[float]:
        """``recency + alpha * flop_efficiency`` of each prefix, both min-max normalised."""
        rec = _minmax([float(p.last_used_s) for p in prefixes])
        eff = _minmax([self.flops_per_byte(p.num_blocks * block_size) for p in prefixes])
        a = self.alpha
        return [r + a * e for r, e in zip(rec, eff)]

    def order(self, prefixes: Sequence[CachedPrefix], block_size: int) -> list[str]:
        """All prefix ids, lowest score (evict first) first; ties: least recently freed first."""
        s = self.scores(prefixes, block_size)
        keyed = sorted((sc, p.last_used_s, p.prefix_id) for sc, p in zip(s, prefixes))
        return [pid for _, _, pid in keyed]

    def evict(self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int, state: EngineState):
        if not prefixes:
            return None
        return EvictionDecision(order=self.order(prefixes, state.block_size))
