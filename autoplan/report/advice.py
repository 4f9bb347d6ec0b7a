"""Advise stage: what to change next, in a practitioner's order, with this model's numbers.

`advise(plan, profile)` walks the usual escalation — low-precision autocast, TF32, fused attention,
torch.compile, activation checkpointing, gradient accumulation, shorter sequences, 8-bit optimizer
state / QLoRA, FSDP, tensor parallelism — and says for each what it would save or cost *here*, computed from the
profile and the memory model (`memory.model`), or why it does not apply. Estimates say how they were
made; the micro-batch for gradient accumulation is checked by planning again when `replan` is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from autoplan.errors import OptionTypeError
from autoplan.inputs.devices import Device
from autoplan.inputs.loop import TrainingLoop
from autoplan.memory.model import phase_bytes, predict_peak, predict_step_time, sharded_peak
from autoplan.axes.precision import kind
from autoplan.axes.checkpoint import Mode
from autoplan.mesh import Mesh
from autoplan.plan import Choice, Plan, Precision
from autoplan.profile.profiler import Profile
from autoplan.axes.precisions.float8 import is_float8
from autoplan.report.float8_step import float8_step
from autoplan.report.fsdp_advice import fsdp_step, smallest_world_size, tensor_parallel_step
from autoplan.report.ladder_steps import planned_by_ladder
from autoplan.report.offload_advice import offload_step
from autoplan.report.allocator_advice import allocator_view
from autoplan.report.optimizer_advice import optimizer_state_steps
from autoplan.report.batch_steps import (  # noqa: F401 - Advice is read from here too (its home before batch_steps)
    ACTIVATION_SIDE, Advice, Step, grad_accumulation_step, held_attention, shorter_sequences_step,
)
from autoplan.vocabulary.formatting import format_bytes, format_flops, format_seconds



@dataclass(frozen=True)
class StateBound:
    """Why nothing fits when no unit's choice matters: bytes every training step holds whatever the units do."""

    state_bytes: int  # parameters (and buffers), gradients and optimizer state
    step_bytes: int  # what optimizer.step() allocates on top at the peak (0: the state alone is over the budget)
    workspace_bytes: int = 0  # cuBLAS's workspaces at that peak (a GPU target), held whatever the units do


def state_bound(plan: "Plan") -> StateBound | None:
    """The weights, gradients and optimizer state, not the activations, are why `plan` does not fit.

    Either they alone exceed the usable budget, or the lowest reachable peak is in optimizer.step(),
    where no activation is alive: checkpointing and precision change neither. One GPU only; an
    FSDP plan prints its per-rank arithmetic instead.
    """
    if plan.outcome.feasible or plan.request.world_size > 1:
        return None
    b = plan.prediction.breakdown
    state = plan.model.state_bytes or b.parameters + b.gradients + b.optimizer
    if state > plan.request.usable_bytes:
        return StateBound(state, 0)
    if plan.prediction.peak_phase.kind == "step":
        state = b.parameters + b.gradients + b.optimizer
        return StateBound(state, b.total - state - b.workspaces - b.loop_held, b.workspaces)
    return None


def every_unit(profile: Profile, mode: Mode, precision: Precision) -> dict[str, Choice] | None:
    """Every unit of the profile in `mode` and `precision`; None when a unit was not profiled so."""
    choice = Choice(mode, precision)
    if any(choice not in unit.options for unit in profile.units):
        return None
    return {unit.name: choice for unit in profile.units}


