"""Argument checks in the Keras voice: "Expected `name` to be ... Received: ...".

One home for the checks every public entry point shares, so that the same mistake gets
the same exception type and message wherever it is made.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


def _is_int(value: Any) -> bool:
    return not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, np.integer))


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1; TypeError for a non-int, ValueError for < 1."""
    if not _is_int(value):
        raise TypeError(f"Expected `{name}` to be a positive int. Received: {value!r}")
    if value < 1:
        raise ValueError(f"Expected `{name}` to be a positive int. Received: {value!r}")
    return int(value)


def non_negative_int(name: str, value: Any) -> int:
    """``value`` as an int >= 0; TypeError for a non-int, ValueError for < 0."""
    if not _is_int(value):
        raise TypeError(f"Expected `{name}` to be a non-negative int. Received: {value!r}")
    if value < 0:
        raise ValueError(f"Expected `{name}` to be a non-negative int. Received: {value!r}")
    return int(value)


SEED_BOUND = 1 << 63  # seeds fit TensorFlow's int64: -2**63 <= seed < 2**63


def optional_seed(name: str, value: Any, non_negative: bool = False) -> int | None:
    """``value`` as a seed (an int of 64 signed bits), or None; TypeError for a non-int,
    ValueError out of range. Distinct seeds in range give distinct orders."""
    if value is None:
        return None
    low = 0 if non_negative else -SEED_BOUND
    kind = "a non-negative int" if non_negative else "an int"
    if not _is_int(value):
        raise TypeError(f"Expected `{name}` to be {kind} or None. Received: {value!r}")
    if not low <= value < SEED_BOUND:
        raise ValueError(
            f"Expected `{name}` to be {kind} below 2**63 (a 64-bit seed"
            f"{'' if non_negative else ', -2**63 at least'}). Received: {value!r}"
        )
    return int(value)


def optional_positive_int(name: str, value: Any) -> int | None:
    return None if value is None else positive_int(name, value)


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"Expected `{name}` to be a bool. Received: {value!r}")
    return bool(value)


def optional_boolean(name: str, value: Any) -> bool | None:
    return None if value is None else boolean(name, value)


def choice(name: str, value: Any, allowed: Iterable[Any]) -> Any:
    allowed = tuple(allowed)
    if value not in allowed:
        options = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"Expected `{name}` to be one of {options}. Received: {value!r}")
    return value


def fraction(name: str, value: Any) -> float:
    """A float strictly between 0 and 1."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating)):
        raise TypeError(f"Expected `{name}` to be a float. Received: {value!r}")
    if not 0 < float(value) < 1:
        raise ValueError(
            f"Expected `{name}` to be between 0 and 1 (exclusive). Received: {value!r}"
        )
    return float(value)


def brief(value: Any) -> str:
    """A value for an error message: an array by its shape and dtype (its repr can run
    to thousands of lines), anything else by its repr, cut at 200 characters."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(value).__name__} of shape {tuple(shape)} and dtype {dtype}"
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
