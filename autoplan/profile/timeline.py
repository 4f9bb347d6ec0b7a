"""One simulated training step, phase by phase: the ground truth the memory model is built on.

`simulate_training` runs a steady-state step of the person's training loop (`TrainingLoop`) on a
fake copy of the model — forward, loss, backward, `optimizer.step()`, `zero_grad` — after what
the earlier steps leave (optimizer state, gradients the loop keeps, the outputs its variables
still hold), and records, for every unit, the peak of its forward and of its backward, the rest
of the model in between, and the optimizer step. It also records what each unit was called with,
so a unit can later be profiled on its own.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

from autoplan.errors import RepeatedUnitError
from autoplan.inputs.devices import Device
from autoplan.inputs.hf_paths import real_mask_decisions
from autoplan.inputs.loop import TrainingLoop
from autoplan.plan import BACKWARD_START, FORWARD_START, OPTIMIZER_STEP, ZERO_GRAD, Phase
from autoplan.runtime.fake import FakeGradScaler, fake_tree, scaled_optimizer_step
from autoplan.runtime.names import call_site, unit_endpoints
from autoplan.runtime.tensors import storage_bytes, tensors_of, unique_storage_bytes
from autoplan.runtime.tracker import LiveBytesTracker, TrackedPhase
from autoplan.runtime.training import default_loss, loss_function, make_optimizer, optimizer_state_tensors


@dataclass(frozen=True)
class TensorSpec:
    """Shape and kind of a tensor a unit was called with; enough to make a fake one like it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def materialize(self) -> torch.Tensor:
        tensor = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="cpu")
        return tensor.requires_grad_(self.requires_grad)


@dataclass(frozen=True)
class UnitCall:
    """How a unit was called during the simulated forward, and where its tensors came from.

    Tensors are named by storage keys (one per distinct storage in the step), so the memory model
    can tell which unit's output is which unit's input, and count each such tensor once.
    """

    name: str
    inputs: Any  # (args, kwargs) with TensorSpec leaves in place of tensors
    input_keys: tuple[int, ...]  # storage key of each tensor leaf of the inputs, in flattening order
    input_bytes: tuple[int, ...]
    output_keys: tuple[int, ...]  # storage key of each tensor leaf of the output
    output_bytes: tuple[int, ...]


@dataclass(frozen=True)
class Boundary:
    """A tensor one unit hands another (or the rest of the model hands a unit)."""

    key: int
    bytes: int
    producer: tuple[str, int] | None  # (unit, output leaf), None when made outside the units
    consumers: tuple[tuple[str, int], ...]  # (unit, input leaf) in forward order
    held_by_rest: bool  # the batch, or a parameter: alive through the whole step
    last_forward_use: Phase | None = None  # the last forward phase in which any op read it
    rest_saved_in: Phase | None = None  # the last forward phase in which an op outside the units saved it for backward


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


@dataclass(frozen=True)
class Timeline:
    phases: tuple[PhaseSample, ...]
    peak_bytes: int
    unit_calls: tuple[UnitCall, ...]  # forward order
    static: StaticBytes
    boundaries: tuple[Boundary, ...] = ()
    carried_bytes: int = 0  # what the loop's variables hold from the previous step through this forward (outputs, loss)

    @property
    def step_time_s(self) -> float:
        return sum(phase.time_s for phase in self.phases)


