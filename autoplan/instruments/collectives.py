"""Tensor parallelism's all-reduce as the rank twin writes it (`inputs.tensor_parallel`), and its time.

The twin plans one rank as an ordinary model; where torch's functional all-reduce returns a new tensor, the twin
calls `all_reduced(x, ranks)`: a copy, as many bytes as torch's, and an op of its own, so that the tracker prices it
at the card's interconnect rather than as a copy in memory. A ring all-reduce sends and receives 2(N-1)/N of the
tensor on every rank (`all_reduce_time_s`), at the card's link to its peers (`Device.interconnect_bandwidth`: NVLink
on SXM cards, PCIe on the others); latency is left out, and a rate the collective reaches in practice is below the
link's nominal one (NCCL's bus bandwidth), so the time is a floor. A device with no interconnect (the CPU) prices
it as the copy it is.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("autoplan::all_reduced", mutates_args=())
def all_reduced(x: torch.Tensor, ranks: int) -> torch.Tensor:
    """The sum over `ranks` ranks of `x`, on the one rank planned: a new tensor of x's values (the twin's rank 0)."""
    return x.clone(memory_format=torch.contiguous_format)


@all_reduced.register_fake
def _(x: torch.Tensor, ranks: int) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _backward(ctx, gradient: torch.Tensor):
    return gradient, None  # every rank's partial sum gets the whole gradient: no collective in backward


all_reduced.register_autograd(_backward)

ALL_REDUCE = torch.ops.autoplan.all_reduced.default


def all_reduce_time_s(nbytes: int, ranks: int, interconnect_bandwidth: float) -> float:
    """A ring all-reduce of `nbytes` over `ranks` at `interconnect_bandwidth` bytes per second each way."""
    return 2 * (ranks - 1) / ranks * nbytes / interconnect_bandwidth
