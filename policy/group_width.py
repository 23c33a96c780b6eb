"""kvpilot's rollout width: keep GRPO groups in flight while their predicted working set fits in memory.

Where memory binds, the asynchronous rollout's width decides throughput: too few groups leave the engine
idle behind one group's tools, too many evict each other's paused contexts and pay for it in recompute.
AReaL's staleness rule sizes the width from the trainer's batch alone, and prime-rl's KV-pressure controller
from KV use, which stays near full whenever memory binds. kvpilot sizes it from what each session will hold:

* :class:`SessionContexts` predicts a session's peak context (prompt plus output of its last turn) by
  domain, from a prior fitted on logged sessions (:func:`fit_session_contexts`, stored in the learned
  policy's bundle) and refined online by every session that ends;
* :func:`working_set_admits` starts the next group only while the predicted working set of the sessions in
  flight (each at the larger of its context now and its predicted peak) plus the next group's fits in the
  replicas' GPU KV plus their host tier. One group is always allowed, so the rollout never stalls.
* :func:`working_set_holds` then keeps the width right while the groups run: a predicted peak is a domain's
  mean, and a group of long sessions outgrows it. A session's next turn waits while the sessions in flight of
  its own group and every older one do not fit in GPU KV plus the host tier, the oldest group's turns never.
  vLLM's CPU tier writes every block the GPU computes through to host memory, so a running context takes its
  room twice (on the GPU and its host copy, up to the tier's size) and a paused one once. Without the hold the
  youngest group's turns evict the older groups' paused contexts, which return and are recomputed while the
  trainer waits for exactly those older groups. A held turn goes as soon as a session's end makes room.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["SessionContexts", "fit_session_contexts", "working_set_admits", "working_set_holds"]

#: How many ended sessions the logged prior weighs as (online updates move it from there).
PRIOR_WEIGHT = 8.0


def fit_session_contexts(requests: pa.Table) -> dict[str, dict[str, float]]:
    """Per domain, the mean peak context of the logged sessions and their count, from a telemetry ``requests``
    table (``session_id``, ``domain``, ``prompt_tokens``, ``output_tokens``); requests without a session or a
    domain are left out."""
    t = requests.select(["session_id", "domain", "prompt_tokens", "output_tokens"])
    t = t.filter(pc.and_(pc.is_valid(t["session_id"]), pc.is_valid(t["domain"])))
    if t.num_rows == 0:
        return {}
    ctx = pc.add(t["prompt_tokens"].cast(pa.int64()), t["output_tokens"].cast(pa.int64()))
    t = t.append_column("context", ctx)
    peaks = t.group_by(["session_id", "domain"]).aggregate([("context", "max")])
    by_domain = peaks.group_by("domain").aggregate([("context_max", "mean"), ("context_max", "count")])
    return {d: {"mean_peak": float(m), "sessions": float(n)}
            for d, m, n in zip(by_domain["domain"].to_pylist(), by_domain["context_max_mean"].to_pylist(),
                               by_domain["context_max_count"].to_pylist())}


class SessionContexts:
    """A session's predicted peak context (tokens) by domain: the logged prior, refined by ended sessions.

    ``prior``: :func:`fit_session_contexts`'s output (may be empty); a domain it does not know is predicted at
    the prior's mean over its sessions until sessions of it end, and with no prior at all at ``fallback`` (e.g.
    the largest context a request may reach).
    """

    def __init__(self, prior: Mapping[str, Mapping[str, Any]] | None, fallback: float) -> None:
        prior = prior or {}
        logged = sum(float(s["sessions"]) for s in prior.values())
        self.fallback = (sum(float(s["mean_peak"]) * float(s["sessions"]) for s in prior.values()) / logged
                         if logged else float(fallback))
        self._sum: dict[str, float] = {}
        self._n: dict[str, float] = {}
        for domain, s in prior.items():
            n = min(float(s["sessions"]), PRIOR_WEIGHT)
            self._sum[domain], self._n[domain] = float(s["mean_peak"]) * n, n

    def predict(self, domain: str) -> float:
        """The predicted peak context of a session of ``domain``."""
        n = self._n.get(domain)
        return self._sum[domain] / n if n else self.fallback

    def observe(self, domain: str, peak: int) -> None:
        """A session of ``domain`` ended at ``peak`` tokens of context."""
        self._sum[domain] = self._sum.get(domain, 0.0) + peak
        self._n[domain] = self._n.get(domain, 0.0) + 1.0


def working_set_admits(in_flight_tokens: float, next_tokens: float, capacity_tokens: float,
                       groups_in_flight: int) -> bool:
    """Whether the next group may start: its predicted working set and that of the groups in flight fit in
    ``capacity_tokens`` (GPU KV plus host tier), or no group is in flight."""
    return groups_in_flight == 0 or in_flight_tokens + next_tokens <= capacity_tokens


def working_set_holds(contexts: float, running: float, gpu_kv_tokens: int, tier_tokens: int, oldest: bool) -> bool:
    """Whether a session's next turn waits: the sessions in flight of its group and every older group, with
    ``contexts`` tokens of context now, ``running`` of them in sessions on the engine (the turn to send
    included), do not fit in ``gpu_kv_tokens`` plus ``tier_tokens`` (a running context's host copy counts too,
    up to the tier's size), and its group is not the oldest in flight."""
    return not oldest and contexts + min(running, tier_tokens) > gpu_kv_tokens + tier_tokens
