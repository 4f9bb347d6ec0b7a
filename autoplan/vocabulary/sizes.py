"""Sizes a person writes ("20GB", "20 GiB", "80%", an int of bytes) as bytes: one reader for budgets,
reserves, host budgets and custom device profiles. A size is read once (`read_size`, to a `Size`) and
taken in bytes where the memory a percentage is of is known (`Size.bytes`)."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
# The units as a person writes them, for an error that meets another: "B, KB, ..., PiB, %".
KNOWN_UNITS = ", ".join([unit.upper() if "i" not in unit else unit[0].upper() + "iB" for unit in UNITS] + ["%"])

# Plain ASCII decimals only: exponents would let "1e999GB" build huge ints.
# A sign is allowed only so "-1GB" gets a "must be positive" message.
SIZE = re.compile(
    r"(?P<number>[+-]?(?:\d+\.?\d*|\.\d+))\s*(?P<unit>[a-z%]*)",
    re.IGNORECASE | re.ASCII,
)


@dataclass(frozen=True)
class Size:
    """A size as a person wrote it, read once: a number of bytes, or a percentage of a memory still to be known."""

    given: object  # as written: "20GB", "80%", an int of bytes
    amount: Fraction  # the number, in `unit`s
    unit: str  # lower case: "gb", "gib", "b", "%"
    written_number: str = ""  # the number as typed ("25.8"), its digits too: a card's memory is read from it (`inputs.budget`)

    @property
    def text(self) -> str:
        """The size as written, trimmed: what a report quotes."""
        return self.given.strip() if isinstance(self.given, str) else str(self.given)

    def bytes(self, memory_bytes: int | None, *, allow_zero: bool, what: str, fail: Callable[[str], Exception]) -> int:
        """In bytes, a percentage taken of `memory_bytes`; `fail(reason)` when it is none (a percentage of no memory, 0)."""
        if self.unit == "%":
            if memory_bytes is None:
                raise fail("a percentage needs a device to take it of")
            if self.amount > 100 or (self.amount == 0 and not allow_zero):
                raise fail("a percentage must be in (0, 100]")
            result = math.floor(self.amount / 100 * memory_bytes)
        else:
            result = math.floor(self.amount * UNITS[self.unit])
        if result == 0 and not allow_zero:
            raise fail(f"{_a(what)} must be at least 1 byte")
        return result


def read_size(value: object, *, allow_zero: bool, what: str, fail: Callable[[str], Exception]) -> Size:
    """`value` read as a size (once: a `Size` is taken as it is); `fail(reason)` is the error raised when it is
    not one ("what" names it). A percentage is read here and taken of a memory by `Size.bytes`."""
    if isinstance(value, Size):
        return value
    least = "at least 0" if allow_zero else "positive"
    if isinstance(value, bool):
        raise fail(f"{_a(what)} is a size, not a bool")
    if isinstance(value, numbers.Integral):  # int and numpy's integers
        if value < 0 or (value == 0 and not allow_zero):
            raise fail(f"{_a(what)} must be {least}")
        return Size(value, Fraction(int(value)), "b")
    if isinstance(value, numbers.Real):
        raise fail("a float of bytes is ambiguous; give an int or a unit")
    if not isinstance(value, str):
        raise fail(f"{_a(what)} must be an int or a string, not {type(value).__name__}")
    text = value.strip()
    if not text:
        raise fail(f"the {what} is empty")
    match = SIZE.fullmatch(text)
    if match is None:
        if SIZE.match(text) is None:
            raise fail(f"{_a(what)} must start with a number")
        raise fail(f"{_a(what)} is a number followed by a unit")
    number = Fraction(match["number"])
    unit = match["unit"].lower()
    written = match["unit"]
    if len(written) == 2 and written[0] in "KMGTP" and written[1] == "b":  # "20Gb" is gigabits, not gigabytes
        raise fail(f"{written} is {dict(K='kilo', M='mega', G='giga', T='tera', P='peta')[written[0]]}bits; write {written[0]}B for bytes")
    if unit == "":
        if number == 0 and allow_zero:
            return Size(value, Fraction(0), "b")
        raise fail(f"{_a(what)} must be {least}" if number == 0 else f"{_a(what)} needs a unit")
    if number < 0 or (number == 0 and not allow_zero):
        raise fail(f"{_a(what)} must be {least}")
    if unit != "%" and unit not in UNITS:
        raise fail(f"unknown unit {written!r} (known: {KNOWN_UNITS})")
    return Size(value, number, unit, match["number"])


def parse_size(value: object, device_memory_bytes: int | None, *, allow_zero: bool, what: str,
               fail: Callable[[str], Exception]) -> int:
    """`value` in bytes (`read_size`, then `Size.bytes` of `device_memory_bytes`)."""
    return read_size(value, allow_zero=allow_zero, what=what, fail=fail).bytes(device_memory_bytes, allow_zero=allow_zero,
                                                                               what=what, fail=fail)


def _a(what: str) -> str:
    """`what` with its indefinite article: "a budget", "an interconnect" (a custom card's keys name the size)."""
    return f"{'an' if what[:1].lower() in 'aeiou' else 'a'} {what}"
