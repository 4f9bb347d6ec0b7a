"""A plan at the budget halfway between a model's lowest peak and its peak with no plan.

There some units are checkpointed and some kept: the budget the equivalence and prediction tests
plan at. One autoplan.Planner profiles the model once for both solves, the roomy one that finds
the two peaks and the halfway one. On a GPU target the two ends are budgets: the floor
(`minimum_budget_bytes`, which the caching allocator's least limit can raise above the lowest peak) and
what the roomy plan's allocator needs (its least limit, where above its peak).
"""

from __future__ import annotations

from typing import Any

import torch

import autoplan


def halfway_budget(plan: autoplan.Plan) -> int:
    """Halfway between the floor and the roomy plan's needs; `plan` is the roomy one, made with reserve=0 on a GPU target."""
    predicted = plan.prediction
    if not predicted.least_limit_bytes:  # no caching allocator (the CPU, FSDP): the peaks are the budgets
        return (predicted.minimum_peak_bytes + predicted.baseline_peak_bytes) // 2
    return (predicted.minimum_budget_bytes + max(predicted.baseline_peak_bytes, predicted.least_limit_bytes)) // 2


def halfway_plan(model: torch.nn.Module, roomy: str | int = "1GB", **options: Any) -> autoplan.Plan:
    """`options`: autoplan.plan's; `roomy`: a budget that everything fits, to find the two peaks."""
    planner = autoplan.Planner(model, **options)
    return planner.plan(halfway_budget(planner.plan(roomy)))
