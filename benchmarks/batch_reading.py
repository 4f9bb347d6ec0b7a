"""Forwards that read the batch, or decide on random draws: autoplan against checkpointing every block by hand.

For each model of `tests/batch_reading.py` (an image-grid tower, a label check with a loss over labelled
positions, packed sequences split by `cu_seqlens`, LayerDrop both ways; tiny Qwen2-VL, LLaVA,
Wav2Vec2-CTC and HuBERT-CTC), measures on the CPU, with the CPU allocator's count `autoplan.verify`
uses, a real training step (AdamW, fp32, outputs alive through backward) checkpointed by hand
(`torch.utils.checkpoint` around each block, or transformers' `gradient_checkpointing_enable()`);
then plans at a budget of exactly that peak (no reserve), and measures the planned step. Prints the
floor (`plan.prediction.minimum_peak_bytes`) over the by-hand peak, the planned step's predicted and measured
peaks, the FLOPs each recomputes, and what the plan read from the batch.

LayerDrop skips layers at random in a real step, so its by-hand peak and the planned step are
measured with every layer running (p = 0, the same weights): the worst case the plan is for.

    python benchmarks/batch_reading.py
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402
from tests.batch_reading import FAMILIES, GENERATED  # noqa: E402
from tests.handmade import checkpoint_by_hand, measured_step  # noqa: E402


def every_layer_running(model: torch.nn.Module) -> torch.nn.Module:
    """The model with its random skips turned off (LayerDrop's p = 0): the worst case."""
    twin = copy.deepcopy(model)
    if hasattr(twin, "p"):
        twin.p = 0.0
    return twin


def row(structure) -> str:
    torch.manual_seed(0)
    np.random.seed(0)
    model, inputs = structure.build()
    model.train()
    plain = measured_step(every_layer_running(model), inputs)
    by_hand = measured_step(checkpoint_by_hand(every_layer_running(model), structure), inputs)
    plan = autoplan.plan(model, budget=by_hand.peak_bytes, example_inputs=inputs, device="cpu", precision="fp32", reserve=0)
    read = " + ".join(filter(None, (", ".join(plan.model.batch_values), "random draws" if plan.model.random_control_flow else "")))
    if not plan.outcome.feasible:
        return f"| {structure.name} | {by_hand.peak_bytes:,} | {plan.prediction.minimum_peak_bytes:,} | does not fit | | | | | {read} |"
    planned = measured_step(autoplan.apply(every_layer_running(model), plan), inputs)
    error = (plan.prediction.peak_bytes - planned.peak_bytes) / planned.peak_bytes
    return (f"| {structure.name} | {by_hand.peak_bytes:,} | {plan.prediction.minimum_peak_bytes:,} "
            f"| {plan.prediction.minimum_peak_bytes / by_hand.peak_bytes:.4f}× | {plan.prediction.peak_bytes:,} | {planned.peak_bytes:,} "
            f"| {error:+.3%} | {(by_hand.flops - plain.flops) / 1e6:,.1f} | {(planned.flops - plain.flops) / 1e6:,.1f} | {read or '–'} |")


def main() -> None:
    print(f"CPU, this machine: {describe_machine()}; the CPU allocator's count of training step 2, AdamW, fp32, outputs alive through backward\n")
    print("| model | by hand: peak (B) | autoplan's floor (B) | floor / by hand | planned at the by-hand peak: predicted (B) "
          "| measured (B) | predicted − measured | recompute MFLOP by hand | recompute MFLOP autoplan | read from the batch |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    start = time.perf_counter()
    for structure in (*GENERATED, *FAMILIES):
        try:
            print(row(structure), flush=True)
        except Exception as error:  # noqa: BLE001 - a model that fails is a row that says so
            print(f"| {structure.name} | failed: {type(error).__name__}: {str(error).splitlines()[0][:160]} | | | | | | | | |", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
