"""Verify in real steps: train the planned model for N steps and measure whether the plan held.

`verify(model, plan, example_inputs)` runs real training steps of the rewritten model, with the
budget enforced on CUDA (`torch.cuda.set_per_process_memory_fraction`), and reports the measured
peak (`max_memory_allocated`, and reserved) against the predicted and simulated peaks, and the
measured step time against the predicted one. On the CPU the peak is the CPU allocator's own count of
the bytes it holds (`verify.allocator`), which shares nothing with the simulation's tracker, so a
tensor the simulation forgets or keeps too long shows as a difference. Parameters, buffers, gradients
and the RNG state are put back afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from autoplan.errors import OptionError, OptionTypeError, ProfileError, SegmentError, TrainingStepError
from autoplan.inputs.batch import normalize_inputs
from autoplan.inputs.devices import get_device
from autoplan.inputs.hf_models import training_inputs
from autoplan.inputs.loop import TrainingLoop, check_loop
from autoplan.plan import Plan
from autoplan.planned.forwards import apply_choices, has_fused_loss, planned_units
from autoplan.planned.transaction import restored_on_failure
from autoplan.instruments.quantized import settle_first_forward
from autoplan.vocabulary.fingerprint import check_batch, check_model
from autoplan.verify.allocator import AllocatorCount
from autoplan.verify.failures import failed_step_message
from autoplan.training.runner import LoopRunner, held_by_loop
from autoplan.training.step_parts import (
    OPTIMIZERS,
    Timer,
    make_optimizer,
    model_device,
    preserved,
)


@dataclass(frozen=True)
class Verification:
    """What N real training steps of a planned model measured, next to what the plan predicted."""

    device: str  # the device the steps ran on
    steps: int
    peak_source: str  # "torch.cuda.max_memory_allocated", or CPU_ALLOCATOR_SOURCE
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
    loop: TrainingLoop | None = None  # the loop the steps ran
    measured_time_source: str = ""  # how the steps were timed: "CUDA events", or the CPU clock with every tensor counted
    predicted_time_source: str = ""  # the plan's time_source: "roofline", "measured (CUDA events)", ...
    planned_device: str = ""  # the device profile the plan's times are for, e.g. "h100-80gb"

    @property
    def peak_error(self) -> float | None:
        """(measured − predicted) / predicted."""
        if self.measured_peak_bytes is None:
            return None
        return (self.measured_peak_bytes - self.predicted_peak_bytes) / self.predicted_peak_bytes

    @property
    def times_comparable(self) -> bool:
        """Whether the predicted step time is a timing of the same kind as the measured one: the plan's units
        timed with CUDA events, and these steps too. A roofline is a lower bound at datasheet rates, not a
        forecast; the CPU steps run under the live-bytes tracker, slower than training."""
        return self.predicted_time_source == self.measured_time_source == CUDA_EVENTS_SOURCE

    @property
    def step_time_error(self) -> float | None:
        """(measured − predicted) / predicted, where the two are timings of the same kind; else None."""
        if self.measured_step_time_s is None or not self.times_comparable or not self.predicted_step_time_s:
            return None
        return (self.measured_step_time_s - self.predicted_step_time_s) / self.predicted_step_time_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"peak_error": self.peak_error, "step_time_error": self.step_time_error}


CUDA_EVENTS_SOURCE = "measured (CUDA events)"  # profile.timing's time_source for a plan timed on this GPU
CPU_TRACKED_SOURCE = "CPU wall clock while torch.profiler records every allocation, slower than a plain step"
CPU_ALLOCATOR_SOURCE = "CPU allocator's count, 512 B blocks"  # verify.allocator: torch.profiler's memory events


def _checked(model: torch.nn.Module, plan: Plan, steps: int, optimizer: str | torch.optim.Optimizer | None):
    """verify()'s arguments, before the model changes: the device it runs on, and the optimizer it trains with."""
    if not isinstance(plan, Plan):
        raise OptionTypeError(f"verify() takes a Plan from autoplan.plan(); got {type(plan).__name__}")
    if steps < 2:
        raise OptionError(f"steps must be at least 2 (the first step creates the optimizer state); got {steps}")
    device = model_device(model)
    if device.type == "meta":
        raise OptionError("the model's parameters are on the meta device; load real weights (or build it on a device) to verify")
    optimizer = optimizer if optimizer is not None else plan.request.optimizer
    if isinstance(optimizer, str) and optimizer not in OPTIMIZERS:
        raise OptionError(f"the plan counted a {optimizer} optimizer; pass verify(..., optimizer=) the instance you train with")
    return device, optimizer


