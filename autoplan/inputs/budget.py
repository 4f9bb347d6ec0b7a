"""Memory budgets: parsing what a person asks for into bytes the planner fits under.

A budget such as "20GB" or "80%" becomes a ``Budget``: the total the job may
use, minus a reserve for the CUDA context and allocator fragmentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from autoplan.errors import BudgetError, BudgetOverDeviceError
from autoplan.inputs.devices import Device
from autoplan.vocabulary.formatting import format_bytes
from autoplan.vocabulary.sizes import UNITS, Size, read_size

# Fraction of the allocator's memory lost to fragmentation. An uncalibrated
# estimate: to be measured on a GPU (reserved vs. allocated at peak).
DEFAULT_FRAGMENTATION = 0.05


# What a string may say; a size given as a Python value may also be an int of bytes. A command
# line passes strings only, so its errors list the string forms alone.
_ACCEPTED_TEXT = '"20GB", "20 GiB", "512MB", "1.5TB", "1024B", "80%" (of the device\'s memory)'
_ACCEPTED = f"Accepted: an int of bytes, {_ACCEPTED_TEXT}."



@dataclass(frozen=True)
class Budget:
    """The memory a job may use on a device."""

    total_bytes: int
    reserve_bytes: int
    text: str
    note: str = ""  # how the text was read, where that is not its face value ("24GB" read as the 24 GiB card)
    reserve_is_default: bool = False  # the reserve is `default_reserve`'s (none was given)
    given: str | int | None = None  # as the person gave it, for the record of the plan's arguments (an int of bytes as an int)

    @property
    def usable_bytes(self) -> int:
        """What the planner fits the peak under."""
        return max(0, self.total_bytes - self.reserve_bytes)

    def needed_for(self, usable_bytes: int, device: Device) -> int:
        """The smallest budget that leaves `usable_bytes` with this budget's reserve: the one given, or the default rule's."""
        return budget_needed_for(usable_bytes, device, None if self.reserve_is_default else self.reserve_bytes)


def parse_bytes(value: object, *, device_memory_bytes: int | None = None) -> int:
    """Parse a budget ("20GB", "20 GiB", "80%", or an int of bytes) to bytes > 0.

    KB/MB/GB/TB/PB are powers of 10, KiB/MiB/GiB/TiB/PiB powers of 2; a percentage
    is of ``device_memory_bytes``. Fractional bytes are floored.
    """
    return _bytes(read_budget(value), device_memory_bytes, allow_zero=False, what="budget")


def read_budget(value: object) -> Size:
    """A budget read once, before the device is known (finding this machine's GPU imports torch: seconds a
    typo need not wait); a BudgetError when it is no size. A percentage is taken of the device by `make_budget`."""
    return _read(value, allow_zero=False, what="budget")


def read_reserve(value: object) -> Size | None:
    """A reserve read once, as `read_budget` reads a budget (None: the default reserve)."""
    return None if value is None else _read(value, allow_zero=True, what="reserve")


def context_bytes(value: object, device: Device) -> int:
    """A CUDA context as given (`cuda_context`), in bytes: a size, 0, or a percentage of the card; else a BudgetError."""
    return _bytes(_read(value, allow_zero=True, what="CUDA context"), device.memory_bytes, allow_zero=True, what="CUDA context")


def default_reserve(total_bytes: int, device: Device) -> int:
    """Bytes held back: the CUDA context plus fragmentation of the rest."""
    spare = max(0, total_bytes - device.context_bytes)
    return device.context_bytes + int(DEFAULT_FRAGMENTATION * spare)


def make_budget(value: object, device: Device, reserve: object = None, *, allow_over_device: bool = False) -> Budget:
    """Build a ``Budget`` for ``device``.

    ``value`` and ``reserve`` are sizes as written, or as read already (`read_budget`, `read_reserve`): each is
    read once. ``reserve`` None uses ``default_reserve``; otherwise it is an int of bytes
    or a size string, where 0 means no reserve; a reserve that leaves nothing of
    the budget is a ``BudgetError``. A total above the device's memory is a
    ``BudgetOverDeviceError`` unless ``allow_over_device`` (a plan that fits
    such a budget would not fit the device).
    """
    size, reserve = read_budget(value), read_reserve(reserve)
    value = size.given
    total, note = _as_the_card(size, _bytes(size, device.memory_bytes, allow_zero=False, what="budget"), device)
    if total > device.memory_bytes and not allow_over_device:
        raise BudgetOverDeviceError(
            f"the budget {_shown(value)} ({both_units(total)}) is more than {device.name}'s "
            f"{both_units(device.memory_bytes)} of memory: give at most that, \"100%\" for the whole card, or plan for a bigger "
            "device (allow_over_device=True, --allow-over-device on the command line, plans for the budget anyway)",
            budget_bytes=total, device_name=device.name, device_memory_bytes=device.memory_bytes,
        )
    if reserve is None:
        reserve_bytes = default_reserve(total, device)
    else:
        reserve_bytes = _reserve_bytes(reserve, device)
        if reserve_bytes >= total:
            raise BudgetError(
                f"the reserve {_shown(reserve.given)} ({format_bytes(reserve_bytes)}) leaves nothing of the budget "
                f"{_shown(value)} ({format_bytes(total)}): the reserve is held back from the budget, so it must be smaller"
            )
    given = size.given if isinstance(size.given, str) else int(size.given)  # type: ignore[call-overload]  # an int of bytes, read
    return Budget(total_bytes=total, reserve_bytes=reserve_bytes, text=size.text, note=note, reserve_is_default=reserve is None,
                  given=given)


def both_units(n: int) -> str:
    """Bytes as a vendor and as a datasheet's small print count them: "80.00 GiB = 85.90 GB"."""
    return f"{n / 2**30:.2f} GiB = {n / 10**9:.2f} GB"


