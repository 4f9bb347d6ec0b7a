"""Report: a plan as text a person reads in a terminal."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoplan.budget import format_bytes

if TYPE_CHECKING:
    from autoplan.plan import Plan


def format_report(plan: "Plan") -> str:
    verdict = "fits" if plan.feasible else "does NOT fit"
    lines = [
        f"{plan.model_name} on {plan.device}: {verdict} — predicted peak {format_bytes(plan.predicted_peak_bytes)} "
        f"(simulated {format_bytes(plan.simulated_peak_bytes)}) of {format_bytes(plan.usable_bytes)} usable "
        f"({format_bytes(plan.budget_bytes)} budget)",
        f"no plan: {format_bytes(plan.baseline_peak_bytes)}; lowest reachable: {format_bytes(plan.minimum_peak_bytes)} "
        f"(needs a {format_bytes(plan.minimum_budget_bytes)} budget)",
        f"step time ({plan.time_source}): {plan.predicted_step_time_s * 1e3:.3f} ms planned, "
        f"{plan.baseline_step_time_s * 1e3:.3f} ms no plan, {plan.fastest_step_time_s * 1e3:.3f} ms fastest",
    ]
    b = plan.breakdown
    lines.append(
        f"at the peak ({plan.peak_phase}): parameters {format_bytes(b.parameters)}, gradients {format_bytes(b.gradients)}, "
        f"optimizer {format_bytes(b.optimizer)}, activations {format_bytes(b.activations)}, transient {format_bytes(b.transient)}"
    )
    lines.append(f"{'unit':<32} {'mode':<10} {'precision':<9} {'saved':>10} {'recompute FLOPs':>16}")
    for unit in plan.units:
        lines.append(
            f"{unit.name:<32} {unit.choice.mode:<10} {unit.choice.precision:<9} "
            f"{format_bytes(unit.saved_bytes):>10} {unit.recompute_flops:>16,}"
        )
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines)
