"""Memory budgets: parsing what a person asks for into bytes the planner fits under.

A budget such as "20GB" or "80%" becomes a ``Budget``: the total the job may
use, minus a reserve for the CUDA context and allocator fragmentation.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from fractions import Fraction

from autoplan.errors import BudgetError, BudgetOverDeviceError
from autoplan.inputs.devices import Device
from autoplan.vocabulary.formatting import format_bytes

# Fraction of the allocator's memory lost to fragmentation. An uncalibrated
# estimate: to be measured on a GPU (reserved vs. allocated at peak).
DEFAULT_FRAGMENTATION = 0.05

_UNITS = {
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

# What a string may say; a size given as a Python value may also be an int of bytes. A command
# line passes strings only, so its errors list the string forms alone.
_ACCEPTED_TEXT = '"20GB", "20 GiB", "512MB", "1.5TB", "1024B", "80%" (of the device\'s memory)'
_ACCEPTED = f"Accepted: an int of bytes, {_ACCEPTED_TEXT}."

# Plain ASCII decimals only: exponents would let "1e999GB" build huge ints.
# A sign is allowed only so "-1GB" gets a "must be positive" message.
_SIZE = re.compile(
    r"(?P<number>[+-]?(?:\d+\.?\d*|\.\d+))\s*(?P<unit>[a-z%]*)",
    re.IGNORECASE | re.ASCII,
)


@dataclass(frozen=True)
class Budget:
    """The memory a job may use on a device."""

    total_bytes: int
    reserve_bytes: int
    text: str

    @property
    def usable_bytes(self) -> int:
        """What the planner fits the peak under."""
        return max(0, self.total_bytes - self.reserve_bytes)


def parse_bytes(value: object, *, device_memory_bytes: int | None = None) -> int:
    """Parse a budget ("20GB", "20 GiB", "80%", or an int of bytes) to bytes > 0.

    KB/MB/GB/TB are powers of 10, KiB/MiB/GiB/TiB powers of 2; a percentage
    is of ``device_memory_bytes``. Fractional bytes are floored.
    """
    return _parse(value, device_memory_bytes, allow_zero=False, what="budget")


def default_reserve(total_bytes: int, device: Device) -> int:
    """Bytes held back: the CUDA context plus fragmentation of the rest."""
    spare = max(0, total_bytes - device.context_bytes)
    return device.context_bytes + int(DEFAULT_FRAGMENTATION * spare)


def make_budget(value: object, device: Device, reserve: object = None, *, allow_over_device: bool = False) -> Budget:
    """Build a ``Budget`` for ``device``.

    ``reserve`` None uses ``default_reserve``; otherwise it is an int of bytes
    or a size string, where 0 means no reserve; a reserve that leaves nothing of
    the budget is a ``BudgetError``. A total above the device's memory is a
    ``BudgetOverDeviceError`` unless ``allow_over_device`` (a plan that fits
    such a budget would not fit the device).
    """
    total = parse_bytes(value, device_memory_bytes=device.memory_bytes)
    if total > device.memory_bytes and not allow_over_device:
        raise BudgetOverDeviceError(
            f"the budget {_shown(value)} ({format_bytes(total)}) is more than {device.name}'s "
            f"{format_bytes(device.memory_bytes)} of memory: give at most that, a percentage of it, or plan for a bigger "
            "device (allow_over_device=True, --allow-over-device on the command line, plans for the budget anyway)",
            budget_bytes=total, device_name=device.name, device_memory_bytes=device.memory_bytes,
        )
    if reserve is None:
        reserve_bytes = default_reserve(total, device)
    else:
        reserve_bytes = _parse_reserve(reserve, device)
        if reserve_bytes >= total:
            raise BudgetError(
                f"the reserve {_shown(reserve)} ({format_bytes(reserve_bytes)}) leaves nothing of the budget "
                f"{_shown(value)} ({format_bytes(total)}): the reserve is held back from the budget, so it must be smaller"
            )
    text = value.strip() if isinstance(value, str) else str(value)
    return Budget(total_bytes=total, reserve_bytes=reserve_bytes, text=text)


def _shown(value: object) -> str:
    return repr(value.strip()) if isinstance(value, str) else str(value)


def budget_needed_for(usable_bytes: int, device: Device, reserve: object = None) -> int:
    """Smallest total budget whose usable bytes are at least ``usable_bytes``."""
    if usable_bytes < 0:
        raise ValueError(f"usable bytes must be >= 0, got {usable_bytes}")
    if reserve is not None:
        return max(1, usable_bytes + _parse_reserve(reserve, device))
    if usable_bytes == 0:
        return 1
    # Invert the reserve rule in closed form, then step to the exact minimum:
    # the int() in default_reserve makes the closed form off by a byte or so.
    spare = math.ceil(usable_bytes / (1 - DEFAULT_FRAGMENTATION))
    total = device.context_bytes + spare
    while _default_usable(total, device) < usable_bytes:
        total += 1
    while total > 1 and _default_usable(total - 1, device) >= usable_bytes:
        total -= 1
    return total


def _default_usable(total: int, device: Device) -> int:
    return max(0, total - default_reserve(total, device))


def _parse_reserve(value: object, device: Device) -> int:
    return _parse(value, device.memory_bytes, allow_zero=True, what="reserve")


def _parse(
    value: object, device_memory_bytes: int | None, *, allow_zero: bool, what: str
) -> int:
    def fail(reason: str) -> BudgetError:
        accepted = f"Accepted: {_ACCEPTED_TEXT}." if isinstance(value, str) else _ACCEPTED
        return BudgetError(f"invalid {what} {value!r}: {reason}. {accepted}")

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
    match = _SIZE.fullmatch(text)
    if match is None:
        if _SIZE.match(text) is None:
            raise fail(f"a {what} must start with a number")
        raise fail(f"a {what} is a number followed by a unit")
    number = Fraction(match["number"])
    unit = match["unit"].lower()
    if unit == "":
        if number == 0 and allow_zero:
            return 0
        raise fail(f"a {what} needs a unit")
    if number < 0 or (number == 0 and not allow_zero):
        raise fail(f"a {what} must be {least}")
    if unit == "%":
        if device_memory_bytes is None:
            raise fail("a percentage needs a device to take it of")
        if number > 100 or (number == 0 and not allow_zero):
            raise fail("a percentage must be in (0, 100]")
        result = math.floor(number / 100 * device_memory_bytes)
    elif unit in _UNITS:
        result = math.floor(number * _UNITS[unit])
    else:
        raise fail(f"unknown unit {match['unit']!r}")
    if result == 0 and not allow_zero:
        raise fail(f"a {what} must be at least 1 byte")
    return result
