"""Measure stage: real runs on the machine's own device, where fake tensors only estimate.

Two measurements, both on the real model and real tensors:
- `measure_times(profile, traced)`: each distinct unit's forward and backward (recomputation
  included) under every choice, timed after warm-up (median of several runs; CUDA events on a
  GPU, the wall clock on the CPU), plus the whole base and no-plan training steps. The returned
  Profile carries these times in place of the roofline estimates, so the ILP ranks by them.
- `verify(model, plan, example_inputs)`: N real training steps of the rewritten model, with the
  budget enforced on CUDA (`torch.cuda.set_per_process_memory_fraction`), reporting the measured
  peak (`max_memory_allocated`, and reserved) against the predicted and simulated peaks, and the
  measured step time against the predicted one. On the CPU the peak is the live tensor bytes of
  the real run, counted by the same tracker the simulation uses.

Both leave the model as they found it: parameters, buffers, gradients and the RNG state are put
back afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from autoplan.devices import Device, get_device
from autoplan.plan import Choice, Plan
from autoplan.profile import Profile, UnitCost
from autoplan.rewrite import DTYPES, PlannedForward, apply_choices, planned_choices, remove_plan
from autoplan.simulate import OPTIMIZERS, LiveBytesTracker, default_loss, make_optimizer
from autoplan.timeline import TensorSpec, _tensors_of
from autoplan.trace import Traced, normalize_inputs, unit_module


def model_device(model: torch.nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


class _Timer:
    """Median seconds of a callable: CUDA events on a GPU (the GPU's own time), else the clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, function: Callable[[], Any]) -> tuple[float, Any]:
        if not self.cuda:
            started = time.perf_counter()
            result = function()
            return time.perf_counter() - started, result
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = function()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3, result


@contextlib.contextmanager
def preserved(model: torch.nn.Module) -> Iterator[None]:
    """Run real steps on `model` and put its parameters, buffers, gradients and the RNG back."""
    params = list(model.parameters())
    saved = [t.detach().to("cpu", copy=True) for t in params + list(model.buffers())]
    grads = [p.grad for p in params]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(params + list(model.buffers()), saved):
                tensor.copy_(value)
        for param, grad in zip(params, grads):
            param.grad = grad
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _real_inputs(inputs: Any, device: torch.device) -> Any:
    def make(spec: TensorSpec) -> torch.Tensor:
        if spec.dtype.is_floating_point:
            tensor = torch.randn(spec.shape, dtype=spec.dtype, device=device)
        else:  # indices, masks: zeros are valid for any table size
            tensor = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        return tensor.requires_grad_(spec.requires_grad and spec.dtype.is_floating_point)

    return tree_map_only(TensorSpec, make, inputs)


def _rest_autocast(rest: str, device: torch.device):
    if rest == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[rest], cache_enabled=False)


def _time_unit(module, inputs, choice: Choice, rest: str, device, warmup: int, runs: int) -> tuple[float, float]:
    planned = PlannedForward(module, choice)
    timer = _Timer(device)
    fwd_times, bwd_times = [], []
    for run in range(warmup + runs):
        args, kwargs = _real_inputs(inputs, device)
        with _rest_autocast(rest, device):
            fwd_s, output = timer(lambda: planned(*args, **kwargs))
        outputs = [t for t in _tensors_of(output) if t.requires_grad]
        grads = [torch.ones_like(t) for t in outputs]
        bwd_s, _ = timer(lambda: torch.autograd.backward(outputs, grads) if outputs else None)
        for param in module.parameters():
            param.grad = None
        if run >= warmup:
            fwd_times.append(fwd_s)
            bwd_times.append(bwd_s)
    return statistics.median(fwd_times), statistics.median(bwd_times)


def _time_steps(model, example_inputs, optimizer, device: Device, loss_fn, warmup: int, runs: int) -> float:
    args, kwargs = example_inputs
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer, params, device)
    timer = _Timer(model_device(model))
    times = []
    for run in range(warmup + runs):
        seconds, _ = timer(lambda: train_step(model, args, kwargs, opt, loss_fn))
        if run >= warmup:
            times.append(seconds)
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
        raise ValueError("the model's parameters are on the meta device: there is nothing real to time; use profile='roofline'")
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
                module = unit_module(model, unit.name)
                costs = {}
                for choice, cost in unit.options.items():
                    fwd_s, bwd_s = _time_unit(module, calls[unit.name].inputs, choice, rest, device, warmup, runs)
                    costs[choice] = dataclasses.replace(cost, fwd_time_s=fwd_s, bwd_time_s=bwd_s)
                measured[key] = MappingProxyType(costs)
            units.append(dataclasses.replace(unit, options=measured[key]))
        say("timing whole training steps")
        base = {u.name: u.base for u in profile.units}
        steps = {}
        for name, choices, rest_precision in (("base", base, rest), ("reference", {}, "fp32")):
            apply_choices(model, choices, rest_precision=rest_precision)
            try:
                steps[name] = _time_steps(model, traced.example_inputs, optimizer, profile.device, loss_fn, warmup, runs)
            finally:
                remove_plan(model)
    source = "measured (CUDA events)" if device.type == "cuda" else "measured (CPU wall clock)"
    return dataclasses.replace(
        profile, units=tuple(units), time_source=source, base_step_time_s=steps["base"], reference_step_time_s=steps["reference"]
    )


