"""Reduced losses whose CPU kernel returns the scalar inside the elementwise loss it reduced.

`F.mse_loss(output, target)` on the CPU computes the elementwise loss into an input-sized buffer and
writes the mean into that buffer's storage: the 0-dim loss it returns holds the whole buffer for as
long as the loss lives (through backward, and into the next step's forward in a loop whose `loss`
variable outlives the step). Measured by the CPU allocator (tests/instruments/test_loss_storage.py):
mse_loss (mean and sum), smooth_l1_loss and binary_cross_entropy do this; huber_loss,
binary_cross_entropy_with_logits, l1_loss and cross_entropy return a scalar of their own. Fake tensors
return a fresh 0-dim storage, so on a CPU target the simulation gives the loss that buffer instead.
A GPU target is left as it is: what CUDA's kernels return has not been measured on a card here.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

# op -> the position of its `reduction` argument (0: none, 1: mean, 2: sum)
_REDUCTION_AT = {aten.mse_loss.default: 2, aten.smooth_l1_loss.default: 2, aten.binary_cross_entropy.default: 3}


def as_the_cpu_kernel_returns(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """`out` of `func`, or for a reduced loss of `_REDUCTION_AT`, a 0-dim view into a buffer the input's size."""
    position = _REDUCTION_AT.get(func)
    if position is None or not isinstance(out, torch.Tensor) or out.dim() != 0:
        return out
    reduction = args[position] if len(args) > position else kwargs.get("reduction", 1)
    if reduction == 0:
        return out
    elementwise = args[0]
    buffer = torch.empty(elementwise.shape, dtype=out.dtype, device=out.device)
    return buffer.as_strided((), (), 0)