def _as_the_card(size: Size, total: int, device: Device) -> tuple[int, str]:
    """A decimal budget that names a card's memory is the card, with a note saying so.

    Vendors sell a 24 GiB card as "24GB": "--budget 24GB" on it means the card, not 24×10⁹ bytes
    (1.8 GB less). A budget in GB/TB/MB whose number is the card's memory in that unit or in its
    binary twin (GiB/TiB/MiB), to the digits typed, is read as the whole card; GiB and bytes are
    taken as written.
    """
    unit = size.unit if isinstance(size.given, str) and device.kind == "cuda" else ""
    if unit not in ("mb", "gb", "tb") or total == device.memory_bytes:
        return total, ""
    text, typed = size.text, size.written_number
    digits = len(typed.partition(".")[2])
    as_written = (device.memory_bytes / UNITS[unit], device.memory_bytes / UNITS[unit[0] + "ib"])
    if not any(round(amount, digits) == float(typed) for amount in as_written):
        return total, ""
    note = (f"the budget {text!r} is read as {device.name}'s whole memory, {both_units(device.memory_bytes)} "
            f"(vendors sell GiB as GB); give it in bytes or GiB to mean less")
    return device.memory_bytes, note


def _shown(value: object) -> str:
    return repr(value.strip()) if isinstance(value, str) else str(value)


def budget_needed_for(usable_bytes: int, device: Device, reserve: object = None) -> int:
    """Smallest total budget whose usable bytes are at least ``usable_bytes``."""
    if usable_bytes < 0:
        raise ValueError(f"usable bytes must be >= 0, got {usable_bytes}")
    if reserve is not None:
        return max(1, usable_bytes + _reserve_bytes(read_reserve(reserve), device))
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


def _reserve_bytes(reserve: Size | None, device: Device) -> int:
    assert reserve is not None  # the default reserve is `default_reserve`'s
    return _bytes(reserve, device.memory_bytes, allow_zero=True, what="reserve")


def _failing(value: object, what: str) -> Callable[[str], BudgetError]:
    def fail(reason: str) -> BudgetError:
        accepted = f"Accepted: {_ACCEPTED_TEXT}." if isinstance(value, str) else _ACCEPTED
        return BudgetError(f"invalid {what} {value!r}: {reason}. {accepted}")

    return fail


def _read(value: object, *, allow_zero: bool, what: str) -> Size:
    given = value.given if isinstance(value, Size) else value
    return read_size(value, allow_zero=allow_zero, what=what, fail=_failing(given, what))


def _bytes(size: Size, memory_bytes: int | None, *, allow_zero: bool, what: str) -> int:
    return size.bytes(memory_bytes, allow_zero=allow_zero, what=what, fail=_failing(size.given, what))
