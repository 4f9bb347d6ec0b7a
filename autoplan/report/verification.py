"""Report of `autoplan verify`: the plan it checked, then what real steps measured next to what it predicted.

The plan comes first in its short form (`text.plan_summary`: verdict, units, step times), so the
table below it reads against the choices it measured. The step-time row says what each number is:
the measured one a timing of these steps on this machine, the predicted one the plan's estimate for
its device profile, and why it has no error when the two are not the same kind of number (a
roofline is a lower bound at datasheet rates; the CPU steps run under the live-bytes tracker).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from autoplan.report.text import plan_summary
from autoplan.vocabulary.formatting import format_bytes, format_seconds, format_signed_percent

if TYPE_CHECKING:
    from autoplan.plan import Plan
    from autoplan.verify.real import Verification


def verification_renderables(plan: "Plan", result: "Verification", verbose: bool = False) -> list[RenderableType]:
    """What `autoplan verify` prints: the plan it checked, the measurements, and what the step times are."""
    return [*plan_summary(plan, verbose), verification_table(result), step_time_note(result)]


def verification_table(result: "Verification") -> Table:
    """What `autoplan verify` measured, next to what the plan predicted."""
    held = "[green]held[/green]" if result.held else "[red]did not hold[/red]"
    if result.out_of_memory:
        held += " (out of memory)"
    table = Table(title=f"{result.steps} real training steps on {result.device}: the plan {held}")
    for column in ("", "measured", "predicted", "simulated", "error"):
        table.add_column(column, justify="right" if column else "left")
    measured = format_bytes(result.measured_peak_bytes) if result.measured_peak_bytes is not None else "—"
    error = format_signed_percent(result.peak_error) if result.peak_error is not None else "—"
    table.add_row(f"peak ({result.peak_source})", measured, format_bytes(result.predicted_peak_bytes),
                  format_bytes(result.simulated_peak_bytes), error)
    if result.measured_reserved_bytes is not None:
        table.add_row("reserved by the allocator", format_bytes(result.measured_reserved_bytes), "", "", "")
    table.add_row("usable budget", format_bytes(result.usable_bytes), "", "", "")
    step = format_seconds(result.measured_step_time_s) if result.measured_step_time_s is not None else "—"
    time_error = result.step_time_error
    table.add_row("step time (see below)", step, format_seconds(result.predicted_step_time_s), "",
                  format_signed_percent(time_error) if time_error is not None else "n/a")
    return table


def step_time_note(result: "Verification") -> Text:
    """The step-time row in words: what was measured, what was predicted, and why there is or is no error."""
    timed = result.steps - 1
    measured = (f"measured: {format_seconds(result.measured_step_time_s)}, the median of {timed} step{'s' if timed > 1 else ''} "
                f"after the first on {result.device} ({result.measured_time_source})" if result.measured_step_time_s is not None
                else "measured: none (the steps ran out of memory)")
    source = result.predicted_time_source or "unknown"
    predicted = f"predicted: {format_seconds(result.predicted_step_time_s)} for {result.planned_device or 'the planned device'} ({source})"
    if result.step_time_error is not None:
        why = "both are CUDA-event timings on this GPU, so the error compares them"
    elif source.startswith("roofline"):
        why = (f"no error: a roofline is FLOPs and bytes over {result.planned_device or 'the device'}'s datasheet peak rates, "
               "a lower bound for any real step rather than a forecast of this one")
        if "compiled" in source:
            why += ", and it prices the compiled model while these steps ran eagerly"
    else:
        why = "no error: the two timings are not of the same kind (another device, or steps slowed by recording every allocation)"
    return Text(f"step time: {measured}; {predicted}; {why}")
