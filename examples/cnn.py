"""Plan a ResNet-style CNN (BatchNorm, in-place ReLU) for an RTX 4090, rewrite it, train it.

    python examples/cnn.py

The units are the residual blocks (the class the model repeats). BatchNorm running statistics are
updated once per step even in blocks the plan recomputes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths=(32, 64, 128), blocks_per_stage: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True))
        layers, c_in = [], widths[0]
        for i, width in enumerate(widths):
            for j in range(blocks_per_stage):
                layers.append(Block(c_in, width, stride=2 if i > 0 and j == 0 else 1))
                c_in = width
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def main() -> None:
    torch.manual_seed(0)
    model = ResNet()
    images, labels = torch.randn(32, 3, 64, 64), torch.randint(0, 10, (32,))
    loss_fn = lambda logits: F.cross_entropy(logits, labels)  # noqa: E731 - the step's own loss
    start = time.perf_counter()
    no_plan = autoplan.plan(model, "100%", example_inputs=(images,), device="rtx-4090", loss_fn=loss_fn, reserve=0)
    budget = (no_plan.prediction.minimum_peak_bytes + no_plan.prediction.baseline_peak_bytes) // 2
    plan = autoplan.plan(model, budget, example_inputs=(images,), device="rtx-4090", loss_fn=loss_fn, reserve=0)
    print(plan.report())
    print(f"planned twice in {time.perf_counter() - start:.1f} s\n")

    autoplan.apply(model, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
