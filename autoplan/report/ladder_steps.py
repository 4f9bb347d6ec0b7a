"""A step of the advice that `--ladder` planned: the rung's planned numbers replace the step's estimate."""

from __future__ import annotations

import dataclasses
from typing import Any

from autoplan.plan import Plan
from autoplan.report.batch_steps import Step
from autoplan.vocabulary.formatting import format_bytes, format_seconds


def planned_by_ladder(step: Step, plan: Plan, ladder: Any) -> Step:
    """A "try" step the ladder planned: its numbers become the planned ones (the rung against the one below, or this plan)."""
    if ladder is None or step.status != "try":
        return step
    if step.key == "sdpa" and ladder.rung("sdpa") and ladder.rung("checkpointing"):
        before, after = ladder.rung("checkpointing"), ladder.rung("sdpa")
        where = "the ladder's rung below (eager attention)"
    elif step.key == "qlora" and ladder.rung("qlora"):
        before, after = None, ladder.rung("qlora")
        where = "this plan"
    else:
        return step
    peak = before.peak_bytes if before else plan.prediction.peak_bytes
    time = before.step_time_s if before else plan.prediction.step_time_s
    # two plans that fit both fill the budget for speed: their peaks say nothing, their step times do; a plan that
    # does not fit is helped by a lower peak only
    helps = after.fits and after.step_time_s < time if plan.outcome.feasible else after.peak_bytes < peak
    timed = before is not None or not plan.outcome.counted_only  # a plan decided by counting has no step time
    against = f"{format_bytes(peak)} and {format_seconds(time)}" if timed else f"{format_bytes(peak)} (its states, counted)"
    detail = (f"planned (--ladder, {after.title.lstrip('+ ')}){'' if helps else ', no help here'}: peak "
              f"{format_bytes(after.peak_bytes)} and step {format_seconds(after.step_time_s)}, against {against} "
              f"for {where}" + (f". {step.detail}" if helps else ""))
    code = after.code if step.key == "qlora" else step.code
    return dataclasses.replace(step, status="try" if helps else "n/a", detail=detail, saves_bytes=peak - after.peak_bytes,
                               time_change_s=after.step_time_s - time if timed else None, code=code)
