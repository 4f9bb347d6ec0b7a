"""Plan a GPT-style model for this machine under a tight budget, rewrite it, and train a few steps.

    python examples/plan_gpt.py

Planning runs on fake tensors (no real memory) for the device the steps then run on: this machine's
GPU, else the CPU profile. `device="h100-80gb"` would plan for a card that is not here.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from examples.gpt import build  # noqa: E402


def main() -> None:
    model, (idx,) = build(n_layer=6, n_embd=128, n_head=4, block_size=128, vocab_size=512, batch_size=8, seq_len=128)
    model = model.to("cuda" if torch.cuda.is_available() else "cpu")
    idx = idx.to(next(model.parameters()).device)
    inputs = ((idx,), {"targets": idx})  # the model computes its own cross-entropy loss
    no_plan = autoplan.plan(model, "1GB", example_inputs=inputs, reserve=0)
    # ask for the midpoint between "no plan" and "everything checkpointed", in MB: a real trade-off
    budget = f"{math.ceil((no_plan.prediction.minimum_peak_bytes + no_plan.prediction.baseline_peak_bytes) / 2 / 1e6)}MB"
    plan = autoplan.plan(model, budget, example_inputs=inputs, reserve=0)
    print(plan.report())

    autoplan.apply(model, plan)  # same model object, units wrapped in place
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for step in range(3):
        loss = model(idx, targets=idx).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
