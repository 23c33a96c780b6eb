"""The policy catalog: a policy name (``KVPILOT_POLICY``, ``--policy``) to a factory.

A new baseline is one module in :mod:`policy.baselines` plus its line in
:data:`policy.baselines.BASELINES`; any other policy registers itself with
:func:`register` (the serving hook registers ``registry``, the policy that serves
the MLflow model registry's champion, from :mod:`serving_hook`).

Factories take keyword options (``KVPILOT_POLICY_OPTIONS``, a JSON object) and
return a :class:`policy.interface.Policy`. Unknown names fail with a message
that lists the known ones, so a bad serving configuration fails at start-up.

A factory that declares a ``workload`` parameter receives the workload table
being simulated (``None`` in production). Only hindsight references use it, to
build oracle predictors; deployable policies must not.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from policy.baselines import BASELINES
from policy.interface import Policy
from policy.vllm_default import VllmDefaultPolicy

PolicyFactory = Callable[..., Policy]

DEFAULT_POLICY = "vllm-default"

_CATALOG: dict[str, PolicyFactory] = {
    "vllm-default": VllmDefaultPolicy,
}


class UnknownPolicyError(ValueError):
    pass


def lazy(target: str) -> PolicyFactory:
    """A factory for ``module:attr`` that imports the module when first called (for :func:`register`)."""
    module, attr = target.split(":")

    def factory(**options: Any) -> Policy:
        return getattr(importlib.import_module(module), attr)(**options)

    factory.kvpilot_target = target  # type: ignore[attr-defined]
    return factory


def _resolve(factory: PolicyFactory) -> PolicyFactory:
    target = getattr(factory, "kvpilot_target", None)
    if target is None:
        return factory
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


for _name, _target in BASELINES.items():
    _CATALOG[_name] = lazy(_target)
_CATALOG["lrb-online"] = lazy("policy.baselines.lrb_online:OnlineLrbEvictionPolicy")

#: The learned policy (``model=POLICY_DIR``) and its exploring behaviour policy.
_CATALOG["learned"] = lazy("policy.learned.policy:create_learned")
_CATALOG["logging"] = lazy("policy.learned.exploring:LoggingPolicy")
#: The learned policy with levers off (policy.learned.policy.ABLATIONS), for ablation rows.
def _ablation(name: str) -> PolicyFactory:
    """The factory of the ablation ``name`` (policy.learned.policy.create_ablation)."""
    def factory(**options: Any) -> Policy:
        return lazy("policy.learned.policy:create_ablation")(name=name, **options)

    return factory


#: policy.learned.policy.ABLATIONS' names (listed here so that the catalog imports no policy before it is built).
LEARNED_ABLATIONS = ("learned-prior", "learned-admission", "learned-tier-rule", "learned-no-tier", "learned-gpu-evict",
                     "learned-tier-lru")
for _name in LEARNED_ABLATIONS:
    _CATALOG[_name] = _ablation(_name)


def register(name: str, factory: PolicyFactory, *, replace: bool = False) -> None:
    """Register ``factory`` under ``name`` (``replace=True`` to override)."""
    if not isinstance(name, str) or not name:
        raise ValueError("policy name must be a non-empty string")
    if name in _CATALOG and not replace:
        raise ValueError(f"policy {name!r} is already registered")
    _CATALOG[name] = factory


def known_policies() -> list[str]:
    return sorted(_CATALOG)


def _takes_workload(factory: PolicyFactory) -> bool:
    try:
        return "workload" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def create_policy(name: str = DEFAULT_POLICY, *, workload: Any = None, **options: Any) -> Policy:
    """Build the policy registered as ``name`` with ``options``.

    ``workload`` (a simulated workload table) is passed on only to factories
    that declare that parameter.

    Raises :class:`UnknownPolicyError` for an unknown name and
    :class:`ValueError` when the factory rejects the options.
    """
    try:
        factory = _CATALOG[name]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown kvpilot policy {name!r}; known policies: {', '.join(known_policies())}"
        ) from None
    factory = _resolve(factory)
    if _takes_workload(factory):
        options = {**options, "workload": workload}
    try:
        policy = factory(**options)
    except TypeError as e:
        raise ValueError(f"bad options {options!r} for kvpilot policy {name!r}: {e}") from e
    if not isinstance(policy, Policy):
        raise TypeError(f"factory of policy {name!r} returned {type(policy).__name__}, not a Policy")
    return policy
