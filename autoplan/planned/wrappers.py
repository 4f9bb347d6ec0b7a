"""A unit's forward under its choice: `PlannedForward`, set as `module.forward` on the instance.

It calls the class's own forward under the unit's precision (`axes.precision`: autocast) and checkpoint
mode (torch.utils.checkpoint, non-reentrant; selective mode through `axes.checkpoint`'s policy, which
keeps either every matmul/attention output or the op occurrences the choice names).
Buffers the forward writes (BatchNorm statistics, counters) are updated once by a recomputed unit
(planned.buffers), and transformers layers do not write their KV cache twice. A unit split by tensor parallelism recomputes its
whole forward (`recomputing_whole`: torch's early stop leaves row-wise all-reduces unwaited). An offloaded unit runs inside `axes.placement.OffloadSaved`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.checkpoint import checkpoint

from autoplan.axes.checkpoint import selective_contexts
from autoplan.axes.placement import OffloadSaved
from autoplan.axes.precision import kind, low_dtypes
from autoplan.mesh import TP
from autoplan.plan import Choice
from autoplan.planned.buffers import BufferSnapshot, BufferWrites, has_buffers
from autoplan.vocabulary.tensors import tensors_of


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
        return kind(self.choice.precision).running(self.module, _device_type(self.module, args, kwargs))

    def _context_fn(self):
        return selective_contexts(self.choice.saves, self.observer)

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
        self.recompute_whole = splits_by_tensor_parallel(self.module)
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
            with recomputing_whole(self.recompute_whole):
                output = checkpoint(function, *saved_args, use_reentrant=False, **extra, **saved_kwargs)
            if self.buffer_writes is not None:
                self.buffer_writes.after_forward(snapshot)
        if self.cast_outputs and self.choice.precision != "fp32":
            output = _cast_like_inputs(output, args, kwargs, self.module)
        return output


SPLIT_BY_TENSOR_PARALLEL = "split_by_tensor_parallel"  # a class attribute of a rank twin's split linears (a later stage)


def splits_by_tensor_parallel(module: torch.nn.Module) -> bool:
    """Whether `module` holds a linear split by tensor parallelism: a rank twin's shard (`inputs.tensor_parallel`'s
    linears say so by SPLIT_BY_TENSOR_PARALLEL), or a parameter torch's `parallelize_module` made a DTensor over a mesh
    dimension named as the plan's TP dimension (`apply.tensor_parallel` names it so)."""
    if any(getattr(inner, SPLIT_BY_TENSOR_PARALLEL, False) for inner in module.modules()):
        return True
    return any(TP.name in (getattr(getattr(parameter, "device_mesh", None), "mesh_dim_names", None) or ())
               for parameter in module.parameters())


def recomputing_whole(whole: bool) -> contextlib.AbstractContextManager:
    """Checkpoint's recomputation run to the end of the unit's forward (`whole`), not stopped once the last saved
    tensor backward needs is made again (torch's default).

    Under tensor parallelism a row-wise linear's output all-reduce is launched asynchronously and waited where the
    output is first used; a recomputation that stops before that use never waits it, and its output stays held (GPT-NeoX
    layers, whose attention output is added only after the MLP has run, held two hidden-sized tensors a layer, 5.8% over
    the plan under full checkpointing on two gloo ranks). Run whole, every all-reduce is waited and freed, and the
    step holds what the rank twin holds, run whole too (benchmarks/tensor_parallel.py)."""
    return torch.utils.checkpoint.set_checkpoint_early_stop(False) if whole else contextlib.nullcontext()


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
    low = low_dtypes()
    return tree_map_only(
        torch.Tensor, lambda t: t.to(target) if t.dtype in low and t.dtype != target else t, output
    )
