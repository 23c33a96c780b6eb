"""Oldest GRPO group first under asynchronous RL: the groups' start order, for admission and eviction.

An asynchronous trainer consumes finished groups in the order they started (the lowest weight version first),
and the staleness bound lets no new group start until the old ones are trained. A group left behind holds up
the trainer's next batch and, through the bound, the rollout's width; where memory binds, every group in
flight evicts the others' paused contexts. So the learned policy admits the oldest group's requests first and
lets the youngest group's cached contexts leave first (prime-rl trims its youngest episodes near the KV
ceiling for the same reason). A group's age is known where its requests carry the weight version they were
sampled at (``kvpilot_weight_version``, sent by the async driver and by RL frameworks that version their
rollouts); elsewhere (synchronous steps) every request's rank is 0 and nothing changes.
"""

from __future__ import annotations

from policy.interface import RequestMeta

#: Groups kept; beyond it the oldest half is forgotten (their requests rank as new groups if they come back).
MAX_GROUPS = 1 << 16


class GroupAges:
    """Each group's rank in start order (1 for the first group seen), from requests that carry a weight version (with
    ``versioned_only=False``, from every request with a group: the width's ranks, synchronous steps included)."""

    def __init__(self, versioned_only: bool = True) -> None:
        self._rank: dict[str, int] = {}
        self._next = 1
        self.versioned_only = versioned_only

    def rank(self, meta: RequestMeta) -> int:
        """The rank of the request's group in start order; 0 where it has no group, or no weight version where only
        versioned requests rank."""
        r = self.known(meta)
        if r == self._next:  # a group not seen yet: ranked now
            if len(self._rank) >= MAX_GROUPS:
                for old in list(self._rank)[: MAX_GROUPS // 2]:
                    del self._rank[old]
            self._rank[meta.group_id] = r
            self._next += 1
        return r

    def known(self, meta: RequestMeta) -> int:
        """:meth:`rank` without ranking a group not seen yet: such a group counts as the youngest."""
        gid = meta.group_id
        if gid is None or (meta.weight_version is None and self.versioned_only):
            return 0
        return self._rank.get(gid, self._next)
