"""The public API: `plan` decides, `apply` rewrites, `optimize` does both.

    plan = autoplan.plan(model, "20GB", example_inputs=(x,), device="h100-80gb")
    model = autoplan.optimize(model, "20GB", example_inputs=(x,))

`plan` is `Planner(model, **options).plan(budget)`: `planner.py` runs the stages in order —
options and device, trace, profile, then for each budget solve and verify — each handing a frozen
value to the next.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

import torch

from autoplan.apply.sharding import process_group_world_size, require_process_group
from autoplan.apply.rewrite import apply_plan, refuse_meta
from autoplan.errors import InfeasibleBudgetError, OptionTypeError
from autoplan.inputs.options import check_world_size
from autoplan.plan import Plan
from autoplan.planner import Planner
from autoplan.report.reported import ReportedPlan
from autoplan.solve.assemble import infeasible_message


def plan(model: torch.nn.Module, budget: str | int, **options: Any) -> ReportedPlan:
    """Decide, per unit, the checkpoint mode and precision that fit `budget` fastest. Changes nothing.

    budget: "20GB", "20 GiB", "80%" (of the device), or an int of bytes. example_inputs: one batch
    (positional args, kwargs, or both); optional for a Hugging Face model (`batch_size` ×
    `seq_len` from its config). device: a profile name (`autoplan.list_devices()`); None, this
    machine's GPU. optimizer: "adamw" (default), "adam", "sgd", "sgd-momentum" or an instance.
    loop: the training loop the peak is for (default: outputs kept through backward); `plan.request.loop`
    states it and `autoplan.verify` runs it. Every other argument (units, pins, reserve, profile,
    world_size, compile, segments, fuse_loss, offload, host_budget, moe_capacity, ...): docs/api.md. plan.request.arguments holds
    the arguments that shaped the plan; plan.report() shows the call that reproduces it.

    Every option is a keyword of `autoplan.Planner`, and this is `Planner(model, **options).plan(budget)`:
    to plan one model at several budgets, make the Planner once (it profiles once).
    """
    _check_option_names(options, "plan")
    return Planner(model, **options).plan(budget)


def _check_option_names(options: dict[str, Any], called: str) -> None:
    """A misspelled option named as the caller wrote it, with the closest real one: Python's own error
    would name Planner.__init__, which the caller never called."""
    known = [name for name in inspect.signature(Planner).parameters if name != "model"]
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the options are {', '.join(known)}"
            raise OptionTypeError(f"{called}() got an unexpected keyword argument {name!r}{hint} (docs/api.md)")


def apply(model: torch.nn.Module, plan: Plan, *, check: bool = True) -> torch.nn.Module:
    """Rewrite `model` in place to run as `plan` says; returns the same object.

    A plan is for the model it was made for: a model whose parameters differ in shape or dtype
    (`Net(d=256)` given `Net(d=64)`'s plan) raises PlanMismatchError naming the first difference,
    before anything changes. check=False applies it anyway (its peak and times then say nothing).
    """
    return apply_plan(model, plan, check=check)


def optimize(model: torch.nn.Module, budget: str | int, **options: Any) -> torch.nn.Module:
    """Plan for `budget` and rewrite `model` in place; returns the same model object.

    Takes the same arguments as `plan`. Raises InfeasibleBudgetError (with `.plan`) when no plan
    fits, rather than returning a model that would run out of memory. With world_size > 1 (or
    "auto") it must run in every rank of an initialised process group (torchrun): the model comes
    back FSDP2-sharded (`apply.sharding.apply_fsdp`), and the budget is per GPU.
    """
    refuse_meta(model)
    _check_option_names(options, "optimize")
    world_size = options.get("world_size", 1)
    if world_size == "auto" and process_group_world_size() is None:
        require_process_group(0)  # says how to start one
    if world_size != "auto" and check_world_size(world_size) > 1:
        require_process_group(world_size)  # before minutes of planning, not after
    decided = plan(model, budget, **options)
    if not decided.outcome.feasible:
        raise InfeasibleBudgetError(decided, infeasible_message(decided))
    return apply(model, decided)
