"""Version-aware eviction for asynchronous RL that keeps stale KV (``keep`` weight updates).

**Idea and source.** With in-flight weight updates that keep the old KV (SkyRL, prime-rl, PipelineRL, NeMo RL),
the prefix cache is salted by the weight version at which a group started (vLLM's ``cache_salt``), so several
versions live in the pool at once and a block of one version can only be hit by requests of that version. Once
no live trajectory started at a version, its blocks can never be hit again; LRU still keeps them while it
evicts a live session's context.

**Mechanism as implemented.** On the eviction lever: the cached prefixes whose owner's
``weight_version`` (``kvpilot_weight_version``) no live session holds are listed first (least recently freed
first); the rest keep vLLM's LRU order. A session is live from its first request until one of its requests
finishes with a reason other than ``tool_call`` (its last turn); a version is live while one of its sessions
is. Prefixes without a version (a synchronous run) are never listed, so the policy is LRU there.

**Simplified.** A trajectory's scoring requests after its last turn are not tracked (they hit the same
version's blocks); no option. Deterministic (propensity 1.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from policy.interface import CachedPrefix, EngineState, Event, EventKind, EvictionDecision, Policy


class VersionAwareEvictionPolicy(Policy):
    """Evict first the cached prefixes of weight versions no live session holds (see the module docstring)."""

    name = "version-aware"
    uses_eviction = True
    uses_events = True

    def __init__(self) -> None:
        self._session_version: dict[str, int] = {}  # live session -> its weight version
        self._live: dict[int, int] = {}  # version -> live sessions

    def on_event(self, event: Event) -> None:
        meta = event.meta
        session, version = meta.session_id, meta.weight_version
        if session is None or version is None:
            return
        if event.kind is EventKind.ARRIVED and session not in self._session_version:
            self._session_version[session] = version
            self._live[version] = self._live.get(version, 0) + 1
        elif event.kind is EventKind.FINISHED and event.finish_reason not in ("tool_call", "abort", None) \
                and session in self._session_version:
            v = self._session_version.pop(session)
            self._live[v] -= 1

    def live_versions(self) -> set[int]:
        return {v for v, n in self._live.items() if n > 0}

    def evict(self, prefixes: Sequence[CachedPrefix], num_blocks_needed: int, state: EngineState
              ) -> Optional[EvictionDecision]:
        live = self.live_versions()
        dead = [p for p in prefixes if p.meta.weight_version is not None and p.meta.weight_version not in live]
        if not dead:
            return None
        return EvictionDecision(order=[p.prefix_id for p in sorted(dead, key=lambda p: (p.last_used_s,
                                                                                           p.prefix_id))])
