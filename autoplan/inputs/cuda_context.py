"""The CUDA context: device memory a training process holds outside PyTorch's caching allocator, as measured.

What NVML (nvidia-smi) counts as used, less `torch.cuda.memory_reserved()`, less what was in use before the
process began: the driver's context, the kernels it loaded (with lazy loading, CUDA 11.7 and later and torch's
default, only the ones that ran) and the workspaces cuBLAS, cuDNN and the attention libraries keep for
themselves. It does not grow with the model. A card's profile takes the figure measured on its architecture
(same compute capability: the same kernels are loaded), else the estimate; `cuda_context=` states one's own.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20
ESTIMATE_BYTES = 512 * MIB
ESTIMATE_SOURCE = "an estimate (512 MiB): not measured on this architecture; state yours with cuda_context="


@dataclass(frozen=True)
class ContextMeasurement:
    """One measured context."""

    card: str
    compute_capability: tuple[int, int]
    stack: str  # driver, CUDA, torch, module loading
    at_init_bytes: int  # the context and one tensor
    in_training_bytes: int | None  # after cuBLAS, cuDNN and attention ran (None: not measured)
    source: str
    default: bool  # the figure profiles of this architecture take (today's stacks load lazily)


MEASURED = (
    # benchmarks/results/h100_2026-11-27/context.json: NVML used less reserved less the 483.2 MiB in use before
    ContextMeasurement("NVIDIA H100 80GB HBM3", (9, 0), "driver 580.159.04, CUDA 13.0, torch 2.11, lazy loading",
                       at_init_bytes=645_464_064, in_training_bytes=800_653_312, default=True,
                       source="benchmarks/gpu_truth.py --parts context on an H100, 2026-11-27"),
    ContextMeasurement("NVIDIA H100 80GB HBM3", (9, 0), "driver 580.159.04, CUDA 13.0, torch 2.11, CUDA_MODULE_LOADING=EAGER",
                       at_init_bytes=1_316_552_704, in_training_bytes=2_155_413_504, default=False,
                       source="benchmarks/gpu_truth.py --parts context on an H100, 2026-11-27"),
    # eager by necessity: lazy loading came with CUDA 11.7
    ContextMeasurement("Tesla V100-SXM2-16GB", (7, 0), "driver 460.91.03, CUDA 11.2, eager loading",
                       at_init_bytes=1343 * MIB, in_training_bytes=None, default=False,
                       source="transformers docs, 'Efficient Training on a Single GPU' (January 2022): torch.ones((1, 1)).to('cuda')"),
)


def default_context(compute_capability: tuple[int, int] | None) -> tuple[int, str]:
    """The context a card of `compute_capability` is planned with, in training (bytes), and where the figure comes from."""
    for measured in MEASURED:
        if measured.default and measured.compute_capability == compute_capability and measured.in_training_bytes:
            return measured.in_training_bytes, (f"measured on an {measured.card} ({measured.stack}) once cuBLAS, cuDNN "
                                                f"and attention ran: {measured.source}")
    return ESTIMATE_BYTES, ESTIMATE_SOURCE


def context_words(source: str) -> str:
    """A context's source in a few words, as a report names it: "measured on an H100", "estimated", "yours"."""
    if source.startswith("given"):
        return "yours"
    if not source.startswith("measured on an "):
        return "estimated"
    return "measured on an " + source.removeprefix("measured on an NVIDIA ").split(" ")[0]
