"""Numbers and errors as a person reads them: bytes, counts, durations, an error's first line.
"""

from __future__ import annotations


def format_bytes(n: int) -> str:
    """Decimal units as people write budgets: "20.0 GB", "1.50 MB", "512 B"."""
    if n < 0:
        return "-" + format_bytes(-n)
    if n < 1000:
        return f"{n} B"
    units = ((10**3, "KB"), (10**6, "MB"), (10**9, "GB"), (10**12, "TB"), (10**15, "PB"))
    # Move up a unit when rounding would print "1000".
    scale, unit = next(((s, u) for s, u in units if n / s < 999.5), units[-1])
    value = n / scale
    decimals = 2 if value < 9.995 else 1 if value < 99.95 else 0
    return f"{value:.{decimals}f} {unit}"


def format_count(n: int) -> str:
    """Parameter and token counts as people say them: "70.6B", "919K", "12"."""
    return next((f"{n / scale:.3g}{unit}" for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")) if n >= scale), str(n))


def format_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def first_line(error: BaseException) -> str:
    """An error's first line, at most 300 characters (its type's name if it has no text): what a
    one-line message quotes of it."""
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
