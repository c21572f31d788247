"""Checks of values users give (Python arguments, config files, command-line options, environment variables, result
files): one test per kind of value and one wording per mistake, "NAME must be WHAT, got VALUE", wherever it is made."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable

from specformer_jax.errors import SpecformerError


def is_int(value) -> bool:
    """An integer of any kind (Python, numpy), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite real number of any kind (int, float, numpy), but not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class Kind:
    """A kind of value: what it is called in messages, the test a value must pass, and how text becomes one."""

    what: str  # "a positive integer"
    ok: Callable[[object], bool]
    convert: type  # int or float

    def check(self, name: str, value):
        """`value` converted (int or float) when it is of this kind, else a SpecformerError naming `name`."""
        if not self.ok(value):
            raise SpecformerError(f"{name} must be {self.what}, got {value!r}")
        return self.convert(value)

    def parse(self, text: str, name: str | None = None):
        """`text` (an option, an environment variable) read as this kind; the error names `name` if given."""
        try:
            value = self.convert(text)
        except (TypeError, ValueError):
            value = None
        if value is None or not self.ok(value):  # NaN fails every bound
            raise SpecformerError(f"{name} must be {self.what}, got {text!r}" if name
                                  else f"expected {self.what}, got {text!r}")
        return value


def integer(low: int | None = None, high: int | None = None, what: str | None = None) -> Kind:
    """Integers in [low, high] (either bound may be open-ended)."""
    named = {(None, None): "an integer", (1, None): "a positive integer", (0, None): "a non-negative integer"}
    what = what or named.get((low, high)) or f"an integer {_bounds(low, high, '[', ']')}"
    return Kind(what, lambda v: is_int(v) and (low is None or v >= low) and (high is None or v <= high), int)


def number(low: float | None = None, high: float | None = None, above: bool = False, below: bool = False,
           what: str | None = None) -> Kind:
    """Finite real numbers in [low, high]; `above`: strictly greater than low, `below`: strictly less than high."""
    named = {(0, None, True): "a positive finite number", (0, None, False): "a non-negative finite number"}
    bounds = _bounds(low, high, "(" if above else "[", ")" if below else "]")
    what = what or named.get((low, high, above)) or f"a finite number {bounds}".rstrip()
    fits = lambda v: ((low is None or (v > low if above else v >= low))
                      and (high is None or (v < high if below else v <= high)))
    return Kind(what, lambda v: is_number(v) and fits(v), float)


def _bounds(low, high, opening: str, closing: str) -> str:
    """"in [low, high]", ">= low", "<= high" (strict signs for open ends) or nothing."""
    if low is not None and high is not None:
        return f"in {opening}{low}, {high}{closing}"
    if low is not None:
        return f"{'>' if opening == '(' else '>='} {low}"
    return f"{'<' if closing == ')' else '<='} {high}" if high is not None else ""


POSITIVE_INT = integer(1)
NON_NEGATIVE_INT = integer(0)
SEED = integer(-2**63, 2**63 - 1, what="an integer that fits in 64 bits")
POSITIVE = number(0, above=True)
NON_NEGATIVE = number(0)
FRACTION = number(0, 1)  # [0, 1]
PROBABILITY = number(0, 1, above=True)  # (0, 1]


def checked_budget(budget) -> int | str:
    """A verify budget as a call gives it: an int >= 0, "+N" (the pool's rows plus N) or "auto" (sizes measured on
    this device)."""
    if isinstance(budget, str) and (budget == "auto" or budget.startswith("+") and budget[1:].isdigit()):
        return budget
    return integer(0, 1 << 16, 'an integer >= 0, "+N" or "auto"').check("verify_budget", budget)
