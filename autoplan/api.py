"""The public API: `plan` decides, `apply` rewrites, `optimize` does both.

    plan = autoplan.plan(model, "20GB", example_inputs=(x,), device="h100-80gb")
    model = autoplan.optimize(model, "20GB", example_inputs=(x,))

`plan` is `Planner(model, **options).plan(budget)`: `planner.py` runs the stages in order —
options and device, trace, profile, then for each budget solve and verify — each handing a frozen
value to the next.
"""

from __future__ import annotations

import torch
from typing_extensions import Unpack

from autoplan.apply.sharding import process_group_world_size, require_process_group
from autoplan.apply.rewrite import apply_plan, refuse_meta
from autoplan.errors import InfeasibleBudgetError
from autoplan.inputs.options import PlanKeywords, PlanOptions, with_options
from autoplan.inputs.settings import fsdp_ranks, requested_degree
from autoplan.plan import Plan
from autoplan.planner import Planner
from autoplan.report.reported import ReportedPlan
from autoplan.solve.assemble import infeasible_message
from autoplan.vocabulary.sizes import Size


@with_options
def plan(model: torch.nn.Module, budget: str | int | Size, **options: Unpack[PlanKeywords]) -> ReportedPlan:
    """Decide, per unit, the checkpoint mode and precision that fit `budget` fastest. Changes nothing.

    budget: "20GB", "20 GiB", "80%" (of the device), or an int of bytes. `plan.request.arguments` holds
    the arguments that shaped the plan; plan.report() shows the call that reproduces it. This is
    `Planner(model, **options).plan(budget)`: to plan one model at several budgets, make the Planner
    once (it profiles once).
    """
    PlanOptions.given(options, "plan")
    return Planner(model, **options).plan(budget)


def apply(model: torch.nn.Module, plan: Plan, *, check: bool = True) -> torch.nn.Module:
    """Rewrite `model` in place to run as `plan` says; returns the same object.

    A plan is for the model it was made for: a model whose parameters differ in shape or dtype
    (`Net(d=256)` given `Net(d=64)`'s plan) raises PlanMismatchError naming the first difference,
    before anything changes. check=False applies it anyway (its peak and times then say nothing).
    """
    return apply_plan(model, plan, check=check)


@with_options
def optimize(model: torch.nn.Module, budget: str | int | Size, **options: Unpack[PlanKeywords]) -> torch.nn.Module:
    """Plan for `budget` and rewrite `model` in place; returns the same model object.

    Takes the same arguments as `plan`. Raises InfeasibleBudgetError (with `.plan`) when no plan
    fits, rather than returning a model that would run out of memory. With world_size > 1 (or
    "auto"), or tensor_parallel > 1, it must run in every rank of an initialised process group (torchrun): the model comes
    back FSDP2-sharded (`apply.sharding.apply_fsdp`) and its linears split (`apply.tensor_parallel`), and the budget
    is per GPU.
    """
    refuse_meta(model)
    given = PlanOptions.given(options, "optimize")
    world_size = given.world_size
    if world_size == "auto" and process_group_world_size() is None:
        require_process_group(0)  # says how to start one
    ranks = fsdp_ranks(given)
    degree = requested_degree(given)
    every_gpu = 0 if ranks == "auto" or degree == "auto" else ranks * degree
    if every_gpu > 1:
        require_process_group(every_gpu)  # before minutes of planning, not after
    decided = plan(model, budget, **options)
    if not decided.outcome.feasible:
        raise InfeasibleBudgetError(decided, infeasible_message(decided))
    return apply(model, decided)