# -- verify ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verification:
    """What N real training steps of a planned model measured, next to what the plan predicted."""

    device: str  # the device the steps ran on
    steps: int
    peak_source: str  # "torch.cuda.max_memory_allocated" or "live tensor bytes (CPU)"
    measured_peak_bytes: int | None  # steady-state peak (steps after the first); None after an OOM
    measured_reserved_bytes: int | None  # the caching allocator's reserved peak (CUDA only)
    predicted_peak_bytes: int
    simulated_peak_bytes: int
    usable_bytes: int
    budget_bytes: int
    measured_step_time_s: float | None  # median over the steps after the first
    predicted_step_time_s: float
    out_of_memory: bool
    held: bool  # no OOM and the measured peak within the usable budget

    @property
    def peak_error(self) -> float | None:
        """(measured − predicted) / predicted."""
        if self.measured_peak_bytes is None:
            return None
        return (self.measured_peak_bytes - self.predicted_peak_bytes) / self.predicted_peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"peak_error": self.peak_error}


def verify(
    model: torch.nn.Module,
    plan: Plan,
    *,
    example_inputs: Any,
    steps: int = 3,
    optimizer: str | torch.optim.Optimizer | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    enforce_budget: bool = True,
) -> Verification:
    """Train `steps` real steps of `model` run as `plan` says, and measure what the plan predicted.

    The model is rewritten with the plan if it is not already, and runs on the device its
    parameters are on. On CUDA the budget is enforced (the allocator may not go beyond it), so a
    plan that does not hold ends in an out-of-memory error, reported here rather than raised.
    Parameters, buffers and the RNG state are put back afterwards. `optimizer` defaults to the one
    the plan counted.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"verify() takes a Plan from autoplan.plan(); got {type(plan).__name__}")
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (the first step creates the optimizer state); got {steps}")
    device = model_device(model)
    if device.type == "meta":
        raise ValueError("the model's parameters are on the meta device; load real weights (or build it on a device) to verify")
    optimizer = optimizer if optimizer is not None else plan.optimizer
    if isinstance(optimizer, str) and optimizer not in OPTIMIZERS:
        raise ValueError(f"the plan counted a {optimizer} optimizer; pass verify(..., optimizer=) the instance you train with")
    if planned_choices(model) != plan.choices():
        apply_choices(model, plan.choices(), rest_precision=plan.rest_precision)
    args, kwargs = normalize_inputs(example_inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    profile_device = get_device(plan.device)
    cuda = device.type == "cuda"
    times: list[float] = []
    peak: int | None = None
    reserved: int | None = None
    out_of_memory = False
    with preserved(model), _budget_enforced(plan.budget_bytes if enforce_budget and cuda else None, device):
        opt = make_optimizer(optimizer, params, profile_device)
        timer = _Timer(device)
        tracker = None if cuda else LiveBytesTracker(profile_device)
        try:
            for step in range(steps):
                if step == 1:
                    _start_peak(tracker, device, model, opt, (args, kwargs))
                with tracker if tracker is not None else contextlib.nullcontext():
                    seconds, _ = timer(lambda: train_step(model, args, kwargs, opt, loss_fn))
                if step >= 1:
                    times.append(seconds)
            peak, reserved = _read_peak(tracker, device)
        except torch.cuda.OutOfMemoryError:
            out_of_memory, peak, reserved = True, None, None
        finally:
            opt.zero_grad(set_to_none=True)
            del opt
    held = not out_of_memory and peak is not None and peak <= plan.usable_bytes
    return Verification(
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        steps=steps,
        peak_source="torch.cuda.max_memory_allocated" if cuda else "live tensor bytes (CPU)",
        measured_peak_bytes=peak,
        measured_reserved_bytes=reserved,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        simulated_peak_bytes=plan.simulated_peak_bytes,
        usable_bytes=plan.usable_bytes,
        budget_bytes=plan.budget_bytes,
        measured_step_time_s=statistics.median(times) if times else None,
        predicted_step_time_s=plan.predicted_step_time_s,
        out_of_memory=out_of_memory,
        held=held,
    )


def train_step(model, args, kwargs, opt, loss_fn=None, record_loss: Callable[[float], None] | None = None) -> None:
    """One real training step as the plan models it: loss, backward, optimizer.step(), zero_grad.

    The loss is dropped before the optimizer steps; `record_loss` gets its value first.
    """
    loss = (loss_fn or default_loss)(model(*args, **kwargs))
    if record_loss is not None:
        record_loss(float(loss.detach()))
    loss.backward()
    del loss
    opt.step()
    opt.zero_grad(set_to_none=True)


def _start_peak(tracker: LiveBytesTracker | None, device: torch.device, model, opt, batch) -> None:
    """From step 2 on (optimizer state exists), count from what is alive now: the model, the
    optimizer state and the batch."""
    if tracker is None:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return None
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    inputs = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    tracker.adopt(list(model.parameters()) + list(model.buffers()) + state + inputs)
    tracker.begin_phase("steady")
    return None


def _read_peak(tracker: LiveBytesTracker | None, device: torch.device) -> tuple[int, int | None]:
    if tracker is None:
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return max(phase.peak_bytes for phase in tracker.phases()[1:]), None


@contextlib.contextmanager
def _budget_enforced(budget_bytes: int | None, device: torch.device) -> Iterator[None]:
    if budget_bytes is None:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