def _low_precision(plan: Plan, profile: Profile) -> Step:
    low = plan.target.low_precision
    key, title = low, kind(low).words
    code = f'autoplan.optimize(model, budget, example_inputs=batch, precision="{low}")  # every unit and the rest'
    if plan.request.mesh.param_dtype:  # FSDP2's MixedPrecisionPolicy computes every unit in it already
        return Step(key, title, "chosen", f"every unit computes in {plan.request.mesh.param_dtype} under FSDP2's MixedPrecisionPolicy "
                    "(fsdp_mixed_precision): autocast on top is not what FSDP runs")
    if profile.rest_precision != "fp32":
        saves = profile.reference.peak_bytes - profile.timeline.peak_bytes
        faster = profile.reference.step_time_s - profile.timeline.step_time_s
        detail = (f"chosen (--precision {profile.rest_precision}): the whole model under autocast peaks at "
                  f"{format_bytes(profile.timeline.peak_bytes)} with no checkpointing, against "
                  f"{format_bytes(profile.reference.peak_bytes)} in fp32; step {format_seconds(profile.timeline.step_time_s)} vs "
                  f"{format_seconds(profile.reference.step_time_s)}")
        return Step(key, title, "chosen", detail, saves, -faster, code)
    fp32, lowered = every_unit(profile, "keep", "fp32"), every_unit(profile, "keep", low)
    if fp32 is None or lowered is None:
        return Step(key, title, "n/a", f"not measured: precision was forced to fp32; plan with --precision auto to measure {low}")
    saves = predict_peak(profile, fp32).bytes - predict_peak(profile, lowered).bytes
    change = predict_step_time(profile, lowered) - predict_step_time(profile, fp32)
    chosen = plan.decisions.unit_choices()
    # a float8 unit runs in bf16 autocast around its float8 linears
    used = sum(1 for choice in chosen.values() if choice.precision == low or is_float8(choice.precision))
    pace = f"{format_seconds(abs(change))} {'faster' if change <= 0 else 'slower'}"
    # a higher peak is possible: autocast saves each weight's low-precision copy for backward, which outweighs
    # small activations (the peak read "-1.11 MB lower" and the step said "try")
    height = f"{format_bytes(abs(saves))} {'lower' if saves >= 0 else 'higher'}"
    detail = (f"every unit in {low} (no checkpointing) peaks {height} than in fp32 and the step "
              f"is {pace}; the plan runs {used} of {len(chosen)} units in {low}, the rest of "
              f"the model in fp32 (--precision {low} puts all of it under autocast)")
    helps = saves > 0 or change < 0
    return Step(key, title, "chosen" if used else "try" if helps else "n/a", detail, saves, change, code)


def _tf32(plan: Plan, profile: Profile) -> Step:
    device = profile.device
    code = 'torch.set_float32_matmul_precision("high")  # TF32 matmuls and convolutions'
    if "tf32" not in device.peak_flops or device.kind != "cuda":
        return Step("tf32", "TF32 matmuls", "n/a", f"{device.name} has no TF32 tensor cores")
    units = {unit.name: unit for unit in profile.units}
    fp32_flops = sum(units[name].options[choice].fwd_flops + units[name].options[choice].bwd_flops
                     for name, choice in plan.decisions.unit_choices().items() if choice.precision == "fp32")
    if profile.rest_precision == "fp32":
        fp32_flops += sum(phase.flops for phase in profile.timeline.phases if phase.unit is None)
    if fp32_flops == 0:
        return Step("tf32", "TF32 matmuls", "n/a", "no matmul of this plan runs in fp32")
    saves_s = fp32_flops / device.peak_flops["fp32"] - fp32_flops / device.peak_flops["tf32"]
    if saves_s <= 0:
        return Step("tf32", "TF32 matmuls", "n/a", f"{device.name}'s TF32 rate is no higher than its fp32 rate")
    detail = (f"{format_flops(fp32_flops)} per step still run in fp32; at {device.name}'s TF32 rate they take up to "
              f"{format_seconds(saves_s)} less (roofline; memory-bound ops do not speed up). No memory change")
    return Step("tf32", "TF32 matmuls", "try", detail, 0, -saves_s, code)


def _sdpa(plan: Plan, profile: Profile, peak_index: int) -> Step:
    title = "fused attention (SDPA / FlashAttention)"
    chosen = plan.decisions.unit_choices()
    per_unit = [unit.options.get(Choice("keep", chosen[unit.name].precision)) for unit in profile.units]
    materialised = sum(cost.attention_bytes for cost in per_unit if cost is not None)
    if materialised == 0:
        return Step("sdpa", title, "n/a", "the profile shows no saved T×T attention matrices (fused attention already, or none)")
    at_peak = held_attention(profile, plan.decisions.unit_choices(), peak_index)
    worst = max(cost.attention_bytes for cost in per_unit if cost is not None)
    held = (f"at the peak the plan keeps {format_bytes(at_peak)} of them, which SDPA would not save" if at_peak
            else "the plan keeps none of them at the peak (those units are checkpointed), but recomputing one rebuilds "
                 f"up to {format_bytes(worst)}")
    detail = (f"in keep mode the units save {format_bytes(materialised)} of T×T attention probabilities "
              f"(up to {format_bytes(worst)} per unit); {held}. F.scaled_dot_product_attention saves only its output "
              "and a log-sum-exp, and with less to save fewer units need checkpointing")
    code = 'y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # HF: attn_implementation="sdpa"'
    return Step("sdpa", title, "try", detail, at_peak, None, code)


