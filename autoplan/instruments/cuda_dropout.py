"""Dropout as a CUDA card runs it, for a simulation of a GPU target on CPU tensors.

`F.dropout` is the composite `aten::dropout`. On a CUDA tensor it runs the fused `native_dropout`,
which saves a bool mask (1 byte an element) for backward; on a CPU tensor it runs bernoulli and a
multiply, which save a mask in the input's dtype (4 bytes an element in fp32). Measured on an H100
(benchmarks/results/h100_2026-11-27/saved.json): 2 MiB saved for a 4×512×1024 fp32 input on CUDA,
8 MiB on the CPU. While `cuda_dropout()` is entered, the composite runs as CUDA's does, so the plan counts
the card's mask. The override is process-wide for that time (`instruments.dispatcher`).
"""

from __future__ import annotations

import contextlib

import torch

from autoplan.instruments.dispatcher import composite_overridden


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """ATen's `dropout` on a CUDA tensor: the fused kernel where it applies (0 < p < 1, not empty)."""
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.native_dropout(input, p, True)[0]
    if p == 0 or not train or input.numel() == 0:
        return input
    return input.mul(torch.zeros((), dtype=input.dtype, device=input.device))  # p == 1: everything dropped


def cuda_dropout() -> contextlib.AbstractContextManager:
    """CUDA's dropout over the composite one in torch's dispatcher while entered."""
    return composite_overridden("dropout", _dropout)
