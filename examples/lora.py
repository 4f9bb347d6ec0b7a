"""Plan a LoRA fine-tune (frozen base weights, trainable low-rank adapters), rewrite it, train it.

    python examples/lora.py

Frozen parameters have no gradients and no optimizer state: the plan's static memory counts the
adapters' only, which the printed breakdown shows next to what full fine-tuning would need.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from autoplan.vocabulary.formatting import format_bytes
from examples.gpt import build  # noqa: E402


class LoRALinear(nn.Module):
    """y = W x + (B A x) · alpha/rank, with W frozen and A, B trained."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features) * base.in_features**-0.5)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))  # starts as the base model
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


def add_lora(model: nn.Module) -> nn.Module:
    """Freeze everything, then wrap every Linear inside the transformer blocks with an adapter."""
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and module is not model and "lm_head" not in name:
                setattr(module, name, LoRALinear(child))
    return model


def main() -> None:
    model, (idx,) = build(n_layer=6, n_embd=256, n_head=8, block_size=256, vocab_size=1024, batch_size=8, seq_len=256)
    inputs = ((idx,), {"targets": idx})
    full = autoplan.plan(model, "100%", example_inputs=inputs, device="a100-40gb", reserve=0)
    add_lora(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"trainable parameters: {trainable:,} of {sum(p.numel() for p in model.parameters()):,}")
    start = time.perf_counter()
    no_plan = autoplan.plan(model, "100%", example_inputs=inputs, device="a100-40gb", reserve=0)
    budget = (no_plan.prediction.minimum_peak_bytes + no_plan.prediction.baseline_peak_bytes) // 2
    plan = autoplan.plan(model, budget, example_inputs=inputs, device="a100-40gb", reserve=0)
    print(plan.report())
    print(f"planned twice in {time.perf_counter() - start:.1f} s")
    print(f"optimizer state: {format_bytes(plan.prediction.breakdown.optimizer)} with LoRA, "
          f"{format_bytes(full.prediction.breakdown.optimizer)} for full fine-tuning")
    print()

    autoplan.apply(model, plan)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(3):
        loss = model(idx, targets=idx).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