def _compile(plan: Plan, profile: Profile) -> Step:
    device = profile.device
    units = {unit.name: unit for unit in profile.units}
    compute_s = sum(phase.flops for phase in profile.timeline.phases if phase.unit is None) / kind(profile.rest_precision).flops(device, allow_tf32=False)
    for name, choice in plan.decisions.unit_choices().items():
        cost = units[name].options[choice]
        compute_s += (cost.fwd_flops + cost.bwd_flops) / kind(choice.precision).flops(device, allow_tf32=False)
    bound = max(0.0, plan.prediction.step_time_s - compute_s)
    if not plan.prediction.time_source.startswith("roofline"):  # measured times have no roofline split into FLOPs and traffic
        return Step("compile", "torch.compile", "try", f"the step times were {plan.prediction.time_source}, so how much of "
                    "them is memory traffic Inductor's fusion could win is not known here; autoplan does not predict "
                    "compile's effect; the planned model compiles as is", None, None,
                    "model = torch.compile(autoplan.optimize(model, ..., compile=True))")
    if bound < 0.01 * plan.prediction.step_time_s:  # (the CPU profile: its bandwidth never binds)
        return Step("compile", "torch.compile", "n/a", f"by the roofline the whole {format_seconds(plan.prediction.step_time_s)} step "
                    "is the ops' FLOPs, with no memory traffic left for Inductor's fusion to win; compile still runs the "
                    "planned model as is")
    detail = (f"{format_seconds(bound)} of the {format_seconds(plan.prediction.step_time_s)} roofline step is memory traffic of ops that are not "
              "compute-bound (elementwise, norms, casts): what Inductor's fusion attacks. autoplan does not predict how "
              "much it recovers, nor compile's memory effect; the planned model compiles as is")
    if plan.prediction.time_source.startswith("roofline, compiled"):
        detail += "; this plan was made for it (compile=True, --compile): recomputation priced as compiled code runs it"
    else:
        detail += ("; plan with compile=True (autoplan plan --compile) to price recomputation as compiled code runs it "
                   "(elementwise ops fused, so units save matmul/attention outputs and recompute the rest)")
    return Step("compile", "torch.compile", "try", detail, None, None,
                "model = torch.compile(autoplan.optimize(model, ..., compile=True))")


def _checkpointing(plan: Plan, profile: Profile) -> Step:
    title = "activation checkpointing (autoplan's choice per unit)"
    modes = {mode: sum(1 for d in plan.decisions.units if d.choice.mode == mode) for mode in ("keep", "selective", "full")}
    kept = {name: Choice("keep", choice.precision) for name, choice in plan.decisions.unit_choices().items()}
    saves = predict_peak(profile, kept).bytes - plan.prediction.peak_bytes
    cost = plan.prediction.step_time_s - predict_step_time(profile, kept)
    flops = sum(d.recompute_flops for d in plan.decisions.units)
    counts = ", ".join(f"{n} {mode}" for mode, n in modes.items() if n)
    rerun = f"recomputing {format_flops(flops)}" if flops else "recomputing norms, casts and activations only (no FLOPs, bytes moved)"
    detail = (f"units: {counts}; the same precisions without checkpointing peak {format_bytes(saves)} higher; "
              f"{rerun} costs {format_seconds(cost)} per step")
    status = "chosen" if modes["selective"] + modes["full"] else "n/a"
    if status == "n/a":
        detail = "not needed: every unit keeps its activations" + ("" if plan.outcome.feasible else " (nothing to gain)")
    return Step("checkpointing", title, status, detail, saves, cost, "model = autoplan.optimize(model, budget, example_inputs=batch)")


def _no_help(step: Step) -> Step:
    return Step(step.key, step.title, "n/a", "no help here: the state is over the budget, not the activations", code=step.code)


