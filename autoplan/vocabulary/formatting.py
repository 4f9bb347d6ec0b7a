"""Numbers and errors as a person reads them: bytes, counts, durations, FLOPs, an error's first line.

Every number a report, an error or the CLI prints goes through one of these, so all of them read
the same way: three significant digits and the unit that keeps the number between 1 and 1000
("4.17 s", not "4.17e+03 ms"; "31.3 TFLOP", not "31,336.1 GFLOP").
"""

from __future__ import annotations

import importlib.util
import os
import traceback


def format_bytes(n: int) -> str:
    """Decimal units as people write budgets: "20.0 GB", "1.50 MB", "512 B"."""
    if n < 0:
        return "-" + format_bytes(-n)
    if n < 1000:
        return f"{n} B"
    scale, unit = byte_unit(n)
    return f"{_three_digits(n / scale)} {unit}"


def byte_unit(n: float) -> tuple[int, str]:
    """The decimal unit `format_bytes` shows `n` bytes in: (10**6, "MB") for 24.2 MB; a plot's axis takes its largest value's."""
    units = ((1, "B"), (10**3, "KB"), (10**6, "MB"), (10**9, "GB"), (10**12, "TB"), (10**15, "PB"))
    # Move up a unit when rounding would print "1000".
    return next(((s, u) for s, u in units if abs(n) / s < 999.5), units[-1])


def format_count(n: int) -> str:
    """Parameter and token counts as people say them: "70.6B", "919K", "12"."""
    return next((f"{n / scale:.3g}{unit}" for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")) if n >= scale), str(n))


def _three_digits(value: float) -> str:
    """A value in [0, 1000) with three significant digits: "4.17", "31.3", "432"."""
    decimals = 2 if value < 9.995 else 1 if value < 99.95 else 0
    return f"{value:.{decimals}f}"


def _in_units(value: float, units: tuple[tuple[float, str], ...]) -> str:
    """`value` in the largest of `units` (scale, name; largest first) that shows it as at least 1."""
    for scale, name in units:
        if value / scale >= 0.9995 or scale == units[-1][0]:
            return f"{_three_digits(value / scale)} {name}"
    raise AssertionError("unreachable: the last unit always matches")


_SECONDS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))
_FLOPS = ((1e18, "EFLOP"), (1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "KFLOP"))


def format_seconds(seconds: float) -> str:
    """A duration as people read one: "4.17 s", "432 ms", "17.3 µs", "2 min 5 s", "3 h 1 min"."""
    if seconds < 0:
        return "-" + format_seconds(-seconds)
    if seconds == 0:
        return "0 s"
    if seconds >= 3599.5:
        hours, minutes = divmod(round(seconds / 60), 60)
        return f"{hours} h {minutes} min"
    if seconds >= 59.995:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes} min {rest} s" if minutes else f"{rest} s"
    return _in_units(seconds, _SECONDS)


def format_signed_seconds(change: float) -> str:
    """A change of duration with its sign: "+33.6 ms" (slower), "−2.31 s" (faster), "±0 s"."""
    if change == 0:
        return "±0 s"
    return ("+" if change > 0 else "−") + format_seconds(abs(change))


def format_signed_percent(fraction: float, decimals: int = 1) -> str:
    """A relative error or change with its sign: "+2.3%", "-1.0%"; one that rounds to nothing is "0.0%", not the
    "-0.0%" (or "+0.0%") of Python's own `+.1%` for -0.0001."""
    shown = f"{fraction:+.{decimals}%}"
    return shown[1:] if float(shown[1:-1]) == 0 else shown


def format_flops(flops: float) -> str:
    """A count of floating-point operations: "31.3 TFLOP", "1.10 GFLOP", "512 FLOP"."""
    if flops < 0:
        return "-" + format_flops(-flops)
    if flops < 999.5:
        return f"{round(flops)} FLOP"
    return _in_units(flops, _FLOPS)


def rank_noun(device_name: str, count: int = 1) -> str:
    """What an FSDP rank is called on this device profile, plural unless `count` is 1: "GPU"/"GPUs", or on
    the CPU profile "rank"/"ranks" (its FSDP runs gloo processes, not GPUs, so a report must not say "per GPU")."""
    noun = "rank" if device_name == "cpu" else "GPU"
    return noun if count == 1 else noun + "s"


def first_line(error: BaseException) -> str:
    """An error's first line, at most 300 characters (its type's name if it has no text): what a
    one-line message quotes of it."""
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


# Frames in these folders are autoplan's or torch's own; the innermost frame outside them is the
# line of the person's model that an error happened in.
_LIBRARY_DIRS = tuple(
    os.path.dirname(path) + os.sep
    for path in (os.path.dirname(os.path.abspath(__file__)), getattr(importlib.util.find_spec("torch"), "origin", None))
    if path
)


def where_in_user_code(error: BaseException) -> str:
    """`, at file:line: code` for the innermost frame of `error` outside torch and autoplan ("" if none)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_LIBRARY_DIRS)]
    if not frames:
        return ""
    frame = frames[-1]
    return f", at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
