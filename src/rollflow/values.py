"""The values user code returns, checked and shown: a reward that must be a finite number, and
any value as an error message shows it. No rollflow imports: every package may use it."""

from __future__ import annotations

import math
from typing import Any


def finite(value: Any) -> float | None:
    """`value` as a float if it is a finite number (an int or float, not a bool), else None: NaN,
    infinities and an int too large for a float (10**400) are not rewards."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def shown(value: Any, limit: int = 80, *, typed: bool = True) -> str:
    """A value as an error message shows it: its repr, cut to `limit` characters, and its type
    (unless not `typed`)."""
    if isinstance(value, int) and value.bit_length() > 10_000:  # repr refuses past 4,300 digits
        text = f"<an int of {value.bit_length():,} bits>"
    else:
        text = repr(value)
        text = f"{text[:limit]}..." if len(text) > limit else text
    return f"{text} ({type(value).__name__})" if typed else text
