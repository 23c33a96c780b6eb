"""Validators of a policy's options: each returns the value as the policy keeps it, or raises ``ValueError``
naming the option (the catalog and the hook turn that into the user's error)."""

from __future__ import annotations

import math
from typing import Any, Optional

__all__ = ["check_count", "check_number", "check_positive"]

def check_positive(name: str, value: Any, *, allow_none: bool = False, allow_zero: bool = False) -> Optional[float]:
    """Validate a numeric option (JSON-able: int or float)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"option {name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"option {name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)

def check_count(name: str, value: Any, *, allow_none: bool = False) -> Optional[int]:
    """Validate a positive integer option."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"option {name} must be a positive integer, got {value!r}")
    return int(value)

def check_number(name: str, value: Any, *, lo: float = 0.0, allow_lo: bool = False, hi: float = math.inf) -> float:
    """Validate a finite numeric option in ``(lo, hi]`` (``[lo, hi]`` with ``allow_lo``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"option {name} must be a finite number, got {value!r}")
    if value < lo or (value == lo and not allow_lo) or value > hi:
        raise ValueError(f"option {name} out of range: {value!r}")
    return float(value)
