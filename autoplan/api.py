"""The public API: `plan` decides, `apply` rewrites, `optimize` does both.

    plan = autoplan.plan(model, "20GB", example_inputs=(x,), device="h100-80gb")
    model = autoplan.optimize(model, "20GB", example_inputs=(x,))

Stages run in order — budget/device, trace, profile, solve, verify — and each hands a frozen value
to the next. When the whole-step simulation of a solved plan exceeds the usable budget, the budget
is tightened by the difference and the program solved again.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from typing import Any, Callable, Mapping

import torch

from autoplan.budget import budget_needed_for, make_budget
from autoplan.devices import Device, get_device
from autoplan.hf import default_seq_len, example_inputs_for, is_hf_model, training_inputs
from autoplan.measure import measure_times, model_device
from autoplan.memory import check_world_size, predict_peak, predict_step_time, rank_offsets
from autoplan.partition import is_graph_unit
from autoplan.plan import MODES, Choice, Plan, UnitDecision, WorldSizePoint
from autoplan.profile import Profile, precision_options
from autoplan.profile import profile as profile_units
from autoplan.rewrite import apply_choices
from autoplan.simulate import optimizer_name
from autoplan.solve import fastest, minimum_peak, solve
from autoplan.trace import normalize_inputs, trace
from autoplan.verify import simulate_plan
from autoplan.worlds import fewest_gpus, parameter_count

MAX_RESOLVES = 4


class InfeasibleBudgetError(ValueError):
    """`optimize` was asked for a budget no plan fits; `.plan` says how close it gets."""

    def __init__(self, plan: Plan) -> None:
        from autoplan.budget import format_bytes

        super().__init__(
            f"no plan fits {plan.device} in {format_bytes(plan.budget_bytes)} "
            f"(usable {format_bytes(plan.usable_bytes)}): the lowest peak autoplan can reach is "
            f"{format_bytes(plan.minimum_peak_bytes)}, which needs a budget of "
            f"{format_bytes(plan.minimum_budget_bytes)}. Call autoplan.plan(...) to see the breakdown."
        )
        self.plan = plan


def _matching(units: list[str], patterns, what: str) -> set[str]:
    if isinstance(patterns, str):
        patterns = [patterns]
    matched = {u for u in units if any(fnmatch.fnmatchcase(u, p) for p in patterns)}
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(u, p) for u in units)]
    if unmatched:
        raise ValueError(f"{what}={unmatched} matched no unit; the units are: {', '.join(units)}")
    return matched


def _pins(
    units: list[str], precisions: tuple[str, ...], keep_fp32, checkpoint
) -> dict[str, tuple[Choice, ...]]:
    """Per unit, the choices the person allows (absent: any profiled choice)."""
    modes: dict[str, tuple[str, ...]] = {}
    if checkpoint:
        requested = checkpoint if isinstance(checkpoint, Mapping) else {p: "full" for p in ([checkpoint] if isinstance(checkpoint, str) else checkpoint)}
        for pattern, mode in requested.items():
            if mode not in MODES:
                raise ValueError(f"checkpoint mode for {pattern!r} must be one of {MODES}; got {mode!r}")
            for unit in _matching(units, [pattern], "checkpoint"):
                modes[unit] = (mode,)
    fp32_units = _matching(units, keep_fp32, "keep_fp32") if keep_fp32 else set()
    pins = {}
    for unit in units:
        unit_precisions = ("fp32",) if unit in fp32_units else precisions
        pins[unit] = tuple(Choice(m, p) for p in unit_precisions for m in modes.get(unit, MODES))
    return pins


def training_batch(model: torch.nn.Module, example_inputs: Any, batch_size: int | None, seq_len: int | None):
    """The (args, kwargs) a training step is profiled with: the caller's, or one built for a HF model."""
    if example_inputs is None:
        if not is_hf_model(model):
            raise ValueError(
                f"example_inputs is required for {type(model).__name__}: pass one batch, e.g. "
                "example_inputs=(x,) or example_inputs={'input_ids': ids}. batch_size= and seq_len= "
                "build a batch only for Hugging Face transformers models."
            )
        batch = 1 if batch_size is None else batch_size
        length = default_seq_len(model) if seq_len is None else seq_len
        example_inputs = example_inputs_for(model, batch, length)
    elif batch_size is not None or seq_len is not None:
        raise ValueError(
            "batch_size= and seq_len= build example inputs when example_inputs is omitted; "
            "pass either them or example_inputs, not both"
        )
    return training_inputs(model, normalize_inputs(example_inputs))


