"""A device as the planner prices it: its memory, dense peak FLOP/s per precision, bandwidths and CUDA context.

`Device` and the helpers that build a CUDA card's entry (`cuda_card`): the table of known cards is
`inputs.devices`, a card of the user's own numbers `inputs.custom_devices`.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autoplan.axes.precision import PRECISION, dtype_of, flops_for, low_precision
from autoplan.inputs.cuda_context import default_context

if TYPE_CHECKING:  # torch is imported where a device needs it: naming a profile (`--device h100`) costs no torch import
    import torch

GIB = 2**30  # datasheet "80GB" of GPU memory is 80 GiB (nvidia-smi counts MiB)
TERA = 1e12


@dataclass(frozen=True)
class Device:
    """One kind of device; rates are dense (no structured sparsity)."""

    name: str
    description: str
    kind: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    context_bytes: int
    source: str
    # CUDA compute capability (major, minor): which attention kernels the card runs
    # (instruments.attention); None for the CPU
    compute_capability: tuple[int, int] | None = None
    # the host link, bytes per second each way: what copies of offloaded activations move at
    # (the card's PCIe generation, or NVLink-C2C); 0: no host link (the CPU)
    host_bandwidth: float = 0.0
    context_source: str = ""  # where context_bytes comes from (inputs.cuda_context): measured, estimated, or given
    # the link to the card's peers, bytes per second each way: what tensor parallelism's all-reduces move at
    # (instruments.collectives): NVLink on SXM cards, else PCIe peer to peer; 0: none (the CPU)
    interconnect_bandwidth: float = 0.0
    # the link between nodes, per GPU, bytes per second each way: what a collective over more ranks than one node holds
    # (`node_size`) moves at; 0: none (the CPU, whose collectives are priced as copies)
    network_bandwidth: float = 0.0
    node_size: int = 8  # GPUs that share the peer link (an HGX/DGX board's eight)

    def __post_init__(self) -> None:
        # A plain dict would let callers mutate a "frozen" device's rates.
        if not isinstance(self.peak_flops, types.MappingProxyType):
            object.__setattr__(
                self, "peak_flops", types.MappingProxyType(dict(self.peak_flops))
            )

    @property
    def supports_bf16(self) -> bool:
        return not PRECISION.unsupported("bf16", self)

    @property
    def low_precision_name(self) -> str:
        """The low precision `precision="auto"` picks here (`axes.precision.low_precision`): bf16, or fp16 without it."""
        return low_precision(self).name

    @property
    def low_precision_dtype(self) -> torch.dtype:
        return dtype_of(self.low_precision_name)

    def flops_for(self, dtype: torch.dtype, *, allow_tf32: bool = False) -> float:
        """Peak FLOP/s for matmuls in ``dtype`` (`axes.precision.flops_for`).

        A precision the hardware lacks runs at the fp32 rate (emulated or
        upcast), and so do dtypes without a tensor-core path (ints, float64).
        """
        return flops_for(self, dtype, allow_tf32=allow_tf32)


def cuda_card(
    name: str,
    description: str,
    memory_gb: float,
    flops_tera: Mapping[str, float],
    bandwidth_bytes: float,
    source: str,
    compute_capability: tuple[int, int],
    host_bandwidth: float,
    interconnect_bandwidth: float = 0.0,
    network_bandwidth: float = 0.0,
) -> Device:
    """A CUDA card's entry; its interconnect is its host link (PCIe peer to peer) unless it has NVLink's; its network
    one 100 Gb/s port a GPU unless given."""
    return Device(
        name=name,
        description=description,
        kind="cuda",
        memory_bytes=int(memory_gb * GIB),
        peak_flops={k: v * TERA for k, v in flops_tera.items()},
        memory_bandwidth=bandwidth_bytes,
        source=source,
        compute_capability=compute_capability,
        host_bandwidth=host_bandwidth,
        interconnect_bandwidth=interconnect_bandwidth or host_bandwidth,
        network_bandwidth=network_bandwidth or NETWORK_100G,
        **context_of(compute_capability),
    )


# Host links, per direction, from the interface's specification (x16 lanes): real pinned copies
# reach less (to be measured on a GPU); GH200's NVLink-C2C is 900 GB/s both ways together.
PCIE3, PCIE4, PCIE5, NVLINK_C2C = 16e9, 32e9, 64e9, 450e9
# NVLink between SXM cards, per direction (the datasheets' figure is both ways together): V100's NVLink 2 300 GB/s,
# A100's NVLink 3 600 GB/s, H100's and H200's NVLink 4 900 GB/s
NVLINK2, NVLINK3, NVLINK4 = 150e9, 300e9, 450e9
# Between nodes, one InfiniBand port a GPU, per direction: DGX H100's eight ConnectX-7 at 400 Gb/s (NDR), DGX A100's
# eight ConnectX-6 at 200 Gb/s (HDR); a card sold without a board of its own is assumed at 100 Gb/s (give a custom
# device's `network` where yours differs)
NETWORK_400G, NETWORK_200G, NETWORK_100G = 50e9, 25e9, 12.5e9


def context_of(compute_capability: tuple[int, int]) -> dict[str, Any]:
    """A card's context fields (`Device.context_bytes`, `context_source`) by its architecture (inputs.cuda_context)."""
    context_bytes, context_source = default_context(compute_capability)
    return {"context_bytes": context_bytes, "context_source": context_source}
