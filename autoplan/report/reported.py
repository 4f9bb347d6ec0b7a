"""The Plan `autoplan.plan` returns: a `Plan` that prints its own report, `plan.report()`.

`Plan` is the pipeline's vocabulary and imports no stage, so it cannot print itself: the report is a later
stage. The Planner hands out this subclass, which adds the one method that needs the report
(`autoplan.format_report`, which takes any Plan, one made by hand too), and nothing else.
"""

from __future__ import annotations

import dataclasses

from autoplan.plan import Plan
from autoplan.report.text import format_report


class ReportedPlan(Plan):
    """A Plan with `report()`: what `autoplan.plan`, `Planner.plan` and `autoplan.optimize`'s error hand out."""

    def report(self, verbose: bool = False) -> str:
        """`autoplan.format_report(plan, verbose=verbose)` (verbose: selective units' saves op by op)."""
        return format_report(self, verbose=verbose)


def reported(plan: Plan) -> ReportedPlan:
    """`plan` as a ReportedPlan, its fields the same objects."""
    return ReportedPlan(**{field.name: getattr(plan, field.name) for field in dataclasses.fields(plan)})