def plan(
    model: torch.nn.Module,
    budget: str | int,
    *,
    example_inputs: Any = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    device: str | Device | None = None,
    optimizer: str | torch.optim.Optimizer = "adamw",
    precision: str = "auto",
    units: list[str] | None = None,
    keep_fp32: list[str] | None = None,
    checkpoint: list[str] | Mapping[str, str] | None = None,
    reserve: str | int | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    time_limit_s: float = 10.0,
    profile: str = "auto",
    progress: Callable[[str], None] | None = None,
    on_profile: Callable[[Profile], None] | None = None,
    world_size: int | str = 1,
) -> Plan:
    """Decide, per unit, the checkpoint mode and precision that fit `budget` fastest. Changes nothing.

    budget: "20GB", "20 GiB", "80%" (of the device), or an int of bytes.
    example_inputs: a tuple of positional args, a dict of kwargs, or (args, kwargs); one batch.
        Optional for a Hugging Face model: omitted, a batch of `batch_size` (default 1) ×
        `seq_len` (default: the config's max positions, at most 2048) is built from its config
        (autoplan.hf.example_inputs_for). A HF forward that takes `use_cache` gets False.
    device: a device profile name ("h100-80gb", see autoplan.devices), None for the current GPU (or
        "cpu" without one).
    optimizer: "adamw" (default), "adam", "sgd", "sgd-momentum" or an optimizer instance.
    precision: "auto" (per unit, fp32 or the device's autocast dtype), "fp32", "bf16" or "fp16".
    units: name patterns of the submodules to plan (default: the repeated blocks).
    keep_fp32: unit patterns that must stay fp32. checkpoint: unit patterns that must be checkpointed
        (full), or {pattern: mode}.
    reserve: bytes held back from the budget (default: CUDA context + 5% fragmentation).
    loss_fn: output -> scalar loss for profiling (default: the output's .loss, else a sum).
    profile: where unit times come from: "roofline" (FLOPs and bytes over the device's rates),
        "measure" (real runs on the device the model is on: CUDA events, or the CPU clock), or
        "auto" (measure when the model is on a CUDA device and that device is the target).
    progress: called with a short message as each stage starts. on_profile: called with the
        Profile once measured (autoplan.advise needs it; the CLI uses this).
    world_size: GPUs to shard over with FSDP2 (parameters, gradients and optimizer state 1/N each;
        see memory.rank_offsets): every constraint and every byte of the plan is then per rank.
        "auto": the fewest GPUs whose lowest per-rank peak fits, with the curve in
        plan.world_size_curve. 1 (default): one GPU, no FSDP.
    """
    if world_size != "auto":
        check_world_size(world_size)
    if profile not in ("auto", "measure", "roofline"):
        raise ValueError(f"profile must be 'auto', 'measure' or 'roofline'; got {profile!r}")
    target = get_device(device)
    memory = make_budget(budget, target, reserve)
    precisions = precision_options(precision, target)
    if keep_fp32 and "fp32" not in precisions:
        precisions = (*precisions, "fp32")
    rest = "fp32" if precision == "auto" else precision
    say = progress or (lambda message: None)
    say("tracing")
    traced = trace(model, training_batch(model, example_inputs, batch_size, seq_len), units)
    measured = profile_units(traced, target, optimizer=optimizer, precisions=precisions, rest_precision=rest, loss_fn=loss_fn, progress=say)
    if _should_measure(profile, model, target):
        measured = measure_times(measured, traced, optimizer=optimizer, loss_fn=loss_fn, progress=say)
    if on_profile is not None:
        on_profile(measured)
    allowed_precisions = precision_options(precision, target)
    pins = _pins(list(traced.units), allowed_precisions, keep_fp32, checkpoint)

    usable = memory.usable_bytes
    curve: tuple[WorldSizePoint, ...] = ()
    if world_size == "auto":
        say("finding the smallest number of GPUs")
        world, curve = fewest_gpus(measured, pins, usable, time_limit_s)
    else:
        world = check_world_size(world_size)
    offsets = dict(zip((phase.name for phase in measured.timeline.phases), rank_offsets(measured, world)))

    def simulate(choices):
        return simulate_plan(
            traced, choices, device=target, optimizer=optimizer, rest_precision=rest, loss_fn=loss_fn, rank_offsets=offsets
        )

    say("solving")
    lowest, solve_time = minimum_peak(measured, pins=pins, time_limit_s=time_limit_s, world_size=world)
    lowest_peak = predict_peak(measured, lowest, world).bytes
    lowest_simulated = None  # a whole-step simulation is the slow part at scale: run it when it decides something
    if lowest_peak > usable:
        lowest_simulated = simulate(lowest).peak_bytes
        lowest_peak = max(lowest_peak, lowest_simulated)

    margin, resolves, status = 0, 0, "Infeasible"
    chosen, simulated, feasible = lowest, lowest_simulated, False
    while lowest_peak <= usable and resolves <= MAX_RESOLVES:
        solution = solve(measured, usable - margin, pins=pins, time_limit_s=time_limit_s, world_size=world)
        solve_time += solution.solve_time_s
        status = solution.status
        if not solution.feasible:
            break
        say("verifying the plan with a simulated training step")
        result = simulate(solution.choices)
        predicted = predict_peak(measured, solution.choices, world).bytes
        if result.peak_bytes <= usable and predicted <= usable:
            chosen, simulated, feasible = solution.choices, result.peak_bytes, True
            break
        margin += max(result.peak_bytes, predicted) - usable + 2**20
        resolves += 1
    if simulated is None:  # nothing fitted after all: report the lowest-peak choices as simulated
        simulated = simulate(lowest).peak_bytes
        lowest_peak = max(lowest_peak, simulated)
    decided = _assemble(
        measured, memory, reserve, target, chosen, simulated, feasible, lowest_peak, status, solve_time, resolves, pins, traced, world
    )
    return dataclasses.replace(decided, world_size_curve=curve)


