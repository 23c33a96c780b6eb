"""The hook's configuration, read from environment variables and checked eagerly.

================================  =============================================
variable                          meaning (default)
================================  =============================================
KVPILOT_POLICY                    policy registry name (``vllm-default``)
KVPILOT_POLICY_OPTIONS            JSON object of keyword options for the policy
KVPILOT_TELEMETRY_DIR             write Parquet telemetry there (off when unset)
KVPILOT_DECISION_BUDGET_MS        per-step budget for policy calls (5 ms)
KVPILOT_MAX_PINNED_FRACTION       cap on blocks pinned for retention (0.25)
KVPILOT_REPLICA                   replica id written in telemetry rows (0)
KVPILOT_MAX_HOLD_S                longest a policy may hold a waiting request
                                  back, counted from its arrival (30 s)
KVPILOT_HOST_LINK_GBPS            host link a CPU offload tier loads over, GB/s
                                  (51.2: PCIe Gen5 x16 at 80 %), for policies'
                                  transfer prices
KVPILOT_MODEL_URI                 policy ``registry``: the model it serves
                                  (``models:/kvpilot@champion``)
KVPILOT_MODEL_POLL_S              policy ``registry``: seconds between polls
                                  for a new version (60; 0: never)
================================  =============================================

:func:`load_config` raises :class:`HookConfigError` naming the variable and
the bad value, and :func:`build_policy` one naming the policy; the scheduler
calls both first thing in its constructor, before vLLM's, so a bad
configuration fails at engine start-up, not deep inside a step. Neither imports
vLLM: :func:`check` runs both, e.g. from a plugin that loads before the engine.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from policy.catalog import UnknownPolicyError, create_policy
from policy.interface import DEFAULT_DECISION_BUDGET_S, Policy

DEFAULT_MAX_PINNED_FRACTION = 0.25
DEFAULT_MODEL_POLL_S = 60.0
DEFAULT_MAX_HOLD_S = 30.0
DEFAULT_HOST_LINK_GBPS = 51.2


class HookConfigError(ValueError):
    """A bad kvpilot hook configuration (raised at scheduler start-up)."""


@dataclass(frozen=True)
class HookConfig:
    policy: str = "vllm-default"
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    telemetry_dir: Optional[str] = None
    decision_budget_s: float = DEFAULT_DECISION_BUDGET_S
    max_pinned_fraction: float = DEFAULT_MAX_PINNED_FRACTION
    replica: int = 0
    #: Policy ``registry``: seconds between registry polls on a background thread (0: load once at start-up).
    #: Serving reads KVPILOT_MODEL_POLL_S (default 60); a ``HookConfig`` built in code (the simulator) polls never.
    model_poll_s: float = 0.0
    #: The starvation bound of admission holds: a request waiting this long is admitted in vLLM's order
    #: whatever the policy holds back (counted as ``hold_overridden``).
    max_hold_s: float = DEFAULT_MAX_HOLD_S
    #: The CPU offload tier: the host link its loads take (GB/s, for the policies' prices in ``EngineState``),
    #: and the bytes of one KV block that transfers are priced and counted by (``None``: vLLM's own; the
    #: simulator gives its simulated model's, since its vLLM runs a tiny stand-in model).
    host_link_gbps: float = DEFAULT_HOST_LINK_GBPS
    kv_block_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or not self.policy.strip():
            raise HookConfigError("kvpilot: the policy name must be a non-empty string")
        if not isinstance(self.policy_options, Mapping):
            raise HookConfigError("kvpilot: policy options must be a mapping")
        b = self.decision_budget_s
        if not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
            raise HookConfigError(f"kvpilot: the decision budget must be > 0 seconds, got {b!r}")
        f = self.max_pinned_fraction
        if not isinstance(f, (int, float)) or not (0.0 <= f <= 1.0):
            raise HookConfigError(f"kvpilot: max pinned fraction must be in [0, 1], got {f!r}")
        if not isinstance(self.replica, int) or self.replica < 0:
            raise HookConfigError(f"kvpilot: replica must be an integer >= 0, got {self.replica!r}")
        p = self.model_poll_s
        if not isinstance(p, (int, float)) or not math.isfinite(p) or p < 0:
            raise HookConfigError(f"kvpilot: the model poll interval must be >= 0 seconds, got {p!r}")
        h = self.max_hold_s
        if not isinstance(h, (int, float)) or not math.isfinite(h) or h < 0:
            raise HookConfigError(f"kvpilot: the max hold time must be >= 0 seconds, got {h!r}")
        kb = self.kv_block_bytes
        if kb is not None and (isinstance(kb, bool) or not isinstance(kb, int) or kb < 1):
            raise HookConfigError(f"kvpilot: the KV block size must be an integer >= 1 bytes, got {kb!r}")
        g = self.host_link_gbps
        if not isinstance(g, (int, float)) or not math.isfinite(g) or g <= 0:
            raise HookConfigError(f"kvpilot: the host link bandwidth must be > 0 GB/s, got {g!r}")


def _float_env(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise HookConfigError(f"kvpilot: {name}={raw!r} is not a number") from None


def load_config(env: Optional[Mapping[str, str]] = None) -> HookConfig:
    """Read and validate the hook configuration from ``env`` (``os.environ``)."""
    env = os.environ if env is None else env
    policy = (env.get("KVPILOT_POLICY") or "vllm-default").strip()

    options: dict[str, Any] = {}
    raw_opts = env.get("KVPILOT_POLICY_OPTIONS")
    if raw_opts and raw_opts.strip():
        try:
            options = json.loads(raw_opts)
        except json.JSONDecodeError as e:
            raise HookConfigError(f"kvpilot: KVPILOT_POLICY_OPTIONS is not valid JSON ({e}): {raw_opts!r}") from None
        if not isinstance(options, dict):
            raise HookConfigError(f"kvpilot: KVPILOT_POLICY_OPTIONS must be a JSON object, got {raw_opts!r}")

    tdir = env.get("KVPILOT_TELEMETRY_DIR") or None
    budget_ms = _float_env(env, "KVPILOT_DECISION_BUDGET_MS", DEFAULT_DECISION_BUDGET_S * 1e3)
    if not math.isfinite(budget_ms) or budget_ms <= 0:
        raise HookConfigError(f"kvpilot: KVPILOT_DECISION_BUDGET_MS must be > 0, got {budget_ms!r}")
    frac = _float_env(env, "KVPILOT_MAX_PINNED_FRACTION", DEFAULT_MAX_PINNED_FRACTION)
    if not (0.0 <= frac <= 1.0):
        raise HookConfigError(f"kvpilot: KVPILOT_MAX_PINNED_FRACTION must be in [0, 1], got {frac!r}")
    raw_rep = env.get("KVPILOT_REPLICA")
    replica = 0
    if raw_rep and raw_rep.strip():
        try:
            replica = int(raw_rep)
        except ValueError:
            raise HookConfigError(f"kvpilot: KVPILOT_REPLICA={raw_rep!r} is not an integer") from None
        if replica < 0:
            raise HookConfigError(f"kvpilot: KVPILOT_REPLICA must be >= 0, got {replica}")
    poll_s = _float_env(env, "KVPILOT_MODEL_POLL_S", DEFAULT_MODEL_POLL_S)
    if not math.isfinite(poll_s) or poll_s < 0:
        raise HookConfigError(f"kvpilot: KVPILOT_MODEL_POLL_S must be >= 0, got {poll_s!r}")
    hold_s = _float_env(env, "KVPILOT_MAX_HOLD_S", DEFAULT_MAX_HOLD_S)
    if not math.isfinite(hold_s) or hold_s < 0:
        raise HookConfigError(f"kvpilot: KVPILOT_MAX_HOLD_S must be >= 0, got {hold_s!r}")
    gbps = _float_env(env, "KVPILOT_HOST_LINK_GBPS", DEFAULT_HOST_LINK_GBPS)
    if not math.isfinite(gbps) or gbps <= 0:
        raise HookConfigError(f"kvpilot: KVPILOT_HOST_LINK_GBPS must be > 0, got {gbps!r}")
    return HookConfig(
        policy=policy,
        policy_options=options,
        telemetry_dir=tdir,
        decision_budget_s=budget_ms / 1e3,
        max_pinned_fraction=frac,
        replica=replica,
        model_poll_s=poll_s,
        max_hold_s=hold_s,
        host_link_gbps=gbps,
    )


def build_policy(cfg: HookConfig, factory: Optional[Callable[[], Policy]] = None) -> Policy:
    """The configured policy (or ``factory()``); :class:`HookConfigError` when it cannot be built."""
    if factory is not None:
        policy = factory()
    else:
        try:
            policy = create_policy(cfg.policy, **dict(cfg.policy_options))
        except UnknownPolicyError as e:
            raise HookConfigError(f"kvpilot: KVPILOT_POLICY: {e}") from None
        except (TypeError, ValueError) as e:
            raise HookConfigError(f"kvpilot: cannot build policy {cfg.policy!r}: {e}") from None
    if not isinstance(policy, Policy):
        raise HookConfigError(f"kvpilot: the policy factory returned {type(policy).__name__}, not a Policy")
    return policy


#: What a caller may name a policy by: a catalog name, a zero-argument factory, or one instance.
PolicySpec = str | Callable[..., Policy] | Policy


def policy_factory(
    policy: PolicySpec, options: Optional[Mapping[str, Any]] = None, *, replicas: int = 1, workload: Any = None
) -> Callable[[], Policy]:
    """A zero-argument factory of fresh policies (one per engine), checked now by building one.

    For drivers of several engines (the simulator). Catalog factories that declare a ``workload`` parameter
    (hindsight oracles) get ``workload``. :class:`HookConfigError` on an unknown name, bad options, or a factory
    that builds something else than a :class:`Policy`.
    """
    if isinstance(policy, Policy):
        if replicas > 1:
            raise HookConfigError("pass a policy name or factory, not one instance, to run several replicas")
        return lambda: policy
    if isinstance(policy, str):
        opts = dict(options or {})
        try:
            create_policy(policy, workload=workload, **opts)
        except ValueError as e:  # UnknownPolicyError is a ValueError
            raise HookConfigError(str(e)) from None
        return lambda: create_policy(policy, workload=workload, **opts)
    if callable(policy):
        factory = (lambda: policy(**options)) if options else policy
        probe = factory()
        if not isinstance(probe, Policy):
            raise HookConfigError(f"the policy factory returned {type(probe).__name__}, not a Policy")
        return factory
    raise HookConfigError(f"policy must be a catalog name, a factory or a Policy, got {type(policy).__name__}")


def check(env: Optional[Mapping[str, str]] = None) -> tuple[HookConfig, Policy]:
    """Validate the environment's hook configuration and build its policy (no vLLM import)."""
    cfg = load_config(env)
    return cfg, build_policy(cfg)
