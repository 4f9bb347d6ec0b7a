"""A reduced loss that keeps its elementwise buffer (instruments.loss_storage) is counted at that buffer's size."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoplan
from autoplan import TrainingLoop

F = nn.functional
X, TARGET, PROBABILITIES = torch.randn(256, 64), torch.randn(256, 64), torch.rand(256, 64)
ELEMENTWISE_BYTES = 256 * 64 * 4

KEEPS_BUFFER = {"mse_loss": lambda x: F.mse_loss(x, TARGET), "mse_loss sum": lambda x: F.mse_loss(x, TARGET, reduction="sum"),
                "smooth_l1_loss": lambda x: F.smooth_l1_loss(x, TARGET),
                "binary_cross_entropy": lambda x: F.binary_cross_entropy(x.sigmoid(), PROBABILITIES)}
OWN_SCALAR = {"huber_loss": lambda x: F.huber_loss(x, TARGET), "l1_loss": lambda x: F.l1_loss(x, TARGET),
              "binary_cross_entropy_with_logits": lambda x: F.binary_cross_entropy_with_logits(x, PROBABILITIES)}


@pytest.mark.parametrize("name", sorted(KEEPS_BUFFER) + sorted(OWN_SCALAR))
def test_the_cpu_kernels_return_what_the_module_says(name):
    """The fact the instrument stands on, as this torch's CPU kernels do it: a change in torch fails here first."""
    loss = {**KEEPS_BUFFER, **OWN_SCALAR}[name](X)
    assert loss.dim() == 0
    assert loss.untyped_storage().nbytes() == (ELEMENTWISE_BYTES if name in KEEPS_BUFFER else 4)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize("name", ["mse_loss", "binary_cross_entropy", "huber_loss"])
@pytest.mark.parametrize("keep_outputs", [False, True], ids=["dropped", "kept"])
def test_the_plan_equals_real_steps_with_each_loss(name, keep_outputs):
    """Without the instrument an mse_loss plan is 64 KB (the output's size) under the CPU allocator's count."""
    torch.manual_seed(0)
    model, loss_fn = Stack(), {**KEEPS_BUFFER, **OWN_SCALAR}[name]
    plan = autoplan.plan(model, "1GB", example_inputs=(X,), loss_fn=loss_fn, device="cpu", precision="fp32", reserve=0,
                         loop=TrainingLoop(keep_outputs=keep_outputs))
    measured = autoplan.verify(model, plan, example_inputs=(X,), loss_fn=loss_fn, steps=3).measured_peak_bytes
    assert measured == plan.prediction.peak_bytes
