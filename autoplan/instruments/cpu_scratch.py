"""What a CPU kernel allocates inside itself beyond its outputs, read off one real call on zeros.

Under fake tensors an op allocates its outputs and nothing else; the CPU kernel behind it may hold
more while it runs: `aten.mm` copies an operand whose strides BLAS cannot take, oneDNN's convolution
backward reorders its tensors into blocked layouts, the flash attention kernel keeps per-thread
buffers, `aten.logsumexp` makes an input-sized difference, a pointwise op on two dtypes copies its
operands into the common one (TensorIterator's CPU promotion). No dispatch mode sees those (they are made
below it), so a plan for the CPU would count none of them, and the CPU allocator holds them at the
moment they are made. For a CPU target the simulation asks here: the op is run once for real, outside
every mode, on zeros with the call's shapes, strides and dtypes, under torch's profiler with its
memory reports on, and the most bytes the op held above what it returned are its scratch. Cached per
signature; ops that draw random numbers or whose work depends on the values are never run.

For a GPU target the CPU's kernels are not the card's: there this is not asked. What a CUDA matmul copies
of an operand cuBLAS cannot read in place is counted by `instruments.cuda_matmul`; cuBLAS's and cuDNN's
workspaces are not modelled (docs/how-it-works.md).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.profiler
from torch.utils._python_dispatch import _disable_current_modes

from autoplan.instruments.host_blocks import cpu_allocations, host_only
from autoplan.vocabulary.descriptors import silenced

GRANULE = 512  # blocks count as the CUDA allocator rounds them, as every byte of the simulation does

# The ops whose CPU kernels allocate inside (found by a one-off scan, its script not kept, over the zoo and
# the transformers families, CPU, torch 2.13): matmuls, convolutions, fused attention, logsumexp; and bitsandbytes'
# optimizer updates, whose CPU kernels are written in Python with parameter-sized temporaries. By name: the
# bitsandbytes ops exist only once it is imported.
SCRATCH_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
    "aten::convolution", "aten::convolution_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::logsumexp", "aten::mkldnn_rnn_layer", "aten::mkldnn_rnn_layer_backward",
    "bitsandbytes::optimizer_update_32bit", "bitsandbytes::optimizer_update_8bit_blockwise",
    "bitsandbytes::gemm_4bit",  # dequantizes, then a matmul whose CPU kernel may pack its operands (AVX512-BF16: 4× the weight)
    # reduced losses that make the elementwise loss first, then reduce it into a scalar of their own (mse_loss,
    # smooth_l1_loss and binary_cross_entropy keep theirs in the loss: instruments.loss_storage)
    "aten::huber_loss", "aten::binary_cross_entropy_with_logits",
    "aten::_scaled_mm",  # float8 on the CPU: the operands upcast and scaled, one made contiguous, inside the kernel
})


class _TensorLike(NamedTuple):
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_elements: int
    dtype: torch.dtype
    requires_grad: bool


def scratch_bytes(func, args: tuple, kwargs: dict) -> int:
    """Bytes the CPU kernel of `func` holds inside itself beyond its outputs for this call (0 for most ops)."""
    schema = getattr(func, "_schema", None)  # an aten or library operator (a higher-order one has none)
    if schema is None or schema.name not in SCRATCH_OPS:
        return 0
    return _measured_call(func, args, kwargs)


def promoted_copy_bytes(func, args: tuple, kwargs: dict) -> int:
    """Bytes a pointwise op on tensors of two dtypes holds inside its CPU kernel (0 for any other call).

    TensorIterator, on the CPU only, copies every operand that is not of the common dtype into it, and an in-place
    result of another dtype into a temporary of it, copied back at the end (a bf16 `mul_` by a float32 tensor holds 8
    bytes an element: torchao's float8 backward scales its bf16 gradients so); a GPU kernel casts as it reads. Read
    off a real call like the ops above. A 0-dim operand makes no copy the step holds (host_blocks), and a bool operand
    (where's condition) is not promoted: neither asks."""
    if not isinstance(func, torch._ops.OpOverload) or not _mixes_dtypes(func, args, kwargs):
        return 0
    return _measured_call(func, args, kwargs)


def _measured_call(func, args: tuple, kwargs: dict) -> int:
    try:
        signature = (_signature(args), tuple(sorted((name, _signature((value,))) for name, value in kwargs.items())))
        hash(signature)
    except TypeError:  # an argument that cannot key a cache: not measured
        return 0
    return _measured(func, signature, torch.get_num_threads())


def _mixes_dtypes(func, args: tuple, kwargs: dict) -> bool:
    if not _promotes(func):
        return False
    dtypes = set()
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.dtype is not torch.bool:
            dtypes.add(value.dtype)
    return len(dtypes) > 1


@functools.lru_cache(maxsize=None)
def _promotes(func) -> bool:
    """A pointwise op that draws no random numbers (asked on every op a CPU target simulates: cached per op)."""
    return torch.Tag.pointwise in func.tags and torch.Tag.nondeterministic_seeded not in func.tags


def _signature(values: tuple) -> tuple:
    return tuple(_describe(value) for value in values)


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.is_sparse or value.layout != torch.strided:
            raise TypeError("not a strided CPU tensor")
        return _TensorLike(tuple(value.shape), tuple(value.stride()), int(value.storage_offset()),
                           value.untyped_storage().nbytes() // max(value.element_size(), 1), value.dtype, value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple(_describe(item) for item in value)
    return value


def _real(value: Any) -> Any:
    if isinstance(value, _TensorLike):
        storage = torch.zeros(max(value.storage_elements, 1), dtype=value.dtype)
        return storage.as_strided(value.shape, value.stride, value.storage_offset)
    if isinstance(value, tuple) and value and all(isinstance(item, (_TensorLike, type(None))) for item in value):
        return [_real(item) for item in value]  # a list of tensors (an op's Tensor[] argument)
    return value


@functools.lru_cache(maxsize=4096)
def _measured(func, signature: tuple, threads: int) -> int:
    """One real call of `func` on zeros: the most bytes it held above what it returned."""
    positional, keywords = signature
    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
        args = tuple(_real(value) for value in positional)
        kwargs = {name: _real(value[0]) for name, value in keywords}
        with silenced(2):
            profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            with profile:
                out = func(*args, **kwargs)
        del out
    held = peak = 0
    for size in _block_sizes(profile):
        held += size
        peak = max(peak, held)
    return max(0, peak - max(held, 0))


def _block_sizes(profile) -> list[int]:
    """The CPU blocks allocated (+) and freed (−) during the call, in order, rounded (the profiler reports the frees of
    blocks it saw made, so the inputs made before it are not in here). A block a GPU would not hold (a scalar converted
    inside the kernel: `instruments.host_blocks`) is left out, as the allocator's count leaves it out of the step."""
    sizes, left_out = [], set()
    for node in cpu_allocations(profile.profiler.kineto_results.experimental_event_tree()):
        nbytes, address = node.extra_fields.alloc_size, node.extra_fields.ptr
        if nbytes > 0 and host_only(node):
            left_out.add(address)
        elif nbytes < 0 and address in left_out:
            left_out.discard(address)
        else:
            sizes.append((1 if nbytes > 0 else -1) * -(-abs(nbytes) // GRANULE) * GRANULE)
    return sizes
