"""kvpilot's serving hook: the only package that touches vLLM internals.

``vllm serve MODEL --scheduler-cls serving_hook.KVPilotAsyncScheduler`` (or
``serving_hook.KVPilotScheduler`` without async scheduling). Configuration:
environment variables, see :mod:`serving_hook.config`.

The scheduler classes are imported lazily, so ``serving_hook.telemetry`` or
``serving_hook.config`` can be used without importing vLLM.
"""

from typing import Any

from policy.catalog import lazy, register

# The policy that serves the MLflow registry's model (KVPILOT_MODEL_URI), hot-swapped between steps.
register("registry", lazy("serving_hook.model_source:RegistryPolicy"), replace=True)

__all__ = ["KVPilotScheduler", "KVPilotAsyncScheduler", "KVPilotMixin", "with_policy"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from serving_hook import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module 'serving_hook' has no attribute {name!r}")
