"""Every hyper-parameter of offline policy learning (:mod:`policy.learning.offline`), as one record."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Optional

from policy.learned.policy import RUNTIME_DEFAULTS

__all__ = ["OfflineConfig"]

_INF = float("inf")
#: (field, lowest, highest) of each numeric hyper-parameter; a positive bound is the smallest value that works
_RANGES: tuple[tuple[str, float, float], ...] = (
    ("epochs", 1, _INF), ("batch_decisions", 1, _INF), ("lr", 1e-12, _INF), ("weight_decay", 0, _INF),
    ("temperature", 1e-6, _INF), ("dr_weight", 0, _INF), ("propensity_clip", 1e-12, 1), ("imitation_weight", 0, _INF),
    ("imitation_temperature", 1e-6, _INF), ("ridge", 0, _INF), ("reward_window_s", 1e-9, _INF),
    ("max_decisions", 1, _INF), ("max_candidates", 1, _INF), ("holdout_fraction", 0, 0.99), ("seed", 0, 2**63 - 1),
    ("threads", 1, 1024),
)


@dataclass
class OfflineConfig:
    """Every hyper-parameter of offline policy learning (stored in the POLICY_DIR manifest)."""

    hidden: tuple[int, ...] = (32, 32)
    epochs: int = 10
    batch_decisions: int = 256
    lr: float = 3e-3
    weight_decay: float = 1e-4
    #: the softmax temperature of the policy being optimised (and of log mode)
    temperature: float = 1.0
    objective: str = "dr"  # "dr" or "ips"
    dr_weight: float = 1.0
    propensity_clip: float = 0.01
    imitation_weight: float = 1.0
    imitation_temperature: float = 0.25
    oracle_rule: str = "lpt"  # "lpt" or "srpt"
    ridge: float = 1.0
    reward_window_s: float = 5.0
    max_decisions: int = 20_000
    max_candidates: int = 256
    holdout_fraction: float = 0.25
    #: a control (tests, promotion gates): rewards permuted across decisions and the hindsight
    #: labels across candidate rows, so nothing learned comes from outcomes
    shuffle_rewards: bool = False
    seed: int = 0
    #: torch threads while fitting. 1: a batch is ~10k rows x 32 units, where intra-op threads cost more than they
    #: give (measured on a shared 2-core machine: 4.2 s CPU per epoch with 1 thread, 17.1 s with 2)
    threads: int = 1
    #: whether the trained policy chooses preemption victims with its preemption head (``policy.json``'s runtime
    #: option ``preempt``). None (default): when the logs hold preemption decisions, i.e. every lever found in the
    #: logs is learned; False: vLLM's own victim (the tail of the running list), whose victims recompute about half
    #: what the head's do (docs/results). The head is trained either way.
    preempt: Optional[bool] = None
    #: whether the trained policy runs over vLLM's CPU offload tier (``policy.json``'s runtime option ``offload``).
    #: None (default): when the logs were taken over one (their ``steps`` stored blocks to it), so the plain recipe
    #: (``simulate --policy logging``, whose exploring policy uses the tier, then ``train``) serves over the tier.
    offload: Optional[bool] = None
    #: the trained policy's GPU eviction order (``policy.json``'s runtime option ``gpu_eviction``). None (default):
    #: "async" where some log comes from the async driver (the youngest group's contexts leave first, under
    #: asynchronous RL only), else the runtime's (vLLM's LRU).
    gpu_eviction: Optional[bool | str] = None
    runtime: dict = field(default_factory=lambda: dict(RUNTIME_DEFAULTS))

    def __post_init__(self) -> None:
        for name, low, high in _RANGES:  # each number's type and range, in the field's own name
            v = getattr(self, name)
            kind = int if isinstance(getattr(OfflineConfig, name), int) else float
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
                raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
            if not low <= v <= high:
                want = ("> 0" if 0 < low < 1e-5 else f">= {low:g}") + (f" and <= {high:g}" if high < _INF else "")
                raise ValueError(f"{name} must be {want}, got {v!r}")
        if not isinstance(self.shuffle_rewards, bool):
            raise ValueError(f"shuffle_rewards must be true or false, got {self.shuffle_rewards!r}")
        for name in ("preempt", "offload"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be true or false, or null (from the logs), got {v!r}")
        if not (self.gpu_eviction is None or isinstance(self.gpu_eviction, bool) or self.gpu_eviction == "async"):
            raise ValueError(f"gpu_eviction must be true, false, \"async\" or null (from the logs), "
                             f"got {self.gpu_eviction!r}")
        if not isinstance(self.runtime, dict):
            raise ValueError(f"runtime must be an object of runtime options, got {self.runtime!r}")
        if not isinstance(self.hidden, (list, tuple)) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in self.hidden):
            raise ValueError(f"hidden must be a list of layer widths >= 1, got {self.hidden!r}")
        if self.objective not in ("dr", "ips"):
            raise ValueError(f"objective must be 'dr' or 'ips', got {self.objective!r}")
        if self.oracle_rule not in ("lpt", "srpt"):
            raise ValueError(f"oracle_rule must be 'lpt' or 'srpt', got {self.oracle_rule!r}")
        self.hidden = tuple(int(h) for h in self.hidden)

    @classmethod
    def from_json(cls, text: str | None) -> OfflineConfig:
        """A config from a JSON object of its fields (None or empty: the defaults); a bad one raises
        :class:`ValueError` naming the fields."""
        if not text:
            return cls()
        try:
            values = json.loads(text)
        except ValueError as err:
            raise ValueError(f"not valid JSON: {err}") from None
        if not isinstance(values, dict):
            raise ValueError(f"must be a JSON object of OfflineConfig fields, got {type(values).__name__}")
        try:
            return cls(**values)
        except (ValueError, TypeError) as err:
            known = ", ".join(f.name for f in fields(cls))
            raise ValueError(f"{err} (OfflineConfig fields: {known})") from None
