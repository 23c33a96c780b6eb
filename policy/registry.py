"""Policy registry: a policy name (``KVPILOT_POLICY``) to a factory.

Factories take keyword options (``KVPILOT_POLICY_OPTIONS``, a JSON object) and
return a :class:`policy.interface.Policy`. Unknown names fail with a message
that lists the known ones, so a bad serving configuration fails at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from policy.interface import Policy
from policy.vllm_default import VllmDefaultPolicy

PolicyFactory = Callable[..., Policy]

DEFAULT_POLICY = "vllm-default"

_REGISTRY: dict[str, PolicyFactory] = {
    "vllm-default": VllmDefaultPolicy,
}


class UnknownPolicyError(ValueError):
    pass


def register(name: str, factory: PolicyFactory, *, replace: bool = False) -> None:
    """Register ``factory`` under ``name`` (``replace=True`` to override)."""
    if not isinstance(name, str) or not name:
        raise ValueError("policy name must be a non-empty string")
    if name in _REGISTRY and not replace:
        raise ValueError(f"policy {name!r} is already registered")
    _REGISTRY[name] = factory


def known_policies() -> list[str]:
    return sorted(_REGISTRY)


def create_policy(name: str = DEFAULT_POLICY, **options: Any) -> Policy:
    """Build the policy registered as ``name`` with ``options``.

    Raises :class:`UnknownPolicyError` for an unknown name and
    :class:`ValueError` when the factory rejects the options.
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown kvpilot policy {name!r}; known policies: {', '.join(known_policies())}"
        ) from None
    try:
        policy = factory(**options)
    except TypeError as e:
        raise ValueError(f"bad options {options!r} for kvpilot policy {name!r}: {e}") from e
    if not isinstance(policy, Policy):
        raise TypeError(f"factory of policy {name!r} returned {type(policy).__name__}, not a Policy")
    return policy
