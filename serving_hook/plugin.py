"""vLLM general plugin: with ``KVPILOT_ENABLE=1`` the engine builds the kvpilot hook as its scheduler; else inert.

Entry point ``kvpilot = serving_hook.plugin:register`` in the ``vllm.general_plugins`` group. vLLM calls
:func:`register` in every process (front end, engine core, workers) before ``EngineCore.__init__`` resolves the
scheduler class with ``SchedulerConfig.get_scheduler_cls()``. The plugin wraps that one method: when no
``--scheduler-cls`` was given (``scheduler_cls is None``) it returns ``KVPilotAsyncScheduler`` under async
scheduling and ``KVPilotScheduler`` otherwise; an explicit ``--scheduler-cls`` still wins. It also validates the
hook's environment first, so a bad ``KVPILOT_*`` value fails at start-up with a message naming it.

In a server configured with the hook (``KVPILOT_ENABLE=1``, or ``--scheduler-cls serving_hook.*`` on its command
line) the plugin also exports ``kvpilot_hook_info{policy="..."} 1`` in the process's Prometheus registry, so
the API server's ``/metrics`` tells a client (``kvpilot replay``) that the hook runs.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence

from serving_hook.config import HookConfigError, load_config

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def enabled(env: Optional[dict] = None) -> bool:
    """``KVPILOT_ENABLE`` as a boolean; :class:`HookConfigError` for a value that is neither."""
    raw = (os.environ if env is None else env).get("KVPILOT_ENABLE", "").strip().lower()
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise HookConfigError(f"kvpilot: KVPILOT_ENABLE must be 1 or 0, got {raw!r}")


def scheduler_cls_arg(argv: Sequence[str]) -> Optional[str]:
    """The value of ``--scheduler-cls`` (or ``--scheduler_cls``) on a command line, None when absent."""
    for i, arg in enumerate(argv):
        for flag in ("--scheduler-cls", "--scheduler_cls"):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg[len(flag) + 1 :]
    return None


def advertise() -> None:
    """``kvpilot_hook_info{policy} 1`` in this process's Prometheus registry (once; nothing if it cannot be)."""
    try:
        from prometheus_client import REGISTRY, Gauge

        if "kvpilot_hook_info" in getattr(REGISTRY, "_names_to_collectors", {}):
            return
        policy = (os.environ.get("KVPILOT_POLICY") or "vllm-default").strip()
        Gauge("kvpilot_hook_info", "The kvpilot scheduler hook runs in this server's engine", ["policy"]).labels(
            policy=policy).set(1)
    except Exception:  # noqa: BLE001 -- no prometheus_client, or registered already: the server runs on
        pass


def register() -> None:
    """Install the hook as vLLM's default scheduler class when ``KVPILOT_ENABLE=1`` (idempotent)."""
    cls = scheduler_cls_arg(sys.argv)
    on = enabled()
    if on or (cls is not None and cls.startswith("serving_hook.")):
        advertise()
    if not on:
        return
    load_config()  # fail now, loudly, on a bad KVPILOT_* value
    from vllm.config.scheduler import SchedulerConfig

    stock = SchedulerConfig.get_scheduler_cls
    if getattr(stock, "kvpilot_installed", False):
        return  # vLLM may load plugins more than once per process

    def get_scheduler_cls(self: Any) -> type:
        if self.scheduler_cls is not None:
            return stock(self)
        from serving_hook.scheduler import KVPilotAsyncScheduler, KVPilotScheduler

        return KVPilotAsyncScheduler if self.async_scheduling else KVPilotScheduler

    get_scheduler_cls.kvpilot_installed = True  # type: ignore[attr-defined]
    get_scheduler_cls.__doc__ = stock.__doc__
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls  # type: ignore[method-assign]
