"""The target GPU's kernel choices for a simulation on the CPU: attention and autocast as the card runs them.

A plan for a GPU is simulated on fake CPU tensors (fake `device="cuda"` tensors abort a CPU-only
torch in autograd), so where the CPU would pick other kernels than the card, the card's are
stood in for: SDPA's kernel (`instruments.attention`), CUDA autocast's fp32 ops
(`instruments.cuda_autocast`) and the fused dropout with its 1-byte mask (`instruments.cuda_dropout`). The optimizer's implementation is the target's already
(`TrainingLoop.optimizer_implementation`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from autoplan.instruments.attention import TargetAttention
from autoplan.instruments.cuda_autocast import CudaAutocastRules
from autoplan.instruments.cuda_dropout import cuda_dropout


class TargetKernels:
    """What was stood in for during one simulation, for the plan's note."""

    def __init__(self, attention: TargetAttention) -> None:
        self.attention = attention

    def note(self) -> str:
        major, minor = self.attention.capability
        kernels = " and ".join(kernel.value for kernel in self.attention.kernels)
        attention = f"attention by the {kernels} kernel{'s' if len(self.attention.kernels) > 1 else ''}, " if kernels else ""
        return (f"simulated as a CUDA card of compute capability {major}.{minor} runs the step: {attention}autocast with "
                "CUDA's fp32 ops (layer_norm, softmax, ...), dropout's 1-byte masks, on CPU tensors standing in for the card's")


@contextlib.contextmanager
def as_the_target_runs(device) -> Iterator[TargetKernels | None]:
    """The card's kernels while entered, for a CUDA target (`device.compute_capability`); nothing for the CPU."""
    capability = getattr(device, "compute_capability", None)
    if capability is None:
        yield None
        return
    with TargetAttention(capability) as attention, CudaAutocastRules(), cuda_dropout():
        yield TargetKernels(attention)
