"""One simulated training step, phase by phase: the ground truth the memory model is built on.

`simulate_training` runs a steady-state step of the person's training loop (`TrainingLoop`) on a
fake copy of the model — forward, loss, backward, `optimizer.step()`, `zero_grad` — after what
the earlier steps leave (optimizer state, gradients the loop keeps, the outputs its variables
still hold), and records, for every unit, the peak of its forward and of its backward, the rest
of the model in between, and the optimizer step. It also records what each unit was called with,
so a unit can later be profiled on its own.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ContextManager, Sequence, cast

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autoplan.inputs.devices import Device
from autoplan.inputs.hf_paths import real_mask_decisions
from autoplan.inputs.loop import TrainingLoop
from autoplan.plan import BACKWARD_START, FORWARD_START, OPTIMIZER_STEP, ZERO_GRAD, Phase
from autoplan.units import Unit
from autoplan.profile.recorder import Boundary, UnitCall, UnitRecorder
from autoplan.instruments.target import as_the_target_runs
from autoplan.instruments.caching_allocator import CARRIED, WARM_UP
from autoplan.instruments.cuda_workspaces import held_workspaces
from autoplan.instruments.fake import FakeGradScaler, fake_tree
from autoplan.training.runner import LoopRunner, StepHooks, held_by_loop
from autoplan.instruments.quantized import resident_tensors
from autoplan.vocabulary.tensors import tensors_of, unique_storage_bytes
from autoplan.instruments.accumulation import accumulating_adds
from autoplan.instruments.tracker import LiveBytesTracker, RooflineRates, TrackedPhase
from autoplan.training.step_parts import default_loss, loss_function, make_optimizer, model_loss, optimizer_state_tensors


@dataclass(frozen=True)
class PhaseSample:
    """One phase of step 2."""

    phase: Phase
    start_bytes: int
    peak_bytes: int
    grad_bytes: int  # gradient bytes alive when the phase began
    time_s: float
    flops: int

    @property
    def name(self) -> str:
        return str(self.phase)

    @property
    def unit(self) -> str | None:
        """The unit whose forward or backward this is, None for the rest of the model and the step."""
        return self.phase.running_unit

    @property
    def kind(self) -> str:
        return self.phase.kind


@dataclass(frozen=True)
class StaticBytes:
    """Memory that does not depend on checkpointing."""

    parameters: int  # parameters and buffers, tied weights once
    gradients: int  # one gradient per trainable parameter
    optimizer: int  # optimizer state after a step
    inputs: int  # the example batch
    workspaces: int = 0  # what cuBLAS holds on a CUDA target from the first matmul on (instruments.cuda_workspaces)
    loop_held: int = 0  # the loop's own device memory: micro-batches beyond the one planned, what it keeps (TrainingLoop)


@dataclass(frozen=True)
class Timeline:
    phases: tuple[PhaseSample, ...]
    peak_bytes: int
    unit_calls: tuple[UnitCall, ...]  # forward order
    static: StaticBytes
    boundaries: tuple[Boundary, ...] = ()
    carried_bytes: int = 0  # what the loop's variables hold from the previous step through this forward (outputs, loss)
    fused_logits: str = ""  # the logits whose cross-entropy the step fused with the output head (planned.loss_head), "" for none
    fusing_held_longer: bool = False  # run to fuse its loss head, the step kept a linear's input longer than as written
    target_kernels: str = ""  # what was stood in for the GPU target's kernels (instruments.target), "" for a CPU target
    host_peak_bytes: int = 0  # pinned host memory of offloaded units' saved tensors, at its most (axes.placement)
    loss_summed: bool = False  # no loss_fn and no loss of the model's own: the step backpropagated its outputs' sum
    # a GPU target: the step's device allocations and frees in order, for the caching allocator's model
    # (instruments.caching_allocator.steady_reserved_bytes, replayed only for the plan chosen); () on a CPU target
    allocation_log: tuple = field(default=(), compare=False, repr=False)

    @property
    def step_time_s(self) -> float:
        return sum(phase.time_s for phase in self.phases)

    @property
    def fused_loss(self) -> bool:
        """Whether the step ran its loss head fused (`fused_logits` names the logits)."""
        return bool(self.fused_logits)


def _phase_sample(tracked: TrackedPhase, grad_bytes: int, carried_bytes: int) -> PhaseSample:
    # the previous step's outputs (or loss) stay alive until this step's forward returns
    phase = cast(Phase, tracked.label)  # the recorder labels a training step's phases with Phases
    extra = carried_bytes if phase.kind == "fwd" else 0
    return PhaseSample(phase, tracked.start_bytes + extra, tracked.peak_bytes + extra, grad_bytes, tracked.time_s, tracked.flops)


def simulate_training(
    model: torch.nn.Module,
    example_inputs: tuple[tuple, dict],
    *,
    fake_mode: FakeTensorMode,
    units: list[Unit],
    device: Device,
    optimizer: str | torch.optim.Optimizer,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    loop: TrainingLoop | None = None,
    rates: RooflineRates | None = None,
) -> Timeline:
    """Simulate a steady-state training step of `model` (a fake copy) in `loop`; return its timeline, its ops timed at
    `rates` (default the device's; compiled code's: `instruments.tracker.FusedElementwiseRates`).

    The earlier steps matter only for what they leave: the optimizer state, the gradients of the
    earlier micro-batches (accumulation) or zeroed ones (`zero_grad(set_to_none=False)`), and the
    outputs the loop's variables still hold. So they are made directly, and the recorded step is
    the last micro-batch of a step, the one that runs with every gradient alive, then
    optimizer.step() and zero_grad.
    """
    loop = loop or TrainingLoop()
    step = (model, example_inputs, fake_mode, units, device, optimizer, loss_fn, loop)
    timeline, gradless = _simulated_step(*step, gradless=frozenset(), rates=rates)
    if gradless:
        # Parameters no gradient reaches (a vision layer whose output the model does not use) have
        # none in the real loop, and so no optimizer state: the step again without them.
        for param in model.parameters():
            param.grad = None
        timeline, _ = _simulated_step(*step, gradless=gradless, rates=rates)
    return timeline


def _watched_loss(loss_fn, loop: TrainingLoop) -> tuple[Callable, list[bool]]:
    """The loop's loss function, and a list that says, once it ran, whether it summed the outputs for want of a loss
    (no loss_fn, and no loss of the model's own): the plan's notes say so, as a loss outside the model holds more."""
    summed = [loss_fn is None and loop.loss_in_model is False]  # loss_function sums the outputs then

    def guessed(output):
        summed.append(model_loss(output) is None)
        return default_loss(output)  # looked up when called, so that the module's default_loss is the one used

    return loss_function(loss_fn, loop.loss_in_model, default=guessed), summed


def _simulated_step(model, example_inputs, fake_mode, units, device, optimizer, loss_fn, loop: TrainingLoop, *,
                    gradless: frozenset[int], rates: RooflineRates | None = None) -> tuple[Timeline, frozenset[int]]:
    """One simulated step (`simulate_training`), the parameters in `gradless` (by id) given no gradient by the
    earlier steps; and the trainable parameters its backward gave no gradient."""
    tracker = LiveBytesTracker(rates or device)
    recorder = UnitRecorder(tracker, model, units)
    try:
        # transformers' mask shortcuts are decided on the real batch, before it is faked
        with real_mask_decisions(example_inputs), fake_mode, as_the_target_runs(device) as target, tracker:
            tracker.adopt(resident_tensors(model))
            workspaces = held_workspaces(device)  # alive through the step, as the card's are
            tracker.adopt(workspaces)
            args, kwargs = fake_tree(example_inputs, fake_mode)
            batch = tensors_of((args, kwargs))
            loop_held = held_by_loop(loop, example_inputs)  # fakes, alive through the step as the loop holds them
            tracker.adopt(loop_held)
            trainable = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
            opt = make_optimizer(optimizer, trainable, implementation=loop.optimizer_implementation(device.kind), device_kind=device.kind)
            runner = LoopRunner(model, opt, loop, loss_fn, scaler=FakeGradScaler() if loop.grad_scaler else None)
            runner.loss_of, summed = _watched_loss(loss_fn, loop)
            graded = [p for p in trainable if id(p) not in gradless]
            tracker.begin_phase(WARM_UP)
            warm_up(runner, graded)
            first_phase = tracker.phase_count
            hooks = _RecordingHooks(recorder, model, (args, kwargs), loop.keep_outputs)
            hooks.sums = lambda: accumulating_adds(tracker, runner.loss)
            runner.hooks = hooks
            reached = _GradientsReached(trainable)
            # the last micro-batch of a step, the one that runs with every gradient alive
            with reached:
                runner.micro_batch(args, kwargs)
            runner.optimizer_step()
            static = StaticBytes(
                parameters=unique_storage_bytes(resident_tensors(model)),
                gradients=unique_storage_bytes(graded),
                optimizer=unique_storage_bytes(optimizer_state_tensors(opt)),
                inputs=unique_storage_bytes(batch),
                workspaces=unique_storage_bytes(workspaces),
                loop_held=unique_storage_bytes(loop_held),
            )
            # what the loop's variables still hold when the next step's forward runs
            alive = tracker.live_bytes
            tracker.mark(CARRIED)
            runner.outputs = runner.loss = None
            carried = alive - tracker.live_bytes
            log = tuple(tracker.allocation_log or ())  # taken here: frees after the step are not the step's
    finally:
        recorder.remove()
    phases = tuple(
        _phase_sample(phase, grad, carried) for phase, grad in zip(tracker.phases(first_phase), recorder.grad_bytes, strict=True)
    )
    missing = [unit.name for unit in units if unit.name not in {call.name for call in hooks.calls}]
    if missing:
        raise RuntimeError(f"units {missing} never ran during the forward; they cannot be planned")
    timeline = Timeline(phases, max(p.peak_bytes for p in phases), hooks.calls, static, hooks.boundaries, carried,
                        target_kernels=target.note() if target is not None else "", host_peak_bytes=tracker.host_peak_bytes,
                        allocation_log=log, loss_summed=any(summed))
    return timeline, frozenset(id(p) for p in trainable) - reached.ids


class _GradientsReached:
    """While open, notes (by id) the parameters a gradient is accumulated into."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.ids: set[int] = set()
        self._handles: list[Any] = []

    def __enter__(self) -> _GradientsReached:
        self._handles = [p.register_post_accumulate_grad_hook(lambda param: self.ids.add(id(param))) for p in self.params]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()


class _RecordingHooks(StepHooks):
    """The recorder's marks at the step's phases: what each unit was called with, which tensors it
    passed on, and a phase at every boundary, forward and backward."""

    def __init__(self, recorder: UnitRecorder, model: torch.nn.Module, batch: tuple[tuple, dict], keep_outputs: bool) -> None:
        self.recorder, self.model, self.batch, self.keep_outputs = recorder, model, batch, keep_outputs
        self.calls: tuple[UnitCall, ...] = ()
        self.boundaries: tuple[Boundary, ...] = ()
        self.sums: Callable[[], ContextManager] = contextlib.nullcontext  # where the engine adds gradients, per backward
        self._backward = contextlib.ExitStack()

    def forward_context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.recorder.pack, _identity)

    def forward_started(self) -> None:
        self.recorder.recording = True
        self.recorder.begin(FORWARD_START)
        self.recorder.in_forward = True

    def forward_finished(self, output: Any) -> None:
        self.recorder.in_forward = False
        self.calls = tuple(self.recorder.calls.values())
        # alive whatever the units choose: the batch, parameters a unit is handed as an argument
        # (a graph unit of `x * self.scale`), and the outputs when the loop holds them
        held = tensors_of(self.batch) + resident_tensors(self.model) + (tensors_of(output) if self.keep_outputs else [])
        held_keys = {self.recorder.key(t) for t in held}
        self.boundaries = self.recorder.boundaries(held_keys)
        self.calls = tuple(replace(call, resident_inputs=tuple(key in held_keys for key in call.input_keys))
                           for call in self.calls)

    def backward_started(self) -> None:
        self.recorder.begin(BACKWARD_START)
        self._backward.enter_context(self.sums())

    def optimizer_step_started(self) -> None:
        self.backward_done()
        self.recorder.begin(OPTIMIZER_STEP)

    def backward_done(self) -> None:
        self._backward.close()

    def zero_grad_started(self) -> None:
        self.recorder.begin(ZERO_GRAD)


