"""Scheduler classes for tests that drive vLLM's real scheduler through the hook."""

from __future__ import annotations

from typing import Any


def hook_scheduler(policy: Any, **cfg: Any) -> type:
    """``KVPilotScheduler`` running ``policy``; a generous budget so a loaded machine never forces a fallback."""
    from serving_hook import KVPilotScheduler, with_policy
    from serving_hook.config import HookConfig

    cfg.setdefault("decision_budget_s", 10.0)
    return with_policy(KVPilotScheduler, lambda: policy, HookConfig(**cfg))


def stock_scheduler() -> type:
    """vLLM's own v1 ``Scheduler``."""
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler
