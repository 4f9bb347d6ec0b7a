"""The advice for a plan decided by counting (`solve.states_bound`): what changes the states, from counts alone.

No step was simulated, so nothing that changes activations or speed is priced; none of it could help
anyway, as the states alone are over the budget. What shrinks the states follows from their bytes: 8-bit
optimizer state and 4-bit QLoRA by formula (`report.optimizer_advice`), and FSDP's fewest GPUs for the
states alone, a lower bound that `world_size="auto"` (which simulates) refines with the activations.
"""

from __future__ import annotations

import math
from typing import Any

from autoplan.axes.precision import kind
from autoplan.inputs.devices import Device
from autoplan.plan import Plan
from autoplan.report.float8_step import TITLE as FLOAT8_TITLE
from autoplan.report.fsdp_advice import tensor_parallel_step
from autoplan.report.batch_steps import ACTIVATION_SIDE, Advice, Step
from autoplan.report.ladder_steps import planned_by_ladder
from autoplan.report.optimizer_advice import eight_bit_step, qlora_step
from autoplan.vocabulary.formatting import format_bytes, rank_noun

_NO_HELP = "no help here: the states alone are over the budget, not the activations (counted; no step was simulated)"
_TITLES = {"tf32": "TF32 matmuls", "sdpa": "fused attention (SDPA / FlashAttention)", "float8": FLOAT8_TITLE,
           "compile": "torch.compile",
           "checkpointing": "activation checkpointing (autoplan's choice per unit)",
           "offload": "activation offload to host memory (autoplan's choice per unit)"}


def counted_advice(plan: Plan, device: Device, *, parameter_count: int | None = None, ladder: Any = None) -> Advice:
    """The escalation advice of a counted plan, in `report.advice.advise`'s order and keys; `ladder` (--ladder's, which
    plans its rungs whatever the states: its QLoRA rung is where such a model fits) is shown and prices its steps."""
    states = plan.prediction.breakdown  # the counted parameters, gradients and optimizer state (solve.states_bound)
    low = plan.target.low_precision
    activation_side = [Step(low, kind(low).words, "n/a", _NO_HELP)]
    activation_side += [Step(key, _TITLES[key], "n/a", _NO_HELP) for key in ACTIVATION_SIDE if key in _TITLES]
    batch_side = [Step("grad_accumulation", "gradient accumulation", "n/a", "no help here: a smaller micro-batch leaves the "
                       "states as they are"),
                  Step("shorter_sequences", "shorter sequences", "n/a", "no help here: the states do not depend on the sequence")]
    steps = [*activation_side, *batch_side, eight_bit_step(plan.request.optimizer, states.optimizer, device),
             qlora_step(plan, states, parameter_count), _fsdp_for_states(plan), tensor_parallel_step(plan, None)]
    steps = [planned_by_ladder(step, plan, ladder) for step in steps]  # as they are without a ladder
    # no first fix: the peak is a floor (the states), so no step's saving is known to make the step fit on its own
    return Advice(False, plan.prediction.peak_bytes, plan.request.usable_bytes, tuple(steps), None, None, None, ladder)


def _fsdp_for_states(plan: Plan) -> Step:
    """FSDP's fewest ranks for the states alone (1/N of each on every rank): more are needed once activations,
    gathered parameters and communication buffers are counted, which `world_size="auto"` does."""
    device, usable, states = plan.target.device, plan.request.usable_bytes, plan.prediction.peak_bytes
    at_least = max(2, math.ceil(states / max(usable, 1)))
    code = ("# plans per GPU with the activations, the gathered parameters and FSDP's buffers counted:\n"
            "autoplan plan ... --world-size auto  # or autoplan.plan(model, budget, world_size=\"auto\")")
    return Step("fsdp", "FSDP (shard parameters, gradients, optimizer state)", "try",
                f"at least {at_least} × {device}: 1/{at_least} of the {format_bytes(states)} of states is "
                f"{format_bytes(states // at_least)} per {rank_noun(device)}, within {format_bytes(usable)} usable before "
                "activations, gathered parameters and all-gather/reduce-scatter buffers; --world-size auto "
                "(world_size=\"auto\") simulates them and finds how many", None, None, code)