def warm_up(runner: LoopRunner, trainable: Sequence[torch.Tensor]) -> None:
    """What the earlier steps leave behind for the recorded one: the optimizer's state, and the gradients.

    Under fake tensors the values do not matter, so gradients made here stand in for a forward and
    backward; the step that follows sees exactly what it would after real ones, at a fraction of
    the simulation's cost (the forward and backward are most of it). With accumulation the
    recorded micro-batch is a later one: the earlier micro-batches' gradients are alive and its
    backward adds into them (a micro-batch with them alive peaks at least as high as the first).
    """
    for param in trainable:
        param.grad = torch.empty_like(param)
    with _stepping_in_foreach(runner.optimizer):
        runner.optimizer_step()
    loop = runner.loop
    if loop.accumulation_steps > 1 and loop.zero_grad_set_to_none:
        for param in trainable:
            param.grad = torch.zeros_like(param)


@contextlib.contextmanager
def _stepping_in_foreach(optimizer: torch.optim.Optimizer):
    """A torch optimizer's groups in the foreach implementation while entered, where the groups choose one.

    The warm-up's step is there for the state it leaves, which both implementations make alike (one
    `_init_group`, parameter by parameter); its temporaries are freed within it, and neither the
    timeline nor the allocator's replay reads them. Foreach runs a few ops over every parameter where
    the for-loop runs each op per parameter (benchmarks/instruments.py's tiny Llama for a cpu target:
    1,670 ops on data a simulated step at 88a2efe, 1,440 so). Fused, differentiable or capturable groups, and
    optimizers from elsewhere (bitsandbytes, the person's own), step as they are.
    """
    groups = optimizer.param_groups
    as_set = [group.get("foreach") for group in groups]
    if not type(optimizer).__module__.startswith("torch.optim.") or not all(
            "foreach" in group and not group.get("fused") and not group.get("differentiable") and not group.get("capturable")
            for group in groups):
        yield
        return
    for group in groups:
        group["foreach"] = True
    try:
        yield
    finally:
        for group, foreach in zip(groups, as_set):
            group["foreach"] = foreach


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
