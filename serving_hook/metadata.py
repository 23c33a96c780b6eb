"""Per-request metadata from ``SamplingParams.extra_args`` (OpenAI ``vllm_xargs``).

Every key is optional. A value of the wrong type is ignored, with one warning
per key for the life of the process; nothing here ever raises into vLLM.

Keys (DESIGN.md): ``kvpilot_domain``, ``kvpilot_paradigm``,
``kvpilot_group_id``, ``kvpilot_group_size``, ``kvpilot_session_id``,
``kvpilot_turn``, ``kvpilot_tool``, ``kvpilot_step``, ``kvpilot_prompt_id``, ``kvpilot_weight_version``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from policy.interface import RequestMeta

logger = logging.getLogger("kvpilot.hook")

EMPTY_META = RequestMeta()

# key -> (RequestMeta field, kind); kind "str" accepts str or int (ids given as
# numbers), "int" accepts int or an integral string, with a lower bound.
_KEYS: dict[str, tuple[str, str, int]] = {
    "kvpilot_domain": ("domain", "str", 0),
    "kvpilot_paradigm": ("paradigm", "str", 0),
    "kvpilot_group_id": ("group_id", "str", 0),
    "kvpilot_group_size": ("group_size", "int", 1),
    "kvpilot_session_id": ("session_id", "str", 0),
    "kvpilot_turn": ("turn", "int", 0),
    "kvpilot_tool": ("tool", "str", 0),
    "kvpilot_step": ("step", "int", 0),
    "kvpilot_prompt_id": ("prompt_id", "str", 0),
    "kvpilot_weight_version": ("weight_version", "int", 0),
}

_warned: set[str] = set()


def _warn_once(key: str, value: Any) -> None:
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(
        "kvpilot: ignoring extra_args[%r]=%r (wrong type or range); later bad values of this key are ignored silently",
        key,
        value,
    )


def _coerce(key: str, kind: str, low: int, value: Any) -> Optional[Any]:
    if value is None:
        return None
    if kind == "str":
        if isinstance(value, str):
            return value if value else None
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
    else:
        if isinstance(value, int) and not isinstance(value, bool):
            iv = value
        elif isinstance(value, str):
            try:
                iv = int(value.strip())
            except ValueError:
                iv = None
        elif isinstance(value, float) and value.is_integer():
            iv = int(value)
        else:
            iv = None
        if iv is not None and iv >= low:
            return iv
    _warn_once(key, value)
    return None


def parse_extra_args(extra_args: Any) -> RequestMeta:
    """Read kvpilot's keys from ``extra_args``; never raises."""
    if not extra_args:
        return EMPTY_META
    if not isinstance(extra_args, dict):
        _warn_once("<extra_args>", type(extra_args).__name__)
        return EMPTY_META
    found: dict[str, Any] = {}
    try:
        for key, (fname, kind, low) in _KEYS.items():
            if key in extra_args:
                v = _coerce(key, kind, low, extra_args[key])
                if v is not None:
                    found[fname] = v
    except Exception:  # pragma: no cover - defensive: odd mapping types
        _warn_once("<extra_args>", "unreadable")
        return EMPTY_META
    return RequestMeta(**found) if found else EMPTY_META


def request_meta(request: Any) -> RequestMeta:
    """Metadata of a vLLM ``Request`` (its sampling params' extra_args)."""
    try:
        sp = request.sampling_params
        extra = sp.extra_args if sp is not None else None
    except Exception:
        return EMPTY_META
    return parse_extra_args(extra)
