"""Per-request metadata from ``SamplingParams.extra_args`` (OpenAI ``vllm_xargs``).

Every key is optional. A value of the wrong type is ignored, with one warning
per key for the life of the process; nothing here ever raises into vLLM.

Keys (docs/design.md): ``kvpilot_domain``, ``kvpilot_paradigm``,
``kvpilot_group_id``, ``kvpilot_group_size``, ``kvpilot_session_id``,
``kvpilot_turn``, ``kvpilot_tool``, ``kvpilot_step``, ``kvpilot_prompt_id``,
``kvpilot_expected_pause_s``, ``kvpilot_weight_version``, ``kvpilot_max_tokens``. Session identity from
other sources (vLLM's typed ``Request.session_id``, a kvpilot KV-hint action,
the block-hash chain) is resolved over these keys by :mod:`serving_hook.identity`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

from policy.interface import RequestMeta

logger = logging.getLogger("kvpilot.hook")

EMPTY_META = RequestMeta()

#: key -> (RequestMeta field, kind, lower bound); kind "str" accepts str or int (ids
#: given as numbers), "int" an int or an integral string, "float" a finite number
#: or a numeric string.
KeySpec = dict[str, tuple[str, str, int]]

# kvpilot's extra_args keys.
_KEYS: KeySpec = {
    "kvpilot_domain": ("domain", "str", 0),
    "kvpilot_paradigm": ("paradigm", "str", 0),
    "kvpilot_group_id": ("group_id", "str", 0),
    "kvpilot_group_size": ("group_size", "int", 1),
    "kvpilot_session_id": ("session_id", "str", 0),
    "kvpilot_turn": ("turn", "int", 0),
    "kvpilot_tool": ("tool", "str", 0),
    "kvpilot_step": ("step", "int", 0),
    "kvpilot_prompt_id": ("prompt_id", "str", 0),
    "kvpilot_expected_pause_s": ("expected_pause_s", "float", 0),
    "kvpilot_weight_version": ("weight_version", "int", 0),
    "kvpilot_max_tokens": ("max_tokens", "int", 1),
}

_warned: set[str] = set()


def warn_once(key: str, value: Any, where: str) -> None:
    """Warn that ``where[key]=value`` is ignored, once per key for the life of the process."""
    name = f"{where}[{key!r}]"
    if name in _warned:
        return
    _warned.add(name)
    logger.warning(
        "kvpilot: ignoring %s=%r (wrong type or range); later bad values of this key are ignored silently",
        name,
        value,
    )


def _coerce(key: str, kind: str, low: int, value: Any, where: str) -> Optional[Any]:
    """``value`` as the key's ``kind`` (at least ``low``), or None with a warning (once per key)."""
    if value is None:
        return None
    if kind == "str":
        if isinstance(value, str):
            return value if value else None
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
    elif kind == "float":
        fv: Optional[float] = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            fv = float(value)
        elif isinstance(value, str):
            try:
                fv = float(value.strip())
            except ValueError:
                fv = None
        if fv is not None and math.isfinite(fv) and fv >= low:
            return fv
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
    warn_once(key, value, where)
    return None


def read_keys(mapping: Any, keys: KeySpec, where: str) -> dict[str, Any]:
    """The RequestMeta fields ``keys`` read from ``mapping`` (bad values ignored, warned once; ``where`` names the
    mapping in the warning); never raises."""
    if not mapping:
        return {}
    if not isinstance(mapping, dict):
        warn_once("<all>", type(mapping).__name__, where)
        return {}
    found: dict[str, Any] = {}
    try:
        for key, (fname, kind, low) in keys.items():
            if key in mapping:
                v = _coerce(key, kind, low, mapping[key], where)
                if v is not None:
                    found[fname] = v
    except Exception:  # pragma: no cover - defensive: odd mapping types
        warn_once("<all>", "unreadable", where)
        return {}
    return found


def parse_extra_args(extra_args: Any) -> RequestMeta:
    """Read kvpilot's keys from ``extra_args``; never raises."""
    found = read_keys(extra_args, _KEYS, "extra_args")
    return RequestMeta(**found) if found else EMPTY_META


def request_meta(request: Any) -> RequestMeta:
    """Metadata of a vLLM ``Request`` from its sampling params' extra_args alone (see :mod:`serving_hook.identity`)."""
    try:
        sp = request.sampling_params
        extra = sp.extra_args if sp is not None else None
    except Exception:
        return EMPTY_META
    return parse_extra_args(extra)
