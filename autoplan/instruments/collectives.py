"""Tensor parallelism's collectives as the rank twin writes them (`inputs.tensor_parallel`), and their time.

The twin plans one rank as an ordinary model; where torch's functional all-reduce returns a new tensor, the twin
calls `all_reduced(x, ranks)`: a copy, as many bytes as torch's, and an op of its own, so that the tracker prices it
at the card's interconnect rather than as a copy in memory. A ring all-reduce sends and receives 2(N-1)/N of the
tensor on every rank (`all_reduce_time_s`), at the card's link to its peers (`Device.interconnect_bandwidth`: NVLink
on SXM cards, PCIe on the others), or at the network's between nodes where the ranks are more than one node holds
(`peer_link`); latency is left out, and a rate the collective reaches in practice is below the
link's nominal one (NCCL's bus bandwidth), so the time is a floor. A device with no interconnect (the CPU) prices
it as the copy it is.

Sequence parallelism (`inputs.sequence_parallel`) replaces each all-reduce by an all-gather and a reduce-scatter
along the ranks' first dimension, as torch's `all_gather_into_tensor` and `reduce_scatter_tensor` stack them:
`all_gathered` makes N times its input, `reduce_scattered` one Nth of it, each a new tensor. A ring sends and
receives (N-1)/N of the whole tensor on every rank for either: half an all-reduce.
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


@torch.library.custom_op("autoplan::all_gathered", mutates_args=())
def all_gathered(x: torch.Tensor, ranks: int) -> torch.Tensor:
    """Every rank's `x` stacked along the first dimension, on the one rank planned: `ranks` copies of its own."""
    return x.repeat(ranks, *([1] * (x.dim() - 1)))


@all_gathered.register_fake
def _(x: torch.Tensor, ranks: int) -> torch.Tensor:
    return x.new_empty((ranks * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("autoplan::reduce_scattered", mutates_args=())
def reduce_scattered(x: torch.Tensor, ranks: int) -> torch.Tensor:
    """This rank's Nth of the sum over ranks of `x` (its first dimension split N ways): the first part, a new tensor."""
    return x[: x.shape[0] // ranks].clone(memory_format=torch.contiguous_format)


@reduce_scattered.register_fake
def _(x: torch.Tensor, ranks: int) -> torch.Tensor:
    return x.new_empty((x.shape[0] // ranks, *x.shape[1:]))


ALL_GATHER = torch.ops.autoplan.all_gathered.default
REDUCE_SCATTER = torch.ops.autoplan.reduce_scattered.default


def all_reduce_time_s(nbytes: int, ranks: int, interconnect_bandwidth: float) -> float:
    """A ring all-reduce of `nbytes` over `ranks` at `interconnect_bandwidth` bytes per second each way."""
    return 2 * (ranks - 1) / ranks * nbytes / interconnect_bandwidth


def collective_time_s(func, args: tuple, out: torch.Tensor, device) -> float | None:
    """The ring time of one of the rank twin's collectives (`func` called with `args`: the tensor, then the ranks; making
    `out`) on `device`'s links; None for any other op, or on a device with no link to its peers (the CPU: the tracker
    prices the copy)."""
    if func not in _COLLECTIVES:
        return None
    ranks = args[1]
    interconnect_bandwidth = peer_link(device, ranks)
    if not interconnect_bandwidth:
        return None
    nbytes = out.numel() * out.element_size()
    if func is ALL_REDUCE:
        return all_reduce_time_s(nbytes, ranks, interconnect_bandwidth)
    whole = nbytes if func is ALL_GATHER else nbytes * ranks  # a reduce-scatter's output is one Nth of what it reduces
    return (ranks - 1) / ranks * whole / interconnect_bandwidth


_COLLECTIVES = frozenset({ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER})


def peer_link(device, ranks: int) -> float:
    """The rate a ring over `ranks` moves at on `device` (bytes per second each way): its peer link (NVLink, PCIe) within
    a node, the network's where the ranks span nodes (the ring's slowest hop); 0: none."""
    link = getattr(device, "interconnect_bandwidth", 0.0)
    network = getattr(device, "network_bandwidth", 0.0)
    if link and network and ranks > getattr(device, "node_size", ranks):
        return min(link, network)
    return link
