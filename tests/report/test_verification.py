"""report.verification: the table `autoplan verify` prints, measured next to predicted."""

from __future__ import annotations

import io

from rich.console import Console

from autoplan.report.verification import verification_table
from autoplan.verify.real import Verification


def _peak_error(measured: int, predicted: int) -> str:
    """The error cell of the table's peak row."""
    row = next(line for line in _rendered(measured, predicted).splitlines() if line.startswith("│ peak"))
    return row.split("│")[-2].strip()


def _rendered(measured: int, predicted: int) -> str:
    result = Verification(device="cpu", steps=3, peak_source="test", measured_peak_bytes=measured, measured_reserved_bytes=None,
                          predicted_peak_bytes=predicted, simulated_peak_bytes=predicted, usable_bytes=2 * predicted,
                          budget_bytes=2 * predicted, measured_step_time_s=1.0, predicted_step_time_s=1.0, out_of_memory=False,
                          held=True)
    buffer = io.StringIO()
    Console(file=buffer, width=120, color_system=None).print(verification_table(result))
    return buffer.getvalue()


def test_a_peak_error_that_rounds_to_nothing_is_unsigned() -> None:
    # issue 39: 1 byte under a 1 MB prediction printed "-0.0%"
    assert _peak_error(999_999, 1_000_000) == "0.0%"
    assert (_peak_error(990_000, 1_000_000), _peak_error(1_020_000, 1_000_000)) == ("-1.0%", "+2.0%")