@torch.enable_grad()  # real training steps, whatever grad mode the caller is in
def verify(
    model: torch.nn.Module,
    plan: Plan,
    *,
    example_inputs: Any,
    steps: int = 3,
    optimizer: str | torch.optim.Optimizer | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    enforce_budget: bool = True,
    loop: TrainingLoop | None = None,
    check: bool = True,
) -> Verification:
    """Train `steps` real steps of `model` run as `plan` says, and measure what the plan predicted.

    The model is rewritten with the plan if it is not already, and runs on the device its
    parameters are on. Each step is one optimizer step of the training loop the plan was made for
    (`plan.request.loop`; `loop=` overrides it): its micro-batches, the outputs kept or dropped as it says,
    its optimizer implementation, zero_grad and GradScaler. On CUDA the budget is enforced (the
    allocator may not go beyond it), so a plan that does not hold ends in an out-of-memory error,
    reported here rather than raised. Parameters, buffers and the RNG state are put back
    afterwards. `optimizer` defaults to the one the plan counted. A model or batch other than the
    plan's (another parameter shape or dtype, another batch shape) raises PlanMismatchError: the
    plan's peak says nothing about them. check=False runs it anyway.
    """
    device, optimizer = _checked(model, plan, steps, optimizer)
    settle_first_forward(model)  # as plan() and apply() do: a 4-bit layer's bias in its compute dtype
    if check:  # before the model changes
        check_model(plan.model.fingerprint, model)
        check_batch(plan.model.fingerprint, normalize_inputs(example_inputs))
    if planned_units(model) != plan.decisions.choices_by_unit() or has_fused_loss(model) != plan.decisions.fused_loss:
        with restored_on_failure(model):  # as apply: an error or a Ctrl-C halfway leaves the model as it was
            apply_choices(model, plan.decisions.choices_by_unit(), plan.decisions.outside_units)
    loop = check_loop(loop if loop is not None else plan.request.loop)
    args, kwargs = training_inputs(model, normalize_inputs(example_inputs))  # as planned: no KV cache
    cuda = device.type == "cuda"
    with preserved(model), _budget_enforced(plan.request.budget_bytes if enforce_budget and cuda else None, device):
        run = _run_steps(model, (args, kwargs), optimizer, loss_fn, steps, loop, get_device(plan.target.device).kind)
    peak, reserved, times, out_of_memory = run.peak_bytes, run.reserved_bytes, run.step_times_s, run.out_of_memory
    held = not out_of_memory and peak is not None and peak <= plan.request.usable_bytes
    return Verification(
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        steps=steps,
        peak_source="torch.cuda.max_memory_allocated" if cuda else CPU_ALLOCATOR_SOURCE,
        measured_peak_bytes=peak,
        measured_reserved_bytes=reserved,
        predicted_peak_bytes=plan.prediction.peak_bytes,
        simulated_peak_bytes=plan.prediction.simulated_peak_bytes,
        usable_bytes=plan.request.usable_bytes,
        budget_bytes=plan.request.budget_bytes,
        measured_step_time_s=statistics.median(times) if times else None,
        predicted_step_time_s=plan.prediction.step_time_s,
        out_of_memory=out_of_memory,
        held=held,
        loop=loop,
        measured_time_source=CUDA_EVENTS_SOURCE if cuda else CPU_TRACKED_SOURCE,
        predicted_time_source=plan.prediction.time_source,
        planned_device=plan.target.device,
    )


@dataclass(frozen=True)
class _StepsRun:
    peak_bytes: int | None  # steady-state peak: steps after the first
    reserved_bytes: int | None  # CUDA only
    step_times_s: list[float]  # the steps after the first
    out_of_memory: bool


def _run_steps(model, batch: tuple[tuple, dict], optimizer, loss_fn, steps: int, loop: TrainingLoop,
               profile_device_kind: str) -> _StepsRun:
    """`steps` real optimizer steps of `loop`; the peak is counted from the second (optimizer state exists)."""
    args, kwargs = batch
    device = model_device(model)
    cuda = device.type == "cuda"
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer, params, implementation=loop.optimizer_implementation(profile_device_kind))
    runner = LoopRunner(model, opt, loop, loss_fn, device.type)
    timer = Timer(device)
    held = held_by_loop(loop, batch, device)  # alive through the steps, as the loop planned for holds them
    # on the CPU, counted from before the first step: the allocator reports only what it allocates while counted
    count = None if cuda else AllocatorCount(resident=(model, batch, opt, held))
    if cuda:  # what planning's own measurements left cached is not the step's: reserved is the step's alone
        torch.cuda.empty_cache()
    times: list[float] = []
    step = 0
    try:
        with count if count is not None else contextlib.nullcontext():
            for step in range(steps):
                if step == 1:
                    _start_peak(count, device)
                seconds, _ = timer(lambda: runner.step(args, kwargs))
                if step >= 1:
                    times.append(seconds)
        peak, reserved = _read_peak(count, device)
        return _StepsRun(peak, reserved, times, False)
    except torch.cuda.OutOfMemoryError:
        return _StepsRun(None, None, times, True)
    except (SegmentError, ProfileError):
        raise
    except Exception as error:  # the model's or a library's own code: a model error, named, not a bug of ours
        raise TrainingStepError(failed_step_message(error, step, steps)) from error
    finally:
        runner.close()


def _start_peak(count: AllocatorCount | None, device: torch.device) -> None:
    """From step 2 on (optimizer state exists)."""
    if count is None:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        count.mark("steady")


def _read_peak(count: AllocatorCount | None, device: torch.device) -> tuple[int, int | None]:
    if count is None:
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return max(stretch.peak_bytes for stretch in count.stretches()[1:]), None


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