class _UnitRecorder:
    """Forward hooks on the units that open a phase at each unit boundary, forward and backward."""

    def __init__(self, tracker: LiveBytesTracker, model: torch.nn.Module, units: list[str]) -> None:
        self.tracker = tracker
        self.params = list(model.parameters())
        self.recording = False
        self.grad_bytes: list[int] = []
        self.calls: dict[str, UnitCall] = {}
        self.in_rest = False
        self.rest_saved: dict[int, Phase] = {}  # storage key -> the forward phase that saved it
        self._keys: dict[int, tuple[weakref.ref, int]] = {}
        self._last_key = 0
        self._handles = []
        self.in_forward = False  # recomputation in backward calls the unit's layers again: not a new call
        self._started: Counter[int] = Counter()  # per module: calls begun in the recorded forward
        self._finished: Counter[int] = Counter()
        called = {}
        for name in units:
            first, last = unit_endpoints(model, name)
            pre, post = self._pre_hook(name), self._post_hook(name)
            site = call_site(name)
            if site is not None:  # one call of a module that runs several times: its hooks act on that call only
                pre = self._on_call(first, site.index + 1, pre, self._started)  # its own call already counted
                post = self._on_call(first, site.index, post, self._finished)  # not yet counted as finished
                called[id(first)] = first
            self._handles.append(first.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(last.register_forward_hook(post, with_kwargs=True))
        for module in called.values():  # counted before the pre-hooks and after the post-hooks above
            self._handles.append(module.register_forward_pre_hook(self._count(self._started), prepend=True))
            self._handles.append(module.register_forward_hook(self._count(self._finished)))

    def _count(self, counter: Counter) -> Callable:
        def hook(module, *_):
            if self.recording and self.in_forward:
                counter[id(module)] += 1

        return hook

    @staticmethod
    def _on_call(module: torch.nn.Module, count: int, hook: Callable, counter: Counter) -> Callable:
        def on_call(*args):
            return hook(*args) if counter[id(module)] == count else None

        return on_call

    def key(self, tensor: torch.Tensor) -> int:
        """A number for this tensor's storage, the same for every tensor sharing it, never reused."""
        storage = tensor.untyped_storage()
        known = self._keys.get(id(storage))
        if known is not None and known[0]() is storage:
            return known[1]
        self._last_key += 1
        key = self._last_key
        self._keys[id(storage)] = (weakref.ref(storage), key)
        return key

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.recording and self.in_forward and self.in_rest:
            self.rest_saved[self.key(tensor)] = self.tracker.current_phase
        return tensor

    def begin(self, phase: Phase) -> None:
        if not self.recording:
            return
        self.in_rest = phase.in_rest_of_forward
        grads = [p.grad for p in self.params if p.grad is not None]
        self.grad_bytes.append(unique_storage_bytes(grads))
        self.tracker.begin_phase(phase)

    def _once(self, phase: Phase) -> Callable:
        fired = []

        def hook(grad):
            if not fired:
                fired.append(True)
                self.begin(phase)

        return hook

    def _pre_hook(self, name: str) -> Callable:
        def hook(module, args, kwargs):
            if not (self.recording and self.in_forward):
                return None
            if name in self.calls:
                raise RepeatedUnitError(
                    f"unit {name!r} ran more than once in one forward; autoplan plans a module called several "
                    "times per call, but not a run of a Sequential's layers. Pass units= naming modules."
                )
            self.begin(Phase("fwd", name))
            tensors = tensors_of((args, kwargs))
            spec = tree_map_only(
                torch.Tensor,
                lambda t: TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad),
                (args, kwargs),
            )
            keys = tuple(self.key(t) for t in tensors)
            for tensor, key in zip(tensors, keys):
                self.tracker.watch(tensor, key)
            self.calls[name] = UnitCall(name, spec, keys, tuple(storage_bytes(t) for t in tensors), (), ())
            end_hook = self._once(Phase("bwd", name, "after"))
            unit_outputs = {key for call in self.calls.values() for key in call.output_keys}
            for tensor, key in zip(tensors, keys):
                # A unit's output already opens its producer's backward phase, at the same moment;
                # a second hook there would fire after that one and mislabel the producer's phase.
                if tensor.requires_grad and key not in unit_outputs:
                    tensor.register_hook(end_hook)
            return None

        return hook

    def _post_hook(self, name: str) -> Callable:
        def hook(module, args, kwargs, output):
            if not (self.recording and self.in_forward):
                return None
            start_hook = self._once(Phase("bwd", name))
            outputs = tensors_of(output)
            for tensor in outputs:
                if tensor.requires_grad:
                    tensor.register_hook(start_hook)
            call = self.calls[name]
            self.calls[name] = UnitCall(
                name, call.inputs, call.input_keys, call.input_bytes,
                tuple(self.key(t) for t in outputs), tuple(storage_bytes(t) for t in outputs),
            )
            self.begin(Phase("fwd", name, "after"))
            for tensor, key in zip(outputs, self.calls[name].output_keys):
                self.tracker.watch(tensor, key)
            return None

        return hook

    def boundaries(self, held_keys: set[int]) -> tuple[Boundary, ...]:
        """Every tensor a unit receives or returns, with who made it, who uses it and who else keeps it.

        held_keys: tensors alive through the whole step whatever the units choose (the batch, the
        parameters).
        """
        produced = {key: (call.name, leaf) for call in self.calls.values() for leaf, key in enumerate(call.output_keys)}
        sizes = {key: n for call in self.calls.values() for key, n in zip(call.output_keys, call.output_bytes)}
        consumers: dict[int, tuple[tuple[str, int], ...]] = {key: () for key in produced}
        for call in self.calls.values():
            for leaf, (key, nbytes) in enumerate(zip(call.input_keys, call.input_bytes)):
                consumers[key] = consumers.get(key, ()) + ((call.name, leaf),)
                sizes[key] = nbytes
        labels = [phase.label for phase in self.tracker.phases()]
        return tuple(
            Boundary(
                key,
                sizes[key],
                produced.get(key),
                used_by,
                key in held_keys,
                labels[self.tracker.last_use[key]] if key in self.tracker.last_use else None,
                self.rest_saved.get(key),
            )
            for key, used_by in consumers.items()
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _phase_sample(tracked: TrackedPhase, grad_bytes: int, carried_bytes: int) -> PhaseSample:
    # the previous step's outputs (or loss) stay alive until this step's forward returns
    extra = carried_bytes if tracked.label.kind == "fwd" else 0
    return PhaseSample(tracked.label, tracked.start_bytes + extra, tracked.peak_bytes + extra, grad_bytes, tracked.time_s, tracked.flops)


def simulate_training(
    model: torch.nn.Module,
    example_inputs: tuple[tuple, dict],
    *,
    fake_mode: FakeTensorMode,
    units: list[str],
    device: Device,
    optimizer: str | torch.optim.Optimizer,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    loop: TrainingLoop | None = None,
) -> Timeline:
    """Simulate a steady-state training step of `model` (a fake copy) in `loop`; return its timeline.

    The earlier steps matter only for what they leave: the optimizer state, the gradients of the
    earlier micro-batches (accumulation) or zeroed ones (`zero_grad(set_to_none=False)`), and the
    outputs the loop's variables still hold. So they are made directly, and the recorded step is
    the last micro-batch of a step, the one that runs with every gradient alive, then
    optimizer.step() and zero_grad.
    """
    loop = loop or TrainingLoop()
    tracker = LiveBytesTracker(device)
    recorder = _UnitRecorder(tracker, model, units)
    # looked up when called, so that the module's default_loss is the one used
    loss_of = loss_function(loss_fn, loop.loss_in_model, default=lambda output: default_loss(output))
    try:
        # transformers' mask shortcuts are decided on the real batch, before it is faked
        with real_mask_decisions(example_inputs), fake_mode, tracker:
            tracker.adopt(list(model.parameters()) + list(model.buffers()))
            args, kwargs = fake_tree(example_inputs, fake_mode)
            batch = tensors_of((args, kwargs))
            trainable = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
            opt = make_optimizer(optimizer, trainable, implementation=loop.optimizer_implementation(device.kind))
            scaler = FakeGradScaler() if loop.grad_scaler else None
            _warm_up(opt, trainable, loop, scaler)
            first_phase = tracker.phase_count
            step = _recorded_step(model, recorder, opt, (args, kwargs), loss_of, loop, scaler)
            static = StaticBytes(
                parameters=unique_storage_bytes(list(model.parameters()) + list(model.buffers())),
                gradients=unique_storage_bytes(trainable),
                optimizer=unique_storage_bytes(optimizer_state_tensors(opt)),
                inputs=unique_storage_bytes(batch),
            )
            # what the loop's variables still hold when the next step's forward runs
            alive = tracker.live_bytes
            step.held.clear()
            carried = alive - tracker.live_bytes
    finally:
        recorder.remove()
    phases = tuple(
        _phase_sample(phase, grad, carried) for phase, grad in zip(tracker.phases(first_phase), recorder.grad_bytes, strict=True)
    )
    missing = [name for name in units if name not in {call.name for call in step.calls}]
    if missing:
        raise RuntimeError(f"units {missing} never ran during the forward; they cannot be planned")
    return Timeline(phases, max(p.peak_bytes for p in phases), step.calls, static, step.boundaries, carried)


@dataclass
class _RecordedStep:
    calls: tuple[UnitCall, ...]
    boundaries: tuple[Boundary, ...]
    held: list[Any]  # what the loop's variables hold after the step: the outputs (when kept) and the loss


def _recorded_step(model, recorder: _UnitRecorder, opt, batch: tuple[tuple, dict], loss_of: Callable, loop: TrainingLoop, scaler) -> _RecordedStep:
    """The step the timeline records, phase by phase: forward, loss, backward, optimizer.step(), zero_grad."""
    args, kwargs = batch
    recorder.recording = True
    recorder.begin(FORWARD_START)
    recorder.in_forward = True
    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, _identity):
        output = model(*args, **kwargs)
        loss = loss_of(output)
        if loop.accumulation_steps > 1:
            loss = loss / loop.accumulation_steps
    recorder.in_forward = False
    calls = tuple(recorder.calls.values())
    # alive whatever the units choose: the batch, parameters a unit is handed as an argument
    # (a graph unit of `x * self.scale`), and the outputs when the loop holds them
    held = tensors_of(batch) + list(model.parameters()) + list(model.buffers()) + (tensors_of(output) if loop.keep_outputs else [])
    boundaries = recorder.boundaries({recorder.key(t) for t in held})
    del held
    if not loop.keep_outputs:
        # `loss = loss_fn(model(x))`: the output lives on only if the loss saved it for backward
        output = None
    recorder.begin(BACKWARD_START)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    recorder.begin(OPTIMIZER_STEP)
    scaled_optimizer_step(opt, scaler)
    recorder.begin(ZERO_GRAD)
    opt.zero_grad(set_to_none=loop.zero_grad_set_to_none)
    return _RecordedStep(calls, boundaries, [output, loss])


def _warm_up(opt: torch.optim.Optimizer, trainable: list[torch.Tensor], loop: TrainingLoop, scaler) -> None:
    """What the earlier steps leave behind for the recorded one: the optimizer's state, and the gradients.

    Under fake tensors the values do not matter, so gradients made here stand in for a forward and
    backward; the step that follows sees exactly what it would after real ones, at a fraction of
    the simulation's cost (the forward and backward are most of it). With accumulation the
    recorded micro-batch is a later one: the earlier micro-batches' gradients are alive and its
    backward adds into them (a micro-batch with them alive peaks at least as high as the first).
    """
    for param in trainable:
        param.grad = torch.empty_like(param)
    scaled_optimizer_step(opt, scaler)
    opt.zero_grad(set_to_none=loop.zero_grad_set_to_none)
    if loop.accumulation_steps > 1 and loop.zero_grad_set_to_none:
        for param in trainable:
            param.grad = torch.zeros_like(param)


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
