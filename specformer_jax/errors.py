"""User-facing errors: anything raised as SpecformerError is printed as one line by the CLI. Also the checks of the
Python API's arguments, so a notebook user gets the same kind of message as the CLI's."""

from __future__ import annotations

import math
import numbers


class SpecformerError(Exception):
    """Bad input from the user (path, config, prompt, option value), with a message that says what to fix."""


def is_int(value) -> bool:
    """An integer of any kind (Python, numpy), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int when it is an integer (not a bool) in [low, high], else a SpecformerError naming `name`."""
    if not is_int(value):
        raise SpecformerError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise SpecformerError(f"{name} must be {bounds}, got {value}")
    return int(value)


def check_number(name: str, value) -> float:
    """`value` as a float when it is a finite real number (not a bool), else a SpecformerError naming `name`."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise SpecformerError(f"{name} must be a finite number, got {value!r}")
    return float(value)
