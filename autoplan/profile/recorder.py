"""Hooks on a model's units that split a simulated training step into phases at every unit boundary,
forward and backward, and record what each unit was called with and which tensors it passed on.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, cast

import torch
from torch.utils._pytree import tree_map_only

from autoplan.errors import RepeatedUnitError
from autoplan.plan import Phase
from autoplan.units import CallSite, Unit
from autoplan.vocabulary.names import unit_endpoints
from autoplan.vocabulary.tensors import storage_bytes, tensors_of, unique_storage_bytes
from autoplan.instruments.tracker import LiveBytesTracker
from autoplan.instruments.values import copy_with_digest, give_value, known_value


class UnitRecorder:
    """Forward hooks on the units that open a phase at each unit boundary, forward and backward."""

    def __init__(self, tracker: LiveBytesTracker, model: torch.nn.Module, units: list[Unit]) -> None:
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
        for unit in units:
            first, last = unit_endpoints(model, unit)
            pre, post = self._pre_hook(unit.name), self._post_hook(unit.name)
            site = unit
            if isinstance(site, CallSite):  # one call of a module that runs several times: its hooks act on that call only
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
            self.rest_saved[self.key(tensor)] = cast(Phase, self.tracker.current_phase)  # begin() labels every phase with one
        # An alias without autograd history: a node saving its own output through a hook that returns the
        # tensor itself holds itself (a reference cycle), so a part of the graph backward never runs (a
        # layer whose output no loss uses) would outlive the outputs, as it does not in the real step.
        return tensor.detach()

    def begin(self, phase: Phase) -> None:
        if not self.recording:
            return
        self.in_rest = phase.in_rest_of_forward
        grads = [p.grad for p in self.params if p.grad is not None]
        self.grad_bytes.append(unique_storage_bytes(grads))
        self.tracker.begin_phase(phase)

    def _once(self, phase: Phase) -> Callable:
        fired: list[bool] = []

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
            distinct = {}  # id of an argument -> its identity in this call
            spec = tree_map_only(torch.Tensor, lambda t: TensorSpec.of(t, distinct.setdefault(id(t), len(distinct))), (args, kwargs))
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
        labels = [cast(Phase, phase.label) for phase in self.tracker.phases()]  # begin() labels each with a Phase
        last_use = self.tracker.last_use
        return boundaries_of(self.calls.values(), held_keys.__contains__,
                             lambda key: labels[last_use[key]] if key in last_use else None, self.rest_saved.get)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def boundaries_of(calls: Iterable[UnitCall], held_by_rest: Callable[[int], bool], last_forward_use: Callable[[int], Phase | None],
                  rest_saved_in: Callable[[int], Phase | None]) -> tuple[Boundary, ...]:
    """The boundaries of a step's unit calls (forward order): each output first, then each input no unit made; a
    tensor's producer is the last unit that returned it. The rest comes from the step, by storage key."""
    calls = tuple(calls)
    produced = {key: (call.name, leaf) for call in calls for leaf, key in enumerate(call.output_keys)}
    sizes = {key: n for call in calls for key, n in zip(call.output_keys, call.output_bytes)}
    consumers: dict[int, tuple[tuple[str, int], ...]] = {key: () for key in produced}
    for call in calls:
        for leaf, (key, nbytes) in enumerate(zip(call.input_keys, call.input_bytes)):
            consumers[key] = consumers.get(key, ()) + ((call.name, leaf),)
            sizes[key] = nbytes
    return tuple(Boundary(key, sizes[key], produced.get(key), used_by, held_by_rest(key), last_forward_use(key), rest_saved_in(key))
                 for key, used_by in consumers.items())


@dataclass(frozen=True)
class TensorSpec:
    """Shape and kind of a tensor a unit was called with; enough to make a fake one like it.

    Where the simulation knew its value (computed from the batch only: positions, a grid's
    sequence bounds; `instruments.values`), the fake one made from it has that value too, so a unit
    that reads it (`cu_seqlens.tolist()`) runs alone as in the step.
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    value_digest: str = ""  # identifies the value: units called with other values are measured apart
    value: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # which of the call's distinct tensors this is: leaves of one identity were one tensor, `attn(h, h, h)`
    identity: int = 0

    @classmethod
    def of(cls, tensor: torch.Tensor, identity: int = 0) -> TensorSpec:
        value = known_value(tensor)
        if value is None:
            return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.requires_grad, identity=identity)
        value, digest = copy_with_digest(value)
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.requires_grad, digest, value, identity)

    def materialize(self) -> torch.Tensor:
        tensor = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="cpu")
        if self.value is not None:
            give_value(tensor, self.value)
        return tensor.requires_grad_(self.requires_grad)



def materialize_inputs(inputs: Any, make: Callable[[TensorSpec], torch.Tensor]) -> Any:
    """A call's inputs made anew by `make`, once per identity: a tensor passed twice comes back as one tensor
    twice, as in the step (MultiheadAttention runs other ops for `attn(h, h, h)` than for three tensors)."""
    made: dict[int, torch.Tensor] = {}

    def once(spec: TensorSpec) -> torch.Tensor:
        if spec.identity not in made:
            made[spec.identity] = make(spec)
        return made[spec.identity]

    return tree_map_only(TensorSpec, once, inputs)


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
    # per input leaf: alive through the whole step whatever the units choose (the batch, a parameter or buffer
    # handed in as an argument, like a rotary table): a unit measured alone must not free it either
    resident_inputs: tuple[bool, ...] = ()



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
