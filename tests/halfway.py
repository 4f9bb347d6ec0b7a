"""A plan at the budget halfway between a model's lowest peak and its peak with no plan.

There some units are checkpointed and some kept: the budget the equivalence and prediction tests
plan at. One autoplan.Planner profiles the model once for both solves, the roomy one that finds
the two peaks and the halfway one.
"""

from __future__ import annotations

from typing import Any

import torch

import autoplan


def halfway_budget(plan: autoplan.Plan) -> int:
    return (plan.prediction.minimum_peak_bytes + plan.prediction.baseline_peak_bytes) // 2


def halfway_plan(model: torch.nn.Module, roomy: str | int = "1GB", **options: Any) -> autoplan.Plan:
    """`options`: autoplan.plan's; `roomy`: a budget that everything fits, to find the two peaks."""
    planner = autoplan.Planner(model, **options)
    return planner.plan(halfway_budget(planner.plan(roomy)))