def _should_measure(profile: str, model: torch.nn.Module, target: Device) -> bool:
    device = model_device(model)
    if profile == "roofline":
        return False
    if profile == "auto":
        return device.type == "cuda" and target.kind == "cuda" and target.name == get_device(None).name
    if device.type == "meta":
        raise ValueError("profile='measure' needs real weights; this model is on the meta device. Use profile='roofline'.")
    if device.type != target.kind:
        raise ValueError(
            f"profile='measure' times the model where it is ({device.type}), but the plan is for {target.name} "
            f"({target.kind}); move the model there first, or use profile='roofline'"
        )
    return True


def _assemble(
    measured: Profile, memory, reserve, target, chosen, simulated, feasible, lowest_peak, status, solve_time, resolves, pins, traced,
    world: int = 1,
) -> Plan:
    rest = measured.rest_precision
    prediction = predict_peak(measured, chosen, world)
    notes = []
    if not feasible:
        notes.append("no choice fits the budget; the units show the lowest-peak choices")
    if traced.skip_edges:
        notes.append(f"{len(traced.skip_edges)} skip connection(s) keep tensors alive across units")
    if target.low_precision_name == "fp16" and any(c.precision == "fp16" for c in chosen.values()):
        notes.append("fp16 units need torch.amp.GradScaler in the training loop")
    decisions = tuple(
        UnitDecision(
            name=unit.name,
            choice=chosen[unit.name],
            saved_bytes=unit.options[chosen[unit.name]].held_bytes,
            recompute_flops=unit.recompute_flops(chosen[unit.name]),
            step_time_s=unit.options[chosen[unit.name]].time_s,
        )
        for unit in measured.units
    )
    return Plan(
        model_name=measured.model_name,
        device=target.name,
        low_precision=target.low_precision_name,
        rest_precision=rest,
        needs_grad_scaler=any(c.precision == "fp16" for c in chosen.values()) or rest == "fp16",
        optimizer=measured.optimizer,
        feasible=feasible,
        budget_bytes=memory.total_bytes,
        usable_bytes=memory.usable_bytes,
        predicted_peak_bytes=prediction.bytes,
        simulated_peak_bytes=simulated,
        baseline_peak_bytes=_per_rank_peak(measured.reference, measured, world),
        minimum_peak_bytes=lowest_peak,
        minimum_budget_bytes=budget_needed_for(lowest_peak, target, reserve),
        predicted_step_time_s=predict_step_time(measured, chosen),
        baseline_step_time_s=measured.reference_step_time_s or measured.reference.step_time_s,
        fastest_step_time_s=predict_step_time(measured, fastest(measured, pins)),
        time_source=measured.time_source,
        breakdown=prediction.breakdown,
        peak_phase=prediction.phase,
        units=decisions,
        solver_status=status,
        solve_time_s=solve_time,
        resolves=resolves,
        trace_method=traced.method,
        notes=tuple(notes),
        world_size=world,
        fsdp=prediction.rank,
        parameter_count=parameter_count(measured),
        state_bytes=sum(getattr(measured.timeline.static, part) for part in ("parameters", "gradients", "optimizer")),
    )


