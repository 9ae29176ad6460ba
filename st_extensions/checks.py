"""Argument checks shared by both packages: each raises ``ValueError`` naming the parameter and the bad value.

``pyterrier_prob.validation`` re-exports them, so that there is one set of checks (this module sits in
``st_extensions`` because that package must not import ``pyterrier_prob``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def is_int(value: Any) -> bool:
    """True for Python and numpy integers, False for bools (``True`` is an int to Python, never a count here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> int | None:
    """``value`` as an int ``>= minimum`` (``None`` passes when ``allow_none``), else a ``ValueError`` naming it."""
    if value is None and allow_none:
        return None
    if not is_int(value) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


def non_negative_int(name: str, value: Any, *, allow_none: bool = False) -> int | None:
    """``value`` as an int ``>= 0`` (``None`` passes when ``allow_none``)."""
    return positive_int(name, value, allow_none=allow_none, minimum=0)


def finite_float(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
) -> float | None:
    """``value`` as a finite float within ``[low, high]`` (an end is open when ``*_open``; ``None`` is no bound)."""
    if value is None and allow_none:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok:
        v = float(value)
        ok = (low is None or (v > low if low_open else v >= low)) and (
            high is None or (v < high if high_open else v <= high)
        )
    if not ok:
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        span = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
        raise ValueError(f"{name} must be a finite number in {span}{' or None' if allow_none else ''}, got {value!r}")
    return float(value)


def positive_float(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """``value`` as a finite float ``> 0``."""
    return finite_float(name, value, low=0.0, low_open=True, allow_none=allow_none)


def probability(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """``value`` as a float in ``[0, 1]``."""
    return finite_float(name, value, low=0.0, high=1.0, allow_none=allow_none)


def choice(name: str, value: T, choices: Sequence[T]) -> T:
    """``value`` if it is one of ``choices``, else a ``ValueError`` listing them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value
