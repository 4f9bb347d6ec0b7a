"""The live-bytes tracker: live tensor bytes and roofline time of PyTorch code, op by op.

`LiveBytesTracker` is a TorchDispatchMode that sees every aten op, counts each storage an op
creates until it is freed (rounded up to 512 bytes, like the CUDA caching allocator), and charges
the op a roofline time on the target device. Its record is split into labelled phases so one run
tells the peak of every moment of a training step. Host copies of offloaded activations
(`instruments.host`) are counted apart, as host bytes. Under fake tensors (`instruments.fake`) it needs no
real memory; over real CPU tensors it measures a real run.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass
from typing import Hashable, Protocol

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils.flop_counter import flop_registry

from autoplan.errors import ProfileError
from autoplan.instruments.collectives import collective_time_s
from autoplan.instruments.cpu_scratch import promoted_copy_bytes, scratch_bytes
from autoplan.instruments.cuda_matmul import operand_copy_bytes
from autoplan.instruments.flop_formulas import autoplan_flop_formulas
from autoplan.instruments.host import allocating_on_host, moving_over_the_link
from autoplan.instruments.loss_storage import as_the_cpu_kernel_returns
from autoplan.instruments.quantized import hidden_temporary_bytes, is_quantized_matmul, load_bitsandbytes_backends
from autoplan.vocabulary.tensors import DEVICE_ASK, METADATA_OPS, fake_device_answer, rounded_bytes, tensors_of


@dataclass
class _PhaseRecord:
    label: Hashable
    start_bytes: int
    peak_bytes: int
    time_s: float = 0.0
    flops: int = 0


@dataclass(frozen=True)
class TrackedPhase:
    """One stretch of a tracked run, between two begin_phase calls: what was live when it began, and its peak."""

    label: Hashable  # what the caller named it: a plan.Phase in a training step, a string elsewhere
    start_bytes: int
    peak_bytes: int
    time_s: float  # roofline time of the ops run in this phase
    flops: int


class RooflineRates(Protocol):
    """What the tracker needs of a device to charge ops a time (an inputs.devices.Device has it)."""

    @property
    def memory_bandwidth(self) -> float: ...  # bytes per second (read-only: a Device is frozen)

    def flops_for(self, dtype: torch.dtype, *, allow_tf32: bool = False) -> float: ...


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
_HIDES: dict[type, bool] = {}  # per tensor type an op's arguments hold: whether it runs its ops out of the tracker's sight
# the subclasses whose ops the tracker follows inside (its own outputs are wrappers over what those ops made, no
# memory of their own): torchao's float8 training tensor, counted to the byte against the CPU allocator on float8 MLPs
# (tests/instruments/test_float8.py); any other such subclass is refused, unchecked
SEEN_INSIDE = ("torchao.float8.",)


def _hides_its_ops(kind: type) -> bool:
    """Whether tensors of `kind` run an op as other ops on tensors inside them (a traceable wrapper subclass: torchao's
    Float8TrainingTensor, DTensor, ...). A mode sees the outer op only: what the inner ops allocate, and what a CPU
    kernel among them holds inside (torchao's float8 matmul on the CPU upcasts its operands inside `_scaled_mm`), it
    counts only by following the subclass's own dispatch (`SEEN_INSIDE`)."""
    if kind not in _HIDES:
        _HIDES[kind] = is_traceable_wrapper_subclass_type(kind)
    return _HIDES[kind]


def _hidden_ops_error(kind: type, func) -> ProfileError:
    return ProfileError(
        f"{func} ran on a {kind.__module__}.{kind.__name__}, a tensor subclass that runs each op as other ops on the tensors "
        f"inside it, where the simulation cannot count what they hold: the plan would predict less than the step holds. "
        "Such tensors are not planned (torchao's float8 training is): plan the model without it (before converting it), "
        "and leave a margin for what it adds")


class LiveBytesTracker(TorchDispatchMode):
    """Counts live tensor bytes and roofline time of every op dispatched under it."""

    # FlexAttention runs as a higher-order operator: without this, dispatching one under the tracker raises
    supports_higher_order_operators = True

    def __init__(self, device: RooflineRates, allow_tf32: bool = False) -> None:
        super().__init__()
        load_bitsandbytes_backends()  # before any op runs under the tracker
        self._formulas: list[contextlib.AbstractContextManager] = []  # autoplan's FLOP formulas, one per entry
        self.device = device
        self.cpu_kernels = runs_cpu_kernels(device)  # the target is this CPU: its kernels' scratch counts
        self.cuda_kernels = _device_kind(device) == "cuda"  # a GPU target: its matmuls' operand copies count
        self.allow_tf32 = allow_tf32
        self.live_bytes = 0
        self.host_bytes = 0  # pinned host copies of offloaded activations alive now
        self.host_peak_bytes = 0
        self._finalizers: dict[int, weakref.finalize] = {}
        self._phases: list[_PhaseRecord] = [_PhaseRecord("start", 0, 0)]
        self._watched: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (storage, caller's key)
        self.last_use: dict[int, int] = {}  # caller's key -> index of the last phase an op read it in
        self.engine_accumulates = False  # the autograd engine is adding gradients now (instruments.accumulation)
        self._pending: _PendingSum | None = None
        # a GPU target's device allocations and frees in order, with the phases' labels, for the caching
        # allocator's model (instruments.caching_allocator.steady_reserved_bytes): ("alloc", handle, bytes),
        # ("free", handle, 0), ("phase", label, 0)
        self.allocation_log: list[tuple[str, Hashable, int]] | None = [] if self.cuda_kernels else None
        self._handles = itertools.count()

    # -- phases ---------------------------------------------------------------------------
    def begin_phase(self, label: Hashable) -> None:
        self._settle()
        self._phases.append(_PhaseRecord(label, self.live_bytes, self.live_bytes))
        if self.allocation_log is not None:
            self.allocation_log.append(("phase", label, 0))

    def mark(self, label: Hashable) -> None:
        """A mark in the allocation log alone (not a phase): where the caller's next stretch begins."""
        if self.allocation_log is not None:
            self.allocation_log.append(("phase", label, 0))

    def phases(self, since: int = 0) -> list[TrackedPhase]:
        return [TrackedPhase(p.label, p.start_bytes, p.peak_bytes, p.time_s, p.flops) for p in self._phases[since:]]

    @property
    def current_phase(self) -> Hashable:
        return self._phases[-1].label

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
        self._settle()
        for kind in types:
            if _hides_its_ops(kind):
                if not kind.__module__.startswith(SEEN_INSIDE):
                    raise _hidden_ops_error(kind, func)
                with self:  # its own dispatch runs the op as ops on the tensors inside it: under the tracker, each counted
                    return kind.__torch_dispatch__(func, types, args, kwargs)
        if func is DEVICE_ASK and (device := fake_device_answer(args)) is not None:
            return device
        out = func(*args, **kwargs)
        if func in METADATA_OPS:
            return out
        if self.cpu_kernels:
            out = as_the_cpu_kernel_returns(func, args, kwargs, out)
        inputs = tensors_of((args, kwargs))
        outputs = tensors_of(out)
        input_storages = {id(t.untyped_storage()) for t in inputs}
        for storage_id in input_storages & self._watched.keys():
            ref, key = self._watched[storage_id]
            if ref() is not None:
                self.last_use[key] = len(self._phases) - 1
        # the engine adding two gradients: a real step (no mode) adds in place when an operand is not held elsewhere
        in_place = self.engine_accumulates and is_gradient_sum(func, args, kwargs, out)
        live_before = self.live_bytes
        created = self._count_outputs(func, outputs, input_storages, raise_peak=not in_place)
        if in_place:  # settled at the next op: in place if an operand's buffer went as the add returned
            self._pending = _PendingSum([weakref.ref(t.untyped_storage()) for t in inputs], self.live_bytes,
                                        len(self._phases) - 1)
        # an op that holds a temporary inside (bitsandbytes' 4-bit matmul dequantizes its weight, a CPU kernel its
        # scratch) peaks above its output
        hidden = hidden_temporary_bytes(func, args, kwargs)
        if self.cpu_kernels and not moving_over_the_link():
            # a fused 4-bit matmul's real call holds its dequantized weight too: the rule or the real call, whichever holds more
            scratch = scratch_bytes(func, args, kwargs)
            hidden = max(hidden, scratch) if is_quantized_matmul(func) else hidden + scratch
        elif self.cuda_kernels:
            hidden += operand_copy_bytes(func, args, kwargs)  # the card copies what cuBLAS cannot read in place
        if hidden and self.allocation_log is not None:  # allocated and freed inside the op
            handle = next(self._handles)
            self.allocation_log += [("alloc", handle, hidden), ("free", handle, 0)]
        # a CPU kernel's copies of operands of another dtype: held, not priced (a roofline prices what the op reads
        # and writes, and every plan's time stays what it was before they were counted)
        promoted = promoted_copy_bytes(func, args, kwargs) if self.cpu_kernels and not moving_over_the_link() else 0
        current = self._phases[-1]
        current.peak_bytes = max(current.peak_bytes, (live_before if in_place else self.live_bytes) + hidden + promoted)
        if (created or flop_key(func) in flop_registry) and not moving_over_the_link():
            self._charge_time(func, args, kwargs, out, inputs, outputs, hidden)
        return out

    def _count_outputs(self, func, outputs, input_storages: set[int], *, raise_peak: bool) -> bool:
        """Count the storages an op made; whether it made any."""
        created = False
        for tensor in outputs:
            storage = tensor.untyped_storage()
            key = id(storage)
            # Views and in-place results reuse an input's storage: no new memory. torch.tensor(data) is the
            # exception: it made its tensor before any op, and hands it to lift_fresh, the first op to see it.
            if (key in input_storages and func not in _LIFTS) or key in self._finalizers:
                continue
            created = True
            self._count(storage, key, raise_peak=raise_peak)
        return created

    def adopt(self, tensors) -> None:
        """Count tensors made before tracking began (the model's parameters and buffers) as live."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if id(storage) not in self._finalizers:
                self._count(storage, id(storage))

    def _settle(self) -> None:
        """The last gradient sum: out of place after all (no operand's buffer went) raises its phase's peak."""
        pending, self._pending = self._pending, None
        if pending is not None and all(ref() is not None for ref in pending.operands):
            phase = self._phases[pending.phase]
            phase.peak_bytes = max(phase.peak_bytes, pending.live_bytes)

    def __enter__(self):
        # autoplan's FLOP formulas are in torch's registry only while a tracker runs (instruments.flop_formulas)
        formulas = autoplan_flop_formulas()
        formulas.__enter__()
        self._formulas.append(formulas)
        try:
            return super().__enter__()
        except BaseException:
            self._formulas.pop().__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            self._settle()
            return super().__exit__(*exc)
        finally:
            self._formulas.pop().__exit__(None, None, None)

    def _count(self, storage: torch.UntypedStorage, key: int, *, raise_peak: bool = True) -> None:
        if allocating_on_host():
            # torch's pinned-memory caching allocator hands out blocks of a power of two
            nbytes = 1 << max(storage.nbytes() - 1, 0).bit_length()
            self.host_bytes += nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
            self._finalizers[key] = weakref.finalize(storage, self._release_host, key, nbytes)
            return
        nbytes = rounded_bytes(storage.nbytes())
        self.live_bytes += nbytes
        if raise_peak:
            current = self._phases[-1]
            current.peak_bytes = max(current.peak_bytes, self.live_bytes)
        handle = next(self._handles)
        if self.allocation_log is not None:
            self.allocation_log.append(("alloc", handle, storage.nbytes()))
        self._finalizers[key] = weakref.finalize(storage, self._release, key, nbytes, handle)

    def _release(self, key: int, nbytes: int, handle: int) -> None:
        self.live_bytes -= nbytes
        self._finalizers.pop(key, None)
        if self.allocation_log is not None:
            self.allocation_log.append(("free", handle, 0))

    def _release_host(self, key: int, nbytes: int) -> None:
        self.host_bytes -= nbytes
        self._finalizers.pop(key, None)

    def _charge_time(self, func, args, kwargs, out, inputs, outputs, hidden_bytes: int) -> None:
        cost = op_roofline(self.device, func, args, kwargs, out, inputs + outputs, allow_tf32=self.allow_tf32,
                           hidden_bytes=hidden_bytes)
        current = self._phases[-1]
        current.time_s += cost.time_s
        current.flops += cost.flops


@dataclass(frozen=True)
class _PendingSum:
    operands: list  # weak references to the storages the add read
    live_bytes: int  # live bytes with its result, as an out-of-place add holds them
    phase: int  # the phase it ran in


_ADD = torch.ops.aten.add.Tensor


def is_gradient_sum(func, args, kwargs, out) -> bool:
    """`a + b` of two dense tensors of the result's shape and dtype: how the engine adds two gradients under a mode."""
    if func is not _ADD or kwargs.get("alpha", 1) != 1 or len(args) != 2 or not isinstance(out, torch.Tensor):
        return False
    return all(isinstance(a, torch.Tensor) and a.shape == out.shape and a.dtype == out.dtype and a.is_contiguous()
               for a in args)


def runs_cpu_kernels(device) -> bool:
    """Whether the rates are a CPU's (a Device of kind "cpu", or one wrapped as FusedElementwiseRates)."""
    return _device_kind(device) == "cpu"


def _device_kind(device) -> str | None:
    return getattr(device, "kind", None) or getattr(getattr(device, "device", None), "kind", None)


def flop_key(func):
    """What torch's flop registry files an op under: an aten op by its overload packet, a higher-order
    operator (FlexAttention's forward and backward) by itself."""
    return func if isinstance(func, HigherOrderOperator) else func.overloadpacket


@dataclass(frozen=True)
class OpCost:
    flops: int
    time_s: float  # roofline: the slower of its FLOPs at the device's rate and its bytes moved over its bandwidth


def op_roofline(device: RooflineRates, func, args, kwargs, out, touched, *, allow_tf32: bool = False, hidden_bytes: int = 0) -> OpCost:
    """One op's FLOPs (torch's flop counter) and roofline time; `touched`: its input and output tensors;
    `hidden_bytes`: a temporary it writes and reads back inside itself."""
    if (collective_s := collective_time_s(func, args, out, device)) is not None:
        return OpCost(0, collective_s)  # the rank twin's collectives, at the card's link to its peers
    flops = 0
    if flop_key(func) in flop_registry:
        flops = int(flop_registry[flop_key(func)](*args, **kwargs, out_val=out))
    if flops == 0 and getattr(device, "fuses_elementwise", False):
        return OpCost(0, 0.0)
    moved = sum(t.numel() * t.element_size() for t in touched) + 2 * hidden_bytes
    dtype = touched[0].dtype if touched else torch.float32
    compute_s = flops / device.flops_for(dtype, allow_tf32=allow_tf32)
    return OpCost(flops, max(compute_s, moved / device.memory_bandwidth))


@dataclass(frozen=True)
class FusedElementwiseRates:
    """A device's rates as code compiled by torch.compile (Inductor) spends them, roughly.

    Ops without FLOPs (elementwise ops, norms' reductions, casts, copies) are fused into the
    kernels of their neighbours, so they cost no time of their own; matmuls, convolutions and
    attention keep their roofline time. Recomputing a norm or an activation is then nearly free,
    and only what recomputes FLOPs costs time: the prices a plan for a compiled model needs.
    """

    device: RooflineRates
    fuses_elementwise = True

    @property
    def memory_bandwidth(self) -> float:
        return self.device.memory_bandwidth

    @property
    def interconnect_bandwidth(self) -> float:
        return getattr(self.device, "interconnect_bandwidth", 0.0)

    @property
    def network_bandwidth(self) -> float:
        return getattr(self.device, "network_bandwidth", 0.0)

    @property
    def node_size(self) -> int:
        return getattr(self.device, "node_size", 8)

    def flops_for(self, dtype: torch.dtype, *, allow_tf32: bool = False) -> float:
        return self.device.flops_for(dtype, allow_tf32=allow_tf32)


# -- fake copies ------------------------------------------------------------------------------


# -- losses and optimizers --------------------------------------------------------------------
