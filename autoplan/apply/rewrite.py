"""Apply stage: rewrite the caller's model in place to run as a plan says.

The same model object comes back: same class, parameters, `state_dict()` keys and methods; each
unit's forward is wrapped on the instance (`planned.forwards.apply_choices`). A plan for more than
one GPU is applied with FSDP2 (`apply.sharding`).
"""

from __future__ import annotations

import warnings

import torch

from autoplan.errors import OptionError, OptionTypeError, PlanMismatchError
from autoplan.apply.sharding import apply_fsdp
from autoplan.apply.tensor_parallel import apply_tensor_parallel
from autoplan.mesh import TP
from autoplan.planned.transaction import restored_on_failure
from autoplan.plan import Choice, Plan
from autoplan.vocabulary.fingerprint import check_model
from autoplan.units import GraphRun, Unit
from autoplan.vocabulary.names import unit_endpoints
from autoplan.planned.forwards import apply_choices
from autoplan.instruments.quantized import settle_first_forward
from autoplan.inputs.hf_models import stop_training_cache


def refuse_meta(model: torch.nn.Module) -> None:
    if any(p.is_meta for p in model.parameters()):
        raise OptionError(
            f"{type(model).__name__} has parameters on the meta device (shapes, no data): it can be planned, "
            "not rewritten or trained. Build it with real weights (e.g. autoplan.hf.model_from_config(..., "
            "meta=False) or from_pretrained), then autoplan.apply(model, plan)."
        )


def apply_plan(model: torch.nn.Module, plan: Plan, *, check: bool = True) -> torch.nn.Module:
    """Rewrite `model` in place to run as `plan` says; returns the same object.

    check: refuse (PlanMismatchError) a model whose parameters are not those the plan was made for.
    """
    if not isinstance(plan, Plan):
        raise OptionTypeError(f"apply() takes a Plan from autoplan.plan(); got {type(plan).__name__}")
    if plan.outcome.counted_only:  # solve.states_bound: nothing was chosen, and applying nothing must not look planned
        raise OptionError(f"this plan holds no choices to apply: its parameters, gradients and {plan.request.optimizer} state "
                          "alone are over the budget (counted, not simulated), so nothing fits it; plan.report() says what "
                          "shrinks them (8-bit optimizer state, QLoRA, FSDP)")
    choices = plan.decisions.choices_by_unit()
    refuse_meta(model)
    with restored_on_failure(model):  # an error or a Ctrl-C halfway leaves the model as it was, not half planned
        return _rewrite(model, plan, choices, check=check)


def _rewrite(model: torch.nn.Module, plan: Plan, choices: dict[Unit, Choice], *, check: bool) -> torch.nn.Module:
    settle_first_forward(model)  # a 4-bit layer's first forward must run the ops its recompute runs
    if any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()):
        warnings.warn(
            "gradient checkpointing turned on by gradient_checkpointing_enable() (or activation_checkpointing_enable()) "
            "is ignored on the planned layers: the plan decides which layers recompute, never twice. "
            "autoplan.remove_plan(model) gives it back.",
            UserWarning,
            stacklevel=3,  # as before: apply_plan's caller
        )
    for unit in choices:
        if isinstance(unit, GraphRun):
            continue  # checked when the graph is split: split_by_units names the graph's units
        try:
            unit_endpoints(model, unit)
        except (AttributeError, IndexError, KeyError, TypeError) as error:
            raise PlanMismatchError(f"the plan names unit {unit.name!r}, which {type(model).__name__} does not have: {error}") from None
    if check:  # after the unit names: a model of another structure is told by the unit it lacks
        check_model(plan.model.fingerprint, model)
    stop_training_cache(model)  # planned without a KV cache, so `model(**batch)` trains without one (plan.notes says so)
    if plan.request.mesh.along(TP) > 1:
        return apply_tensor_parallel(model, plan)
    if plan.request.world_size > 1:
        return apply_fsdp(model, plan)
    return apply_choices(model, choices, plan.decisions.outside_units)
