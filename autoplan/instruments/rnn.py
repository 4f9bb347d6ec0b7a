"""The workspace oneDNN's LSTM layers keep for backward, which torch's fake kernel leaves out.

In training on the CPU, `nn.LSTM` runs `aten.mkldnn_rnn_layer` once per layer and direction (GRU
and plain RNN layers run ops whose fakes are right); its fourth output is a workspace saved for
backward: 389,120 bytes for one 32-wide layer over 48 steps of 4 sequences, about sixteen times its
output. torch's meta kernel returns an empty one, so a simulation would plan those bytes as free and
a plan that says it fits would not. The size follows oneDNN's layout, for which torch has no
formula: it is read off one real call on zeros of the same shapes, outside every mode and once per
shape, and the fake call returns a workspace of that size. torch's flop counter has no formula for
the kernel either, so recomputing an LSTM looked free: `rnn_flop_formulas` gives it its matmuls'
FLOPs, forward and backward (`instruments.flop_formulas`). The simulation runs on CPU fakes for a GPU
target too, so there this size stands in for cuDNN's reserve space (`_cudnn_rnn`'s fake kernel returns an empty one as well), which
no GPU has measured for autoplan yet.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

MKLDNN_RNN_LAYER = torch.ops.aten.mkldnn_rnn_layer.default
MKLDNN_RNN_LAYER_BACKWARD = torch.ops.aten.mkldnn_rnn_layer_backward.default
_WORKSPACE = 3  # (output, hy, cy, workspace)
_TRAIN = 15  # mkldnn_rnn_layer(input, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers,
#                               has_biases, bidirectional, batch_first, train)


def with_real_workspace(args: tuple, out: tuple, empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> tuple:
    """`out`, the fake call's outputs, with a workspace of the size the real kernel makes for `args`."""
    if len(args) <= _TRAIN or not args[_TRAIN] or not torch.is_grad_enabled():
        return out  # the real kernel makes none outside training or with grad off (checkpoint's first forward)
    size = workspace_bytes(_signature(args))
    return (*out[:_WORKSPACE], empty((size,), torch.uint8), *out[_WORKSPACE + 1:])


class _TensorLike(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


class _ListArgument(NamedTuple):
    items: tuple


def _signature(args: tuple) -> tuple:
    """The call's shapes and flags, hashable: tensors by shape and dtype, a list as a tuple, the rest as it is."""
    return tuple(_TensorLike(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else
                 _ListArgument(tuple(a)) if isinstance(a, list) else a for a in args)


@functools.lru_cache(maxsize=256)
def workspace_bytes(signature: tuple) -> int:
    """The workspace bytes of one real `mkldnn_rnn_layer` call with these shapes and flags."""
    # grad on, as the kernel makes its workspace only then; no input requires grad, so no graph is kept
    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.enable_grad():
        args: list[Any] = [torch.zeros(entry.shape, dtype=entry.dtype) if isinstance(entry, _TensorLike) else
                           list(entry.items) if isinstance(entry, _ListArgument) else entry for entry in signature]
        workspace = MKLDNN_RNN_LAYER(*args)[_WORKSPACE]
        return workspace.untyped_storage().nbytes()


def _forward_flops(input, w0, w1, *args, out_val=None, **kwargs) -> int:
    """One layer and direction: the input and recurrent projections of every gate at every step."""
    steps_by_batch = input.numel() // input.shape[-1]  # steps × sequences
    gates_by_hidden, inputs = w0.shape  # (gates × hidden, input size), (gates × hidden, hidden)
    return 2 * steps_by_batch * gates_by_hidden * (inputs + w1.shape[1])


def _backward_flops(input, w0, w1, *args, out_val=None, **kwargs) -> int:
    """The gradients of the layer's input and weights: twice its forward's matmuls."""
    return 2 * _forward_flops(input, w0, w1)


def rnn_flop_formulas() -> dict[Any, Callable[..., int]]:
    """oneDNN's recurrent layer, forward and backward, by op, for torch's flop counter (raw: over tensors)."""
    return {MKLDNN_RNN_LAYER.overloadpacket: _forward_flops, MKLDNN_RNN_LAYER_BACKWARD.overloadpacket: _backward_flops}
