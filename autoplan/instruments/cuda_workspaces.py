"""The workspaces cuBLAS keeps on a CUDA card from the first matmul on, for a GPU target's simulation.

torch gives each cuBLAS handle (one per stream) a workspace from the caching allocator, and cuBLASLt one
of its own, at the first matmul; they stay allocated, so `torch.cuda.max_memory_allocated()` counts them
in every step. Measured on an H100 (benchmarks/results/h100_2026-11-27, torch 2.11, CUDA 13): every
model's first step began at its parameters and batch plus 64 MiB, 32 MiB for each; with them counted,
what four planned models' steps allocated equalled the simulation's peak to a MiB for three of them.
Older cards: torch's documented default cuBLAS workspace (`CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8`,
8 MiB + 128 KiB); cuBLASLt's there was not measured and is not counted. A `CUBLAS_WORKSPACE_CONFIG`
set in the environment is read instead.
"""

from __future__ import annotations

import os

import torch

KIB = 1024
HOPPER_MEASURED = 2 * 32 * KIB * KIB  # cuBLAS + cuBLASLt on sm90, torch 2.11 (measured)
PRE_HOPPER_CUBLAS = (4096 * 2 + 16 * 8) * KIB  # torch's documented default, ":4096:2:16:8"


def library_workspace_bytes(device) -> int:
    """Bytes cuBLAS holds on the target through a training step: 0 for the CPU."""
    capability = getattr(device, "compute_capability", None)
    if getattr(device, "kind", None) != "cuda" or capability is None:
        return 0
    configured = _configured(os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if configured is not None:
        return configured * (2 if capability >= (9, 0) else 1)
    return HOPPER_MEASURED if capability >= (9, 0) else PRE_HOPPER_CUBLAS


def _configured(config: str) -> int | None:
    """":SIZE_KiB:COUNT" pairs, as torch reads them; None when unset or unreadable."""
    parts = [part for part in config.split(":") if part]
    if not parts or len(parts) % 2:
        return None
    try:
        return sum(int(size) * KIB * int(count) for size, count in zip(parts[::2], parts[1::2]))
    except ValueError:
        return None


def held_workspaces(device) -> list[torch.Tensor]:
    """A tensor standing for the workspaces (made under the simulation's fake mode), or none."""
    nbytes = library_workspace_bytes(device)
    return [torch.empty(nbytes, dtype=torch.uint8)] if nbytes else []
