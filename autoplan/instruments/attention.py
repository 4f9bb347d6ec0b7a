"""Attention as the target GPU runs it, simulated on the CPU.

`F.scaled_dot_product_attention` picks its kernel by device: on the CPU, dropout sends it to the
math path (T×T probabilities and a T×T dropout mask saved for backward) and no dropout to the CPU
flash kernel; on a CUDA card it picks FlashAttention, else the memory-efficient kernel, else the
math path, by dtype, head size, mask and compute capability (ATen's `sdp_utils.cpp`). Neither
fused CUDA kernel keeps a T×T matrix, with or without dropout. A plan for a GPU is simulated on
fake CPU tensors (fake `device="cuda"` tensors abort a CPU-only torch in autograd), so
`TargetAttention` stands in for the card's choice: under it, every SDPA call runs the CUDA kernel
op the card would pick (`aten._scaled_dot_product_flash_attention`, `..._efficient_attention` or
the math op) with the preprocessing ATen does around it (head dims padded to 8 for flash, boolean
masks made additive and padded to 16 columns for the efficient kernel). Those ops' meta kernels
give CUDA's output layouts and saved tensors; torch's flop counter prices them.

Modelled, not reproduced: cuDNN attention (chosen ahead of flash on some Hopper builds) is taken
as flash, whose saved tensors it matches (output and a log-sum-exp per row); grouped-query
attention on the efficient kernel repeats the key/value heads first, an upper bound; the kernels'
internal workspaces are not counted.
"""

from __future__ import annotations

import contextlib
import enum
import math

import torch
import torch.nn.functional as F

from autoplan.instruments.dispatcher import composite_overridden

_aten = torch.ops.aten


class AttentionKernel(enum.Enum):
    FLASH = "flash"
    EFFICIENT = "memory-efficient"
    MATH = "math"


_LOW_PRECISION = (torch.float16, torch.bfloat16)
# consumer Ampere/Ada/Blackwell cards: flash's backward for head dims over 192 needs more shared memory
_SMALL_SHARED_MEMORY = {(8, 6), (8, 9), (12, 0)}


def _flash_fits(capability, query, key, value, attn_mask, is_causal) -> bool:
    head_dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return (
        torch.backends.cuda.flash_sdp_enabled()
        and capability >= (8, 0)
        and attn_mask is None
        and query.dtype in _LOW_PRECISION
        and len(head_dims) == 1 and query.shape[-1] <= 256
        and not (training and query.shape[-1] > 192 and capability in _SMALL_SHARED_MEMORY)
        and not (is_causal and query.shape[-2] != key.shape[-2])
    )


def _efficient_fits(capability, query, key, value) -> bool:
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if capability >= (8, 0) else (torch.float16, torch.float32)
    # CUTLASS's alignment: 128 bits of a tensor-core operand, 4 elements on sm80+ without them
    half = query.dtype in _LOW_PRECISION
    alignment = 8 if half and capability >= (7, 0) else 4 if capability >= (8, 0) else 1
    return (
        torch.backends.cuda.mem_efficient_sdp_enabled()
        and capability >= (5, 0)
        and query.dtype in dtypes
        and query.shape[-1] == key.shape[-1]
        and query.shape[-1] % alignment == 0 and value.shape[-1] % alignment == 0
    )


def choose_kernel(capability: tuple[int, int], query, key, value, attn_mask=None, is_causal=False) -> AttentionKernel:
    """The kernel a CUDA card of `capability` runs for this call, in ATen's priority order."""
    if query.dim() != 4 or query.is_nested:
        return AttentionKernel.MATH
    if _flash_fits(capability, query, key, value, attn_mask, is_causal):
        return AttentionKernel.FLASH
    if _efficient_fits(capability, query, key, value):
        return AttentionKernel.EFFICIENT
    return AttentionKernel.MATH


def _pad_last_dim(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    short = -tensor.shape[-1] % multiple
    return F.pad(tensor, (0, short)) if short else tensor


def _flash(query, key, value, dropout_p, is_causal, scale):
    head_dim = query.shape[-1]
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    padded = [_pad_last_dim(t, 8) for t in (query, key, value)]
    out = _aten._scaled_dot_product_flash_attention(*padded, dropout_p, is_causal, False, scale=scale)[0]
    return out[..., :head_dim] if out.shape[-1] != head_dim else out


def _additive(attn_mask, dtype):
    """ATen's convert_boolean_attn_mask: a boolean mask as 0 / -inf in the query's dtype; others as they are."""
    return torch.where(attn_mask.logical_not(), float("-inf"), 0.0).to(dtype) if attn_mask.dtype == torch.bool else attn_mask


def _additive_mask(attn_mask, query, key):
    """ATen's preprocessing for the efficient kernel: a boolean mask made additive in the query's
    dtype, its rows padded to 16 columns when not aligned, expanded to (batch, heads, Tq, Tk)."""
    if attn_mask is None:
        return None
    attn_mask = _additive(attn_mask, query.dtype)
    if any(stride % 16 for stride in attn_mask.stride()[:-1]):
        attn_mask = _pad_last_dim(attn_mask, 16)[..., : key.shape[-2]]
    return attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale):
    if key.shape[-3] != query.shape[-3]:  # grouped-query attention: heads repeated (an upper bound)
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
    logsumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    bias = _additive_mask(attn_mask, query, key)
    return _aten._scaled_dot_product_efficient_attention(query, key, value, bias, logsumexp, dropout_p, is_causal, scale=scale)[0]


def _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    attn_mask = _additive(attn_mask, query.dtype) if attn_mask is not None else None
    return _aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


class TargetAttention:
    """Runs every SDPA call as a CUDA card of `capability` would, while entered; `kernels` says which ran.

    SDPA is a composite op: its CPU decomposition runs above the fake-tensor and tracker modes,
    and nested calls (nn.MultiheadAttention's) pass no Python hook a mode could see. So, while
    entered, a Python kernel is registered over the composite one in torch's dispatcher
    (`instruments.dispatcher`; forward and checkpoint recomputation alike run it); on exit the op is as it was.
    """

    def __init__(self, capability: tuple[int, int]) -> None:
        self.capability = capability
        self.kernels: dict[AttentionKernel, None] = {}  # the kernels run, in the order first seen
        self._override: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> "TargetAttention":
        self._override = composite_overridden("scaled_dot_product_attention", self.attention)
        self._override.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._override is not None:  # entered
            self._override.__exit__(*exc)
        self._override = None

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        kernel = choose_kernel(self.capability, query, key, value, attn_mask, is_causal)
        self.kernels[kernel] = None
        if kernel is AttentionKernel.FLASH:
            return _flash(query, key, value, dropout_p, is_causal, scale)
        if kernel is AttentionKernel.EFFICIENT:
            return _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale)
        return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
