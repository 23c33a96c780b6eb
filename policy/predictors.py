"""What policies ask of predictors: a response length and a prefix's next use.

Policies hold predictor objects and never know where the numbers come from:
the hindsight oracle (true values from the workload, for reference runs), the
per-domain running mean (a no-training baseline), or the LightGBM models of
:mod:`predictors` (a later issue) that implement the same two protocols.

Requests and prefixes are identified for oracles by ``(session_id, turn)`` from
their metadata, the key a workload row has too (``data.schemas.WORKLOAD``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Optional, Protocol

import pyarrow as pa

from policy.interface import CachedPrefix, CandidateRequest, Event, EventKind, RequestMeta

#: Returned when nothing is known; sorts last for shortest-first policies.
UNKNOWN = math.inf


def row_key(meta: RequestMeta) -> Optional[tuple[str, int]]:
    """The workload row a request's metadata points at, or None without a session."""
    if meta.session_id is None:
        return None
    return meta.session_id, meta.turn or 0


class LengthPredictor(Protocol):
    """Predicts a request's total response length in tokens (p50 and p90)."""

    def predict(self, requests: Sequence[CandidateRequest]) -> list[tuple[float, float]]: ...

    def observe(self, event: Event) -> None: ...


class ReusePredictor(Protocol):
    """Predicts when a cached prefix will next be used (absolute seconds; inf = never)."""

    def next_use_s(self, prefixes: Sequence[CachedPrefix], now_s: float) -> list[float]: ...

    def observe(self, event: Event) -> None: ...


class OracleLengthPredictor:
    """True output lengths from the workload: the hindsight reference, not deployable."""

    def __init__(self, lengths: Mapping[tuple[str, int], int]) -> None:
        self.lengths = dict(lengths)

    @classmethod
    def from_workload(cls, workload: pa.Table) -> "OracleLengthPredictor":
        cols = workload.select(["session_id", "turn", "output_tokens"]).to_pydict()
        return cls({(s, t): o for s, t, o in zip(cols["session_id"], cols["turn"], cols["output_tokens"])})

    def predict(self, requests: Sequence[CandidateRequest]) -> list[tuple[float, float]]:
        out = []
        for r in requests:
            key = row_key(r.meta)
            n = self.lengths.get(key) if key is not None else None
            out.append((float(n), float(n)) if n is not None else (UNKNOWN, UNKNOWN))
        return out

    def observe(self, event: Event) -> None:
        return None


class DomainMeanLengthPredictor:
    """The running mean (and p90 as mean + 1.28 sd) of finished lengths per domain.

    Needs no training and no workload; before a domain has finished anything it
    answers the mean over all domains, or ``prior`` tokens.
    """

    def __init__(self, prior: float = 512.0) -> None:
        self.prior = float(prior)
        self._n: dict[Optional[str], int] = defaultdict(int)
        self._sum: dict[Optional[str], float] = defaultdict(float)
        self._sq: dict[Optional[str], float] = defaultdict(float)

    def _stats(self, domain: Optional[str]) -> tuple[float, float]:
        key = domain if self._n.get(domain) else "__all__"
        n = self._n.get(key, 0)
        if not n:
            return self.prior, self.prior
        mean = self._sum[key] / n
        sd = math.sqrt(max(0.0, self._sq[key] / n - mean * mean))
        return mean, mean + 1.2816 * sd

    def predict(self, requests: Sequence[CandidateRequest]) -> list[tuple[float, float]]:
        return [self._stats(r.meta.domain) for r in requests]

    def observe(self, event: Event) -> None:
        if event.kind is not EventKind.FINISHED or event.finish_reason == "abort":
            return
        x = float(event.num_output_tokens)
        for key in (event.meta.domain, "__all__"):
            self._n[key] += 1
            self._sum[key] += x
            self._sq[key] += x * x
