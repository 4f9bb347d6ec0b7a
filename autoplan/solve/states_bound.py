"""The answer that follows from counting: the states alone are over the budget, so no plan fits.

Parameters, gradients and optimizer state are on the device through every step whatever the units
choose (`profile.states`); when they alone exceed the usable budget on one device, no checkpoint
mode, precision or offload changes the verdict, and simulating the step (minutes for a 70B model)
would only refine by how much. The Plan says so from the count: its peak is the states (a lower
bound: activations and optimizer.step()'s temporaries come on top), it holds no unit decisions, and
`Outcome.decided_by` is "state count" so every reader can tell it was not simulated.
"""

from __future__ import annotations

import torch

from autoplan.inputs.devices import Device
from autoplan.inputs.loop import TrainingLoop
from autoplan.plan import (
    OPTIMIZER_STEP, Decisions, DeviceTarget, MemoryBreakdown, Outcome, PlannedModel, Plan, Prediction, Request,
)
from autoplan.profile.states import CountedStates
from autoplan.solve.allocator_fit import reserved_context
from autoplan.solve.request import SolveRequest
from autoplan.trace.discovery import unit_levels
from autoplan.trace.tracer import trace

DECIDED_BY_COUNT = "state count"
NOT_SOLVED = "Not Solved (the states alone are over the budget)"


def states_over_budget(counted: CountedStates, request: SolveRequest) -> bool:
    """Whether counting alone decides: one device (FSDP shards the states) and the states over its usable bytes."""
    return request.mesh.size == 1 and not request.fewest_ranks and counted.total > request.usable_bytes


def every_unit_runs(model: torch.nn.Module, batch, units, routing) -> bool:
    """Whether the forward on `batch` runs every unit of the first level (traced, nothing profiled): where one never
    runs, its parameters get no gradient and no state, and the count would say more than the step holds. False where
    the trace fails, so the whole pipeline runs and says why."""
    try:
        return not trace(model, batch, unit_names=unit_levels(model, units)[0].units, routing=routing).never_ran
    except Exception:  # noqa: BLE001 - the full pipeline traces again and reports the failure in its words
        return False


def states_bound_plan(counted: CountedStates, request: SolveRequest, *, device: Device, model_name: str, optimizer: str,
                      loop: TrainingLoop, parameter_count: int) -> Plan:
    """The DOES NOT FIT plan of a model whose states alone are over `request`'s usable bytes."""
    budget, states = request.budget, counted.total
    context, context_source = reserved_context(budget, device)
    breakdown = MemoryBreakdown(parameters=counted.parameters, gradients=counted.gradients, optimizer=counted.optimizer,
                                activations=0, transient=0)
    note = ("the states are counted for every trainable parameter: one no gradient reaches (a part of the model this batch "
            "does not use) holds neither gradient nor state in a real step; freeze what your forward leaves unused "
            "(requires_grad_(False)) before planning")
    return Plan(
        request=Request(budget_bytes=budget.total_bytes, usable_bytes=budget.usable_bytes, optimizer=optimizer,
                        mesh=request.mesh, loop=loop, host=request.host, context_bytes=context, context_source=context_source),
        model=PlannedModel(name=model_name, trace_method="none", parameter_count=parameter_count, state_bytes=states),
        target=DeviceTarget(device.name, device.low_precision_name),
        decisions=Decisions(units=()),
        prediction=Prediction(
            peak_bytes=states, simulated_peak_bytes=0, baseline_peak_bytes=states, minimum_peak_bytes=states,
            minimum_budget_bytes=budget.needed_for(states, device), breakdown=breakdown, peak_phase=OPTIMIZER_STEP,
            step_time_s=0.0, baseline_step_time_s=0.0, fastest_step_time_s=0.0, time_source="not estimated",
        ),
        outcome=Outcome(False, NOT_SOLVED, 0.0, decided_by=DECIDED_BY_COUNT),
        notes=(*((budget.note,) if budget.note else ()), note),
    )
