"""Sizes a person writes ("20GB", "20 GiB", "80%", an int of bytes) as bytes: one parser for budgets,
reserves and custom device profiles."""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction
from typing import Callable

UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

# Plain ASCII decimals only: exponents would let "1e999GB" build huge ints.
# A sign is allowed only so "-1GB" gets a "must be positive" message.
SIZE = re.compile(
    r"(?P<number>[+-]?(?:\d+\.?\d*|\.\d+))\s*(?P<unit>[a-z%]*)",
    re.IGNORECASE | re.ASCII,
)


def parse_size(value: object, device_memory_bytes: int | None, *, allow_zero: bool, what: str,
               fail: Callable[[str], Exception]) -> int:
    """`value` in bytes; `fail(reason)` is the error raised when it is not a size ("what" names it)."""
    least = "at least 0" if allow_zero else "positive"
    if isinstance(value, bool):
        raise fail(f"a {what} is a size, not a bool")
    if isinstance(value, numbers.Integral):  # int and numpy's integers
        if value < 0 or (value == 0 and not allow_zero):
            raise fail(f"a {what} must be {least}")
        return int(value)
    if isinstance(value, numbers.Real):
        raise fail("a float of bytes is ambiguous; give an int or a unit")
    if not isinstance(value, str):
        raise fail(f"a {what} must be an int or a string, not {type(value).__name__}")
    text = value.strip()
    if not text:
        raise fail(f"the {what} is empty")
    match = SIZE.fullmatch(text)
    if match is None:
        if SIZE.match(text) is None:
            raise fail(f"a {what} must start with a number")
        raise fail(f"a {what} is a number followed by a unit")
    number = Fraction(match["number"])
    unit = match["unit"].lower()
    written = match["unit"]
    if len(written) == 2 and written[0] in "KMGT" and written[1] == "b":  # "20Gb" is gigabits, not gigabytes
        raise fail(f"{written} is {dict(K='kilo', M='mega', G='giga', T='tera')[written[0]]}bits; write {written[0]}B for bytes")
    if unit == "":
        if number == 0:
            if allow_zero:
                return 0
            raise fail(f"a {what} must be {least}")
        raise fail(f"a {what} needs a unit")
    if number < 0 or (number == 0 and not allow_zero):
        raise fail(f"a {what} must be {least}")
    if unit == "%":
        if device_memory_bytes is None:
            raise fail("a percentage needs a device to take it of")
        if number > 100 or (number == 0 and not allow_zero):
            raise fail("a percentage must be in (0, 100]")
        result = math.floor(number / 100 * device_memory_bytes)
    elif unit in UNITS:
        result = math.floor(number * UNITS[unit])
    else:
        raise fail(f"unknown unit {match['unit']!r}")
    if result == 0 and not allow_zero:
        raise fail(f"a {what} must be at least 1 byte")
    return result
