"""Human units: every number a person reads in a report (bytes, durations, FLOPs, counts).

`4.17 s`, not `4.17e+03 ms`; `31.3 TFLOP`, not `31,336.1 GFLOP`. The generated tests check that
any value comes back as a mantissa of at most three significant digits in [1, 1000) and a unit,
and that it reads back to within rounding of the value.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoplan.vocabulary.formatting import (
    format_bytes,
    format_count,
    format_flops,
    format_seconds,
    format_signed_seconds,
)

SECONDS = {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
FLOPS = {"FLOP": 1, "KFLOP": 1e3, "MFLOP": 1e6, "GFLOP": 1e9, "TFLOP": 1e12, "PFLOP": 1e15, "EFLOP": 1e18}


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(4.17, "4.17 s"), (4170e-3, "4.17 s"), (0.432, "432 ms"), (0.0173e-3, "17.3 µs"), (1.01, "1.01 s"),
     (0.9996, "1.00 s"), (0.0, "0 s"), (59.99, "60.0 s"), (125.0, "2 min 5 s"), (3 * 3600 + 60, "3 h 1 min"),
     (2.5e-10, "0.25 ns")],
)
def test_durations(seconds: float, text: str) -> None:
    assert format_seconds(seconds) == text


def test_signed_durations_say_faster_or_slower() -> None:
    assert format_signed_seconds(0.0336) == "+33.6 ms"
    assert format_signed_seconds(-2.31) == "−2.31 s"
    assert format_signed_seconds(0.0) == "±0 s"


@pytest.mark.parametrize(
    ("flops", "text"),
    [(31_336.1e9, "31.3 TFLOP"), (1.1e9, "1.10 GFLOP"), (0, "0 FLOP"), (999.6e9, "1.00 TFLOP"), (512, "512 FLOP"),
     (172.87e9, "173 GFLOP")],
)
def test_flops(flops: float, text: str) -> None:
    assert format_flops(flops) == text


def test_bytes_and_counts_keep_their_forms() -> None:
    assert format_bytes(24_700_000_000) == "24.7 GB"
    assert format_bytes(512) == "512 B"
    assert format_count(1_235_814_400) == "1.24B"


def _read_back(text: str, units: dict[str, float]) -> tuple[float, float]:
    match = re.fullmatch(r"(?P<mantissa>\d+(?:\.\d+)?) (?P<unit>\S+)", text)
    assert match is not None, text
    assert match["unit"] in units, text
    return float(match["mantissa"]), units[match["unit"]]


@given(st.floats(min_value=1e-9, max_value=59.0))
def test_any_duration_under_a_minute_reads_back_in_one_unit(seconds: float) -> None:
    mantissa, scale = _read_back(format_seconds(seconds), SECONDS)
    assert 1 <= mantissa < 1000 or scale == 1e-9
    assert mantissa * scale == pytest.approx(seconds, rel=5e-3, abs=5e-12)


@given(st.integers(min_value=1, max_value=9 * 10**20))  # FLOP counts are whole numbers
def test_any_flop_count_reads_back_with_three_digits(flops: int) -> None:
    text = format_flops(flops)
    mantissa, scale = _read_back(text, FLOPS)
    assert 1 <= mantissa < 1000 or text.endswith("EFLOP")
    assert mantissa * scale == pytest.approx(flops, rel=5e-3)
    assert len(text.split()[0].replace(".", "").lstrip("0")) <= 3
