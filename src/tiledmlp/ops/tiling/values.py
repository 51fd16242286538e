"""Checks of plain values that every layer shares, each written once with one message.

Invariant: a check either returns the value (typed) or raises ValueError naming the value, what
was expected and what was got; bools are never taken for ints.
"""

from __future__ import annotations

import math
from typing import TypeGuard

__all__ = ["check_int", "check_positive_number", "is_int", "positive_number"]


def is_int(value: object, minimum: int = 1) -> TypeGuard[int]:
    """Whether `value` is an int (not a bool) >= `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_int(name: str, value: object, *, minimum: int = 1, hint: str = "") -> int:
    """`value` as an int >= `minimum`.

    Args:
        name: what to call the value in the message (e.g. "tile_tokens", "--seq-len").
        value: the value to check.
        minimum: the smallest allowed value.
        hint: appended to the message (e.g. "; use 1 to switch it off").

    Raises:
        ValueError: `value` is not an int >= `minimum` (a bool is not an int here).
    """
    if not is_int(value, minimum):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}{hint}")
    return value


def check_positive_number(name: str, value: object) -> float:
    """`value` as a finite float > 0.

    Args:
        name: what to call the value in the message (e.g. "temperature", "--budget-gb").
        value: the value to check (an int or float, not a bool).

    Raises:
        ValueError: `value` is not a finite number > 0.
    """
    number = positive_number(value)
    if number is None:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return number


def positive_number(value: object) -> float | None:
    """`value` as a finite float > 0 (an int or float, not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and number > 0 else None