def _refuse_meta(model: torch.nn.Module) -> None:
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} has parameters on the meta device (shapes, no data): it can be planned, "
            "not rewritten or trained. Build it with real weights (e.g. autoplan.hf.model_from_config(..., "
            "meta=False) or from_pretrained), then autoplan.apply(model, plan)."
        )


def _per_rank_peak(timeline, measured: Profile, world: int) -> int:
    """A simulated timeline's peak on one of `world` ranks (its own peak on one GPU)."""
    offsets = rank_offsets(measured, world)
    return max(phase.peak_bytes + offset for phase, offset in zip(timeline.phases, offsets))


def apply(model: torch.nn.Module, plan: Plan) -> torch.nn.Module:
    """Rewrite `model` in place to run as `plan` says; returns the same object."""
    if not isinstance(plan, Plan):
        raise TypeError(f"apply() takes a Plan from autoplan.plan(); got {type(plan).__name__}")
    choices = plan.choices()
    from autoplan.trace import unit_endpoints

    _refuse_meta(model)
    if any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()):
        warnings.warn(
            "gradient checkpointing turned on by gradient_checkpointing_enable() (or activation_checkpointing_enable()) "
            "is ignored on the planned layers: the plan decides which layers recompute, never twice. "
            "autoplan.remove_plan(model) gives it back.",
            UserWarning,
            stacklevel=2,
        )
    for name in choices:
        if is_graph_unit(name):
            continue  # checked when the graph is split: split_by_units names the graph's units
        try:
            unit_endpoints(model, name)
        except (AttributeError, IndexError, KeyError, TypeError) as error:
            raise ValueError(f"the plan names unit {name!r}, which {type(model).__name__} does not have: {error}") from None
    if plan.world_size > 1:
        from autoplan.shard import apply_fsdp

        return apply_fsdp(model, plan)
    return apply_choices(model, choices, rest_precision=plan.rest_precision)


def optimize(model: torch.nn.Module, budget: str | int, **options: Any) -> torch.nn.Module:
    """Plan for `budget` and rewrite `model` in place; returns the same model object.

    Takes the same arguments as `plan`. Raises InfeasibleBudgetError (with `.plan`) when no plan
    fits, rather than returning a model that would run out of memory. With world_size > 1 (or
    "auto") it must run in every rank of an initialised process group (torchrun): the model comes
    back FSDP2-sharded (`shard.apply_fsdp`), and the budget is per GPU.
    """
    _refuse_meta(model)
    from autoplan.shard import process_group_world_size, require_process_group

    world_size = options.get("world_size", 1)
    if world_size == "auto" and process_group_world_size() is None:
        require_process_group(0)  # says how to start one
    if world_size != "auto" and check_world_size(world_size) > 1:
        require_process_group(world_size)  # before minutes of planning, not after
    decided = plan(model, budget, **options)
    if not decided.feasible:
        raise InfeasibleBudgetError(decided)
    return apply(model, decided)
