"""Measured unit times: real runs on the machine's own device, where fake tensors only estimate.

`measure_times(profile, traced)` times each distinct unit's forward and backward (recomputation
included) under every choice, after warm-up (median of several runs; CUDA events on a GPU, the
wall clock on the CPU), plus the whole base and no-plan training steps. The returned Profile
carries these times in place of the roofline estimates, so the ILP ranks by them. The model is
left as it was found.
"""

from __future__ import annotations

import dataclasses
import statistics
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from autoplan.errors import OptionError
from autoplan.inputs.devices import Device
from autoplan.inputs.loop import TrainingLoop
from autoplan.axes.precision import kind
from autoplan.plan import Choice, OutsideUnits, Precision
from autoplan.profile.recorder import TensorSpec, materialize_inputs
from autoplan.profile.profiler import Profile, UnitCost
from autoplan.vocabulary.names import unit_module
from autoplan.planned.forwards import apply_choices, remove_plan
from autoplan.vocabulary.tensors import tensors_of
from autoplan.training.runner import LoopRunner
from autoplan.training.step_parts import Timer, make_optimizer, model_device, preserved
from autoplan.planned.wrappers import PlannedForward
from autoplan.trace.tracer import Traced


def _real_inputs(inputs: Any, device: torch.device) -> Any:
    def make(spec: TensorSpec) -> torch.Tensor:
        if spec.dtype.is_floating_point:
            tensor = torch.randn(spec.shape, dtype=spec.dtype, device=device)
        else:  # indices, masks: zeros are valid for any table size
            tensor = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        return tensor.requires_grad_(spec.requires_grad and spec.dtype.is_floating_point)

    return materialize_inputs(inputs, make)


def _time_unit(module, inputs, choice: Choice, rest: Precision, device, warmup: int, runs: int) -> tuple[float, float]:
    planned = PlannedForward(module, choice)
    timer = Timer(device)
    fwd_times, bwd_times = [], []
    for run in range(warmup + runs):
        args, kwargs = _real_inputs(inputs, device)
        with kind(rest).running(module, device.type):
            fwd_s, output = timer(lambda: planned(*args, **kwargs))
        outputs = [t for t in tensors_of(output) if t.requires_grad]
        grads = [torch.ones_like(t) for t in outputs]
        bwd_s, _ = timer(lambda: torch.autograd.backward(outputs, grads) if outputs else None)
        for param in module.parameters():
            param.grad = None
        if run >= warmup:
            fwd_times.append(fwd_s)
            bwd_times.append(bwd_s)
    return statistics.median(fwd_times), statistics.median(bwd_times)


def _time_steps(model, example_inputs, optimizer, device: Device, loss_fn, warmup: int, runs: int, loop: TrainingLoop) -> float:
    """Median seconds of one micro-batch of `loop` and its optimizer step, as the timeline times it."""
    loop = dataclasses.replace(loop, accumulation_steps=1)
    args, kwargs = example_inputs
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer, params, implementation=loop.optimizer_implementation(device.kind))
    runner = LoopRunner(model, opt, loop, loss_fn, model_device(model).type)
    timer = Timer(model_device(model))
    times = []
    try:
        for run in range(warmup + runs):
            seconds, _ = timer(lambda: runner.step(args, kwargs))
            if run >= warmup:
                times.append(seconds)
    finally:
        runner.close()
    return statistics.median(times)


def measure_times(
    profile: Profile,
    traced: Traced,
    *,
    optimizer: str | torch.optim.Optimizer = "adamw",
    loss_fn: Callable | None = None,
    warmup: int = 2,
    runs: int = 5,
    progress: Callable[[str], None] | None = None,
) -> Profile:
    """`profile` with every unit's times, and the base and no-plan step times, measured for real."""
    model = traced.model
    device = model_device(model)
    if device.type == "meta":
        raise OptionError("the model's parameters are on the meta device: there is nothing real to time; use profile='roofline'")
    say = progress or (lambda message: None)
    calls = {call.name: call for call in profile.timeline.unit_calls}
    rest = profile.rest_precision
    measured: dict[int, Mapping[Choice, UnitCost]] = {}
    units = []
    with preserved(model):
        for index, unit in enumerate(profile.units):
            key = id(unit.options)  # identical units share one options mapping
            if key not in measured:
                say(f"timing unit {index + 1}/{len(profile.units)}: {unit.name}")
                module = unit_module(model, unit.unit)
                costs = {}
                for choice, cost in unit.options.items():
                    fwd_s, bwd_s = _time_unit(module, calls[unit.name].inputs, choice, rest, device, warmup, runs)
                    costs[choice] = dataclasses.replace(cost, fwd_time_s=fwd_s, bwd_time_s=bwd_s)
                measured[key] = MappingProxyType(costs)
            units.append(dataclasses.replace(unit, options=measured[key]))
        say("timing whole training steps")
        base = {u.unit: u.base for u in profile.units}
        steps = {}
        fused = profile.timeline.fused_loss
        for name, choices, outside in (("base", base, OutsideUnits(rest, fused)), ("reference", {}, OutsideUnits())):
            apply_choices(model, choices, outside)
            try:
                steps[name] = _time_steps(model, traced.example_inputs, optimizer, profile.device, loss_fn, warmup, runs, profile.loop)
            finally:
                remove_plan(model)
    source = "measured (CUDA events)" if device.type == "cuda" else "measured (CPU wall clock)"
    return dataclasses.replace(
        profile, units=tuple(units), time_source=source, base_step_time_s=steps["base"], reference_step_time_s=steps["reference"]
    )


# -- verify ---------------------------------------------------------------------------------------
