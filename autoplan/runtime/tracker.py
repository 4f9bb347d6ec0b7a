"""Fake-tensor simulation: live bytes and roofline time of PyTorch code, without real memory.

`LiveBytesTracker` is a TorchDispatchMode that sees every aten op, counts each storage an op
creates until it is freed (rounded up to 512 bytes, like the CUDA caching allocator), and charges
the op a roofline time on the target device. Its record is split into named phases so one run
tells the peak of every moment of a training step. `fake_copy` makes a FakeTensor twin of a model
(same structure and forwards, no parameter data), so a 70B model can be simulated on a laptop.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.flop_counter import flop_registry

from autoplan.devices import Device

ALLOCATION_GRANULE = 512  # the CUDA caching allocator rounds every block up to this many bytes


def rounded_bytes(nbytes: int) -> int:
    return -(-nbytes // ALLOCATION_GRANULE) * ALLOCATION_GRANULE


def storage_bytes(tensor: torch.Tensor) -> int:
    return rounded_bytes(tensor.untyped_storage().nbytes())


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[id(storage)] = rounded_bytes(storage.nbytes())
    return sum(seen.values())


@dataclass
class _PhaseRecord:
    name: str
    start_bytes: int
    peak_bytes: int
    time_s: float = 0.0
    flops: int = 0


@dataclass(frozen=True)
class Phase:
    """One moment of a simulated run: what was live when it began, and its peak."""

    name: str  # e.g. "fwd:transformer.h.0", "bwd:transformer.h.0", "fwd:rest", "optimizer"
    start_bytes: int
    peak_bytes: int
    time_s: float  # roofline time of the ops run in this phase
    flops: int


class LiveBytesTracker(TorchDispatchMode):
    """Counts live tensor bytes and roofline time of every op dispatched under it."""

    def __init__(self, device: Device, allow_tf32: bool = False) -> None:
        super().__init__()
        self.device = device
        self.allow_tf32 = allow_tf32
        self.live_bytes = 0
        self._finalizers: dict[int, weakref.finalize] = {}
        self._phases: list[_PhaseRecord] = [_PhaseRecord("start", 0, 0)]
        self._watched: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (storage, caller's key)
        self.last_use: dict[int, int] = {}  # caller's key -> index of the last phase an op read it in

    # -- phases ---------------------------------------------------------------------------
    def begin_phase(self, name: str) -> None:
        self._phases.append(_PhaseRecord(name, self.live_bytes, self.live_bytes))

    def phases(self, since: int = 0) -> list[Phase]:
        return [Phase(p.name, p.start_bytes, p.peak_bytes, p.time_s, p.flops) for p in self._phases[since:]]

    @property
    def current_phase(self) -> str:
        return self._phases[-1].name

    @property
    def phase_count(self) -> int:
        return len(self._phases)

    def watch(self, tensor: torch.Tensor, key: int) -> None:
        """Record in `last_use[key]` the last phase in which any op reads this tensor's storage."""
        storage = tensor.untyped_storage()
        self._watched[id(storage)] = (weakref.ref(storage), key)
        self.last_use[key] = len(self._phases) - 1

    # -- dispatch -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        input_storages = {id(t.untyped_storage()) for t in inputs}
        for storage_id in input_storages & self._watched.keys():
            ref, key = self._watched[storage_id]
            if ref() is not None:
                self.last_use[key] = len(self._phases) - 1
        created = False
        for tensor in outputs:
            storage = tensor.untyped_storage()
            key = id(storage)
            # Views and in-place results reuse an input's storage: no new memory.
            if key in input_storages or key in self._finalizers:
                continue
            created = True
            self._count(storage, key)
        if created or func.overloadpacket in flop_registry:
            self._charge_time(func, args, kwargs, out, inputs, outputs)
        return out

    def adopt(self, tensors) -> None:
        """Count tensors made before tracking began (the model's parameters and buffers) as live."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if id(storage) not in self._finalizers:
                self._count(storage, id(storage))

    def _count(self, storage: torch.UntypedStorage, key: int) -> None:
        nbytes = rounded_bytes(storage.nbytes())
        self.live_bytes += nbytes
        current = self._phases[-1]
        current.peak_bytes = max(current.peak_bytes, self.live_bytes)
        self._finalizers[key] = weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        self.live_bytes -= nbytes
        self._finalizers.pop(key, None)

    def _charge_time(self, func, args, kwargs, out, inputs, outputs) -> None:
        flops = 0
        if func.overloadpacket in flop_registry:
            flops = int(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
        moved = sum(t.numel() * t.element_size() for t in inputs + outputs)
        dtype = inputs[0].dtype if inputs else torch.float32
        compute_s = flops / self.device.flops_for(dtype, allow_tf32=self.allow_tf32)
        memory_s = moved / self.device.memory_bandwidth
        current = self._phases[-1]
        current.time_s += max(compute_s, memory_s)
        current.flops += flops


# -- fake copies ------------------------------------------------------------------------------

def _fake_like(tensor: torch.Tensor, fake_mode: FakeTensorMode) -> torch.Tensor:
    with fake_mode:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")


def fake_copy(model: torch.nn.Module, fake_mode: FakeTensorMode) -> torch.nn.Module:
    """A twin of `model` whose parameters and buffers are FakeTensors on the CPU.

    Tied parameters stay tied (deepcopy's memo maps each original tensor to one fake), and no
    parameter data is copied, so this works for meta-device models of any size.
    """
    memo: dict[int, Any] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in memo:
            continue
        fake = _fake_like(tensor, fake_mode)
        if isinstance(tensor, torch.nn.Parameter):
            fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = fake
    return copy.deepcopy(model, memo)


def fake_tree(tree: Any, fake_mode: FakeTensorMode) -> Any:
    """Replace every tensor in a pytree of inputs by a fake of the same shape, dtype and grad flag."""

    def to_fake(tensor: torch.Tensor) -> torch.Tensor:
        fake = _fake_like(tensor, fake_mode)
        return fake.requires_grad_(tensor.requires_grad) if fake.is_floating_point() else fake

    return tree_map_only(torch.Tensor, to_fake, tree)


# -- losses and optimizers --------------------------------------------------------------------

def default_loss(output: Any) -> torch.Tensor:
    """The scalar a profiling step backpropagates: the model's own loss, else the sum of its outputs.

    An output with a `.loss` (or a dict with "loss") that is not None is used as is; otherwise every
    floating-point tensor in the output is summed, which gives each output a gradient of its size.
    """
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if not isinstance(output, (torch.Tensor, dict, list, tuple)) and hasattr(output, "__dict__"):
        output = dict(vars(output))
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError("the model's output has no floating-point tensor to backpropagate; pass loss_fn=")
    return sum(t.sum() for t in tensors)


OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum")


def optimizer_name(optimizer: str | torch.optim.Optimizer) -> str:
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer).__name__
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS} or a torch.optim.Optimizer")
    return optimizer


def make_optimizer(optimizer: str | torch.optim.Optimizer, params: list, device: Device) -> torch.optim.Optimizer:
    """An optimizer over the fake parameters that allocates what the real one would on `device`.

    On CUDA, torch's optimizers default to the foreach implementation, whose temporaries are the
    size of all parameters; on the CPU they default to a per-parameter loop. Fake tensors live on
    the CPU, so the implementation is chosen explicitly for the target device.
    """
    foreach = device.kind == "cuda"
    if isinstance(optimizer, torch.optim.Optimizer):
        defaults = dict(optimizer.defaults)
        if "foreach" in defaults and defaults["foreach"] is None and not defaults.get("fused"):
            defaults["foreach"] = foreach
        return type(optimizer)(params, **defaults)
    factories: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "adamw": lambda: torch.optim.AdamW(params, foreach=foreach),
        "adam": lambda: torch.optim.Adam(params, foreach=foreach),
        "sgd": lambda: torch.optim.SGD(params, lr=1e-3, foreach=foreach),
        "sgd-momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach),
    }
    return factories[optimizer_name(optimizer)]()