def least_activation_choices(profile: Profile) -> dict[str, Choice]:
    """Per unit, the choice that keeps the fewest bytes (then peaks lowest in backward), fastest on ties.

    When the single-GPU peak is elsewhere (optimizer.step() of a huge model), the solver's
    lowest-peak choices may keep activations they do not need to; estimates for sharding and smaller
    batches start from the choices that keep least. Kept bytes come first: they add up over every
    unit, while a backward peak happens once.
    """
    return {
        unit.name: min(unit.options, key=lambda c: (unit.options[c].held_bytes, unit.options[c].bwd_peak_bytes, unit.options[c].time_s))
        for unit in profile.units
    }


def advise(
    plan: Plan,
    profile: Profile | None,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    mesh: Mesh | None = None,
    parameter_count: int | None = None,
    replan: Callable[[int, TrainingLoop], Plan] | None = None,
    ladder: Any = None,
    device: Device | None = None,
) -> Advice:
    """Escalation advice for `plan` (from `profile`), each step with what it saves and costs here.

    batch_size, seq_len: what was planned, for gradient accumulation and shorter sequences.
    mesh: also estimate the per-rank peak on these devices (FSDP over N GPUs). parameter_count: for QLoRA
    (default: from the gradients' bytes, assuming fp32). replan(micro_batch, loop) -> Plan: plan again at a
    smaller batch in the planned loop with that many more micro-batches per optimizer step, to verify the
    gradient-accumulation estimate (skipped when None). ladder: the planned toolbox ladder
    (`report.ladder.plan_ladder`); its rungs replace the estimates of the steps it planned (SDPA, QLoRA). device: the
    device of a plan decided by counting (profile None), for a custom one (default: the profile named by the plan).
    """
    if isinstance(plan, Plan) and plan.outcome.counted_only:  # solve.states_bound: no profile was made
        from autoplan.inputs.devices import get_device
        from autoplan.report.counted_advice import counted_advice  # it builds on this module

        return counted_advice(plan, device or get_device(plan.target.device), parameter_count=parameter_count, ladder=ladder)
    if not isinstance(plan, Plan) or not isinstance(profile, Profile):
        raise OptionTypeError("advise() takes the Plan and the Profile of one planning run; run autoplan.plan first")
    plan = allocator_view(plan)
    order = [sample.phase for sample in profile.timeline.phases]
    peak_index = order.index(plan.prediction.peak_phase) if plan.prediction.peak_phase in order else 0
    # A plan that fits is the starting point; one that does not, the choices that keep least.
    least = plan.decisions.choices() if plan.outcome.feasible else least_activation_choices(profile)
    phases = phase_bytes(profile, least)
    # under FSDP2's MixedPrecisionPolicy the profile computes in bf16: no one-GPU estimate follows from it
    found = None if plan.request.mesh.param_dtype else smallest_world_size(profile, least, plan.request.usable_bytes)
    steps = [
        _low_precision(plan, profile),
        _tf32(plan, profile),
        _sdpa(plan, profile, peak_index),
        float8_step(plan, profile, every_unit(profile, "keep", plan.target.low_precision), every_unit(profile, "keep", "float8")),
        _compile(plan, profile),
        _checkpointing(plan, profile),
        offload_step(plan, profile),
        grad_accumulation_step(plan, profile, phases, batch_size, replan),
        shorter_sequences_step(plan, profile, phases, seq_len, least),
        *optimizer_state_steps(plan, profile, parameter_count),
        fsdp_step(plan, profile, found, least),
        tensor_parallel_step(plan, found),
    ]
    steps = [planned_by_ladder(step, plan, ladder) for step in steps]
    if state_bound(plan) is not None:  # the units' choices do not matter: say so rather than advise on them
        steps = [_no_help(step) if step.key in ACTIVATION_SIDE else step for step in steps]
    first_fix = None
    if not plan.outcome.feasible:
        first_fix = next((s.key for s in steps if s.status == "try" and s.saves_bytes is not None
                          and plan.prediction.peak_bytes - s.saves_bytes <= plan.request.usable_bytes), None)
    requested = sharded_peak(profile, least, mesh) if mesh is not None else None
    return Advice(plan.outcome.feasible, plan.prediction.peak_bytes, plan.request.usable_bytes, tuple(steps), first_fix, found, requested, ladder)
