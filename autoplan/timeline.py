"""One simulated training step, phase by phase: the ground truth the memory model is built on.

`simulate_training` runs forward, loss, backward, `optimizer.step()` and
`zero_grad(set_to_none=True)` twice on a fake copy of the model (step 2 is the steady state the
person will see: optimizer state exists, gradients start empty) and records, for every unit, the
peak of its forward and of its backward, the rest of the model in between, and the optimizer step.
It also records what each unit was called with, so a unit can later be profiled on its own.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map_only

from autoplan.devices import Device
from autoplan.trace import unit_endpoints
from autoplan.simulate import (
    LiveBytesTracker,
    default_loss,
    fake_tree,
    make_optimizer,
    storage_bytes,
    unique_storage_bytes,
)


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
    """How a unit was called during the simulated forward."""

    name: str
    inputs: Any  # (args, kwargs) with TensorSpec leaves in place of tensors
    unheld_input_bytes: int  # bytes of its inputs that nothing kept after the forward


@dataclass(frozen=True)
class PhaseSample:
    """One phase of step 2."""

    name: str  # "fwd:<unit>", "fwd:after <unit>", "bwd:<unit>", "bwd:after <unit>", "optimizer", ...
    unit: str | None  # the unit whose forward or backward this is, None for the rest of the model
    kind: str  # "fwd", "bwd" or "step"
    start_bytes: int
    peak_bytes: int
    grad_bytes: int  # gradient bytes alive when the phase began
    time_s: float
    flops: int


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
        self.calls: dict[str, Any] = {}
        self._input_refs: dict[str, list[tuple[weakref.ref, int]]] = {}
        self._handles = []
        self.in_forward = False  # recomputation in backward calls the unit's layers again: not a new call
        for name in units:
            first, last = unit_endpoints(model, name)
            self._handles.append(first.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(last.register_forward_hook(self._post_hook(name), with_kwargs=True))

    def begin(self, name: str) -> None:
        if not self.recording:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        self.grad_bytes.append(unique_storage_bytes(grads))
        self.tracker.begin_phase(name)

    def _once(self, name: str) -> Callable:
        fired = []

        def hook(grad):
            if not fired:
                fired.append(True)
                self.begin(name)

        return hook

    def _pre_hook(self, name: str) -> Callable:
        def hook(module, args, kwargs):
            if not (self.recording and self.in_forward):
                return None
            if name in self.calls:
                raise RuntimeError(
                    f"unit {name!r} ran more than once in one forward; autoplan needs each unit to run once "
                    "per step. Pass units= naming modules that run once."
                )
            self.begin(f"fwd:{name}")
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            self.calls[name] = tree_map_only(
                torch.Tensor,
                lambda t: TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad),
                (args, kwargs),
            )
            unique = {id(t.untyped_storage()): t for t in tensors}
            self._input_refs[name] = [(weakref.ref(t.untyped_storage()), storage_bytes(t)) for t in unique.values()]
            end_hook = self._once(f"bwd:after {name}")
            for tensor in tensors:
                if tensor.requires_grad:
                    tensor.register_hook(end_hook)
            return None

        return hook

    def _post_hook(self, name: str) -> Callable:
        def hook(module, args, kwargs, output):
            if not (self.recording and self.in_forward):
                return None
            start_hook = self._once(f"bwd:{name}")
            for tensor in _tensors_of(output):
                if tensor.requires_grad:
                    tensor.register_hook(start_hook)
            self.begin(f"fwd:after {name}")
            return None

        return hook

    def unit_calls(self) -> tuple[UnitCall, ...]:
        """Call this at the end of forward: whatever input storage is dead by then was not held."""
        calls = []
        for name, inputs in self.calls.items():
            unheld = sum(nbytes for ref, nbytes in self._input_refs[name] if ref() is None)
            calls.append(UnitCall(name, inputs, unheld))
        return tuple(calls)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _tensors_of(output: Any) -> list[torch.Tensor]:
    if not isinstance(output, (torch.Tensor, dict, list, tuple)) and hasattr(output, "__dict__"):
        output = dict(vars(output))
    return [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]


def _phase_sample(phase, grad_bytes: int) -> PhaseSample:
    name = phase.name
    kind = "step" if name in ("optimizer", "zero_grad") else name.split(":", 1)[0]
    unit = None
    if ":" in name and not name.split(":", 1)[1].startswith(("after ", "start")):
        unit = name.split(":", 1)[1]
    return PhaseSample(name, unit, kind, phase.start_bytes, phase.peak_bytes, grad_bytes, phase.time_s, phase.flops)


def simulate_training(
    model: torch.nn.Module,
    example_inputs: tuple[tuple, dict],
    *,
    fake_mode: FakeTensorMode,
    units: list[str],
    device: Device,
    optimizer: str | torch.optim.Optimizer,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    steps: int = 2,
) -> Timeline:
    """Run `steps` training steps of `model` (a fake copy) and return the last step's timeline."""
    tracker = LiveBytesTracker(device)
    recorder = _UnitRecorder(tracker, model, units)
    loss_fn = loss_fn or default_loss
    try:
        with fake_mode, tracker:
            args, kwargs = fake_tree(example_inputs, fake_mode)
            input_bytes = unique_storage_bytes(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
            trainable = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
            opt = make_optimizer(optimizer, trainable, device)
            first_phase = 0
            for step in range(steps):
                recorder.recording = step == steps - 1
                recorder.calls.clear()
                if recorder.recording:
                    first_phase = tracker.phase_count
                recorder.begin("fwd:start")
                recorder.in_forward = True
                output = model(*args, **kwargs)
                loss = loss_fn(output)
                recorder.in_forward = False
                calls = recorder.unit_calls()
                recorder.begin("bwd:start")
                loss.backward()
                del output, loss
                recorder.begin("optimizer")
                opt.step()
                recorder.begin("zero_grad")
                opt.zero_grad(set_to_none=True)
            state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            static = StaticBytes(
                parameters=unique_storage_bytes(list(model.parameters()) + list(model.buffers())),
                gradients=unique_storage_bytes(trainable),
                optimizer=unique_storage_bytes(state),
                inputs=input_bytes,
            )
    finally:
        recorder.remove()
    phases = tuple(
        _phase_sample(phase, grad) for phase, grad in zip(tracker.phases(first_phase), recorder.grad_bytes, strict=True)
    )
    missing = [name for name in units if name not in {call.name for call in calls}]
    if missing:
        raise RuntimeError(f"units {missing} never ran during the forward; they cannot be planned")
    return Timeline(phases, max(p.peak_bytes for p in phases), calls, static)
