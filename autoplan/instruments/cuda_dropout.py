"""Dropout as a CUDA card runs it, for a simulation of a GPU target on CPU tensors.

`F.dropout` is the composite `aten::dropout`. On a CUDA tensor it runs the fused `native_dropout`,
which saves a bool mask (1 byte an element) for backward; on a CPU tensor it runs bernoulli and a
multiply, which save a mask in the input's dtype (4 bytes an element in fp32). Measured on an H100
(benchmarks/results/h100_2026-11-27/saved.json): 2 MiB saved for a 4×512×1024 fp32 input on CUDA,
8 MiB on the CPU. While `CudaDropout` is entered, the composite runs as CUDA's does, so the plan counts
the card's mask. The override is process-wide for that time, as `instruments.attention`'s is.
"""

from __future__ import annotations

import warnings

import torch


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """ATen's `dropout` on a CUDA tensor: the fused kernel where it applies (0 < p < 1, not empty)."""
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.native_dropout(input, p, True)[0]
    if p == 0 or not train or input.numel() == 0:
        return input
    return input.mul(torch.zeros((), dtype=input.dtype, device=input.device))  # p == 1: everything dropped


class CudaDropout:
    """Registers CUDA's dropout over the composite one in torch's dispatcher while entered."""

    def __init__(self) -> None:
        self._library: torch.library.Library | None = None

    def __enter__(self) -> "CudaDropout":
        with warnings.catch_warnings():  # torch warns that a kernel is overridden: that is the point
            warnings.simplefilter("ignore")
            self._library = torch.library.Library("aten", "IMPL")
            self._library.impl("dropout", _dropout, "CompositeImplicitAutograd")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._library is not None:
            self._library._destroy()
        self._library = None
