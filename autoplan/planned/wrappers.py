"""A unit's forward under its choice: `PlannedForward`, set as `module.forward` on the instance.

It calls the class's own forward under the unit's precision (torch.autocast) and checkpoint mode
(torch.utils.checkpoint, non-reentrant; selective mode through its selective-checkpoint policy,
which keeps either every matmul/attention output or the op occurrences the choice names).
Buffers the forward writes (BatchNorm statistics, counters) are updated once by a recomputed unit
(planned.buffers), and transformers layers do not write their KV cache twice. An offloaded unit runs inside `planned.offload.OffloadSaved`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autoplan.plan import DTYPES, Choice
from autoplan.instruments.quantized import is_quantized_matmul
from autoplan.planned.buffers import BufferSnapshot, BufferWrites, has_buffers
from autoplan.planned.offload import OffloadSaved
from autoplan.vocabulary.tensors import tensors_of

# Selective mode keeps the outputs of these (expensive to recompute, cheap to store relative to
# their cost) and recomputes everything else: norms, activations, dropout, casts, adds. bitsandbytes'
# fused 4-bit matmul is one of them too (instruments.quantized.is_quantized_matmul), and the fused attention kernels.
_SAVED_IN_SELECTIVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.convolution.default,
}


# The fused attention kernels, one name for a policy: a plan made for a GPU (flash or efficient
# kernel) names the same op as the CPU's flash kernel when it is applied and run on the CPU.
_FUSED_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def op_name(func) -> str:
    """How a menu names an aten op: its overload packet, "aten.mm" (occurrences add "#0", "#1", ...);
    "aten.sdpa" for any fused attention kernel."""
    return "aten.sdpa" if func in _FUSED_ATTENTION else str(func.overloadpacket)


def can_save(func) -> bool:
    """Whether a policy may keep this op's output: not an in-place op or a view (their outputs alias
    an input, which recomputation restores for free and which a later in-place op may change)."""
    schema = func._schema
    return not schema.is_mutable and all(ret.alias_info is None for ret in schema.returns)


class OccurrencePolicy:
    """A selective-checkpoint policy that tells ops apart by type and occurrence.

    torch's selective checkpointing asks the policy once per op of the forward (the recomputation
    replays the cached outputs by the same per-op count), so one counter per op type numbers
    the ops exactly as a profiled forward of the unit numbered them. `saves` None is the fixed
    rule (every matmul/conv/attention output). `observer`, if given, sees every op with its name
    and output (the menu builder records a unit's ops through it).
    """

    def __init__(self, saves: tuple[str, ...] | None, observer=None) -> None:
        self.saves = None if saves is None else frozenset(saves)
        self.observer = observer
        self.counts: dict[str, int] = {}

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        name = op_name(func)
        index = self.counts.get(name, 0)
        self.counts[name] = index + 1
        occurrence = f"{name}#{index}"
        if self.observer is not None:
            self.observer(occurrence, func, args, kwargs, ctx.op_output)
        saved = (func in _SAVED_IN_SELECTIVE or func in _FUSED_ATTENTION or is_quantized_matmul(func)) if self.saves is None else occurrence in self.saves and can_save(func)
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _fixed_rule_contexts():
    return create_selective_checkpoint_contexts(OccurrencePolicy(None))


def _occurrence_contexts(saves, observer):
    # a fresh policy per checkpointed call: its counters number this forward's ops from 0
    return create_selective_checkpoint_contexts(OccurrencePolicy(saves, observer))


@dataclass
class PlannedForward:
    """A unit's forward under its plan; set as `module.forward` on the instance."""

    module: torch.nn.Module
    choice: Choice
    original: Any = None  # an instance-level forward that was there before (e.g. another library's hook)
    cast_outputs: bool = True  # return outputs in the inputs' float dtype, so neighbours see what they saw before
    observer: Any = None  # selective mode: called with every op of the forward (see OccurrencePolicy)

    def _run(self, *args, **kwargs):
        if self.original is not None:
            return self.original(*args, **kwargs)
        return _class_forward(type(self.module))(self.module, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        # Libraries read forward's parameters (transformers' generate() does): show the real ones.
        if self.original is not None:
            return inspect.signature(self.original)
        return inspect.signature(_class_forward(type(self.module)).__get__(self.module))

    def _precision_context(self, args, kwargs) -> contextlib.AbstractContextManager:
        device_type = _device_type(self.module, args, kwargs)
        if self.choice.precision == "fp32":
            if torch.is_autocast_enabled(device_type):
                return torch.autocast(device_type, enabled=False)
            return contextlib.nullcontext()
        # The weight cache would keep low-precision weight copies alive until the outermost autocast
        # exits, which defeats checkpointing; without it each use casts, and the cast is what is saved.
        return torch.autocast(device_type, dtype=DTYPES[self.choice.precision], cache_enabled=False)

    def _context_fn(self):
        if self.choice.saves is None and self.observer is None:
            return _fixed_rule_contexts
        return functools.partial(_occurrence_contexts, self.choice.saves, self.observer)

    def _forward_in_precision(self, *args, **kwargs):
        with self._precision_context(args, kwargs):
            return self._run(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        if self.choice.offloaded and torch.is_grad_enabled():
            return _eager_offloaded_call()(self, *args, **kwargs)
        return self._planned_call(*args, **kwargs)

    def __post_init__(self) -> None:
        # the buffers its forward writes, kept as if it ran once a step when it recomputes (planned.buffers)
        self.buffer_writes = BufferWrites(self.module) if self.choice.mode != "keep" and has_buffers(self.module) else None
        if self.choice.offloaded:
            _eager_offloaded_call()  # made now, eagerly, so that a compiled forward finds it made

    def _planned_call(self, *args, **kwargs):
        if self.choice.mode == "keep" or not torch.is_grad_enabled():
            output = self._forward_in_precision(*args, **kwargs)
        else:
            snapshot = self.buffer_writes.before_forward() if self.buffer_writes is not None else None
            function = recomputed_on_copies(self._forward_in_precision, self.buffer_writes, snapshot)
            # Only selective mode passes a context_fn: torch.compile rejects a custom one that
            # returns no dispatch modes, so full mode keeps checkpoint's default.
            extra = {"context_fn": self._context_fn()} if self.choice.mode == "selective" else {}
            args, kwargs = without_cache_writes(self.module, args, kwargs)
            function, saved_args, saved_kwargs = each_tensor_once(function, args, kwargs)
            output = checkpoint(function, *saved_args, use_reentrant=False, **extra, **saved_kwargs)
            if self.buffer_writes is not None:
                self.buffer_writes.after_forward(snapshot)
        if self.cast_outputs and self.choice.precision != "fp32":
            output = _cast_like_inputs(output, args, kwargs, self.module)
        return output


def each_tensor_once(function: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple, dict]:
    """`function`, its positional arguments and keywords, with a tensor passed twice handed to checkpoint once.

    Checkpoint saves its tensor arguments for the recomputation, and under any saved-tensor hooks (the
    simulation's, an offload's) each comes back as a tensor of its own: `attn(h, h, h)` would recompute
    with three, and MultiheadAttention takes its self-attention path only when they are one tensor
    (with three it runs other ops, and selective checkpointing finds them missing from its forward).
    A repeat is passed as None and given back the first tensor inside, so the recomputation sees one.
    """
    first: dict[int, int] = {}
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            first.setdefault(id(value), index)
    repeat_of = {index: first[id(value)] for index, value in enumerate(args)
                 if isinstance(value, torch.Tensor) and first[id(value)] != index}
    keyword_of = {name: first[id(value)] for name, value in kwargs.items() if isinstance(value, torch.Tensor) and id(value) in first}
    if not repeat_of and not keyword_of:
        return function, args, kwargs

    def with_repeats(*given, **given_kwargs):
        whole = [given[repeat_of[index]] if index in repeat_of else value for index, value in enumerate(given)]
        return function(*whole, **given_kwargs, **{name: given[index] for name, index in keyword_of.items()})

    saved_args = tuple(None if index in repeat_of else value for index, value in enumerate(args))
    return with_repeats, saved_args, {name: value for name, value in kwargs.items() if name not in keyword_of}


def _offloaded_call(planned: PlannedForward, *args, **kwargs):
    offload = OffloadSaved(planned.module)
    with offload:
        output = planned._planned_call(*args, **kwargs)
    offload.forward_done(output)
    return output


_EAGER_OFFLOADED: list = []


def _eager_offloaded_call():
    """`_offloaded_call` under torch.compiler.disable: Dynamo does not trace saved-tensor hooks (it breaks
    the graph around them), so an offloaded unit runs eagerly between the compiled graphs of the rest.
    Made on first use: it imports torch._dynamo, seconds that planning alone never needs."""
    if not _EAGER_OFFLOADED:
        _EAGER_OFFLOADED.append(torch.compiler.disable(_offloaded_call))
    return _EAGER_OFFLOADED[0]


def _class_forward(cls: type[torch.nn.Module]) -> Any:
    """The class's forward, minus transformers' own checkpointing wrapper.

    transformers v5 wraps every `GradientCheckpointingLayer.forward` in a function that checkpoints
    it when `gradient_checkpointing_enable()` has set the layer's flag. A planned unit already runs
    under the plan's checkpoint mode, so the plan wins: the wrapper is skipped (never checkpointing
    twice), whether the flag was set before or after the rewrite.
    """
    forward = cls.forward
    code = getattr(forward, "__code__", None)
    if code is not None and code.co_name == "forward_with_checkpointing" and hasattr(forward, "__wrapped__"):
        return forward.__wrapped__
    return forward


_CACHE_KWARGS = ("cache", "past_key_values", "layer_past")  # transformers ≥ 5.24 calls it `cache`


def without_cache_writes(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A transformers layer checkpointed in training must not write its KV cache.

    Recomputation would append the keys and values a second time (and the replay would no longer
    match the forward). This is what transformers' own checkpointing wrapper does, which the plan
    replaces: no cache for checkpointed layers, unless the layer says it only reads it. The cache
    may come positionally (GPT-2 passes it so), hence binding to forward's signature.
    """
    if not hasattr(module, "_can_checkpoint_with_cache") or module._can_checkpoint_with_cache:
        return args, kwargs
    try:
        bound = inspect.signature(_class_forward(type(module))).bind(module, *args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    extra: dict[str, Any] = next(
        (bound.arguments[p.name] for p in bound.signature.parameters.values() if p.kind is p.VAR_KEYWORD and p.name in bound.arguments),
        {},
    )
    for values in (bound.arguments, extra):
        if values.get("use_cache"):
            values["use_cache"] = False
        for name in _CACHE_KWARGS:
            if values.get(name) is not None:
                values[name] = None
    return bound.args[1:], bound.kwargs


def recomputed_on_copies(function, buffer_writes: BufferWrites | None, snapshot: BufferSnapshot | None):
    """`function`, run as is the first time (the forward) and on the forward's buffer copies after (recomputation)."""
    if buffer_writes is None or snapshot is None:
        return function
    calls: list[bool] = []

    @functools.wraps(function)
    def run(*args, **kwargs):
        if not calls:
            calls.append(True)
            return function(*args, **kwargs)
        with buffer_writes.recomputing(snapshot):
            return function(*args, **kwargs)

    return run


def _device_type(module: torch.nn.Module, args, kwargs) -> str:
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    for tensor in module.parameters():
        return tensor.device.type
    return "cpu"


def _cast_like_inputs(output, args, kwargs, module):
    floats = [t for t in tensors_of((args, kwargs)) if t.is_floating_point()]
    target = floats[0].dtype if floats else next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if target is None:
        return output
    low = (torch.bfloat16, torch.float16)
    return tree_map_only(
        torch.Tensor, lambda t: t.to(target) if t.dtype in low and t.dtype != target else t, output
    )
