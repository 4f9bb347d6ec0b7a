"""Floors: the lowest peak autoplan reaches against checkpointing every block by hand.

For every structure of the test zoo (`tests/structures.py`: residual blocks in a ModuleList or
ModuleDict, stages of blocks, a VGG-style Sequential, a U-Net, a shared block, transformers
ResNet / ConvNext / Swin / Mixtral / Qwen2-MoE from tiny configs), measures on the CPU, with the
CPU allocator's count `autoplan.verify` uses (nothing of the simulation's), a real training step (AdamW, fp32) checkpointed by hand
(`torch.utils.checkpoint`, non-reentrant, around each block; `gradient_checkpointing_enable()`
where transformers has it); then plans at a budget of exactly that peak (no reserve) and
measures the planned step. Prints, per structure: autoplan's floor (`plan.prediction.minimum_peak_bytes`)
over the by-hand peak, the planned step's measured peak, and the FLOPs each recomputes
(FlopCounterMode, against the same step without checkpointing). The column "floor, no segments"
is the floor of `plan(..., segments=False)`: blocks only, no runs of them checkpointed as one.

    python benchmarks/floors.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402
from tests.handmade import compare_with_plan  # noqa: E402
from tests.structures import STRUCTURES  # noqa: E402


def kib(nbytes: int) -> str:
    return f"{nbytes / 1024:,.0f} KiB"


def floor_without_segments(structure, budget: int) -> int:
    model, inputs = structure.build()
    model.train()
    plan = autoplan.plan(model, budget, example_inputs=inputs, device="cpu", precision="fp32", reserve=0, segments=False)
    return plan.prediction.minimum_peak_bytes


def main() -> None:
    print(f"CPU, this machine: {describe_machine()}; the CPU allocator's count of training step 2, AdamW, fp32\n")
    print("| structure | by hand: peak | autoplan's floor | floor − by hand | floor / by hand | floor, no segments "
          "| autoplan at the by-hand peak: measured | recompute MFLOP by hand | recompute MFLOP autoplan |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for structure in STRUCTURES:
        try:
            row = compare_with_plan(structure, with_plain=True)
        except Exception as error:  # noqa: BLE001 - a structure that fails is a row that says so
            print(f"| {structure.name} | failed: {type(error).__name__}: {str(error).splitlines()[0][:120]} | | | | | | |", flush=True)
            continue
        hand_recompute = (row.by_hand.flops - row.plain.flops) / 1e6
        if row.planned is None:
            planned, recompute = "does not fit", "–"
        else:
            planned, recompute = kib(row.planned.peak_bytes), f"{(row.planned.flops - row.plain.flops) / 1e6:,.1f}"
        print(
            # the difference in bytes and the ratio to 4 digits: a floor 0.2% over must not print as 1.00
            f"| {structure.name} | {kib(row.by_hand.peak_bytes)} | {kib(row.floor_bytes)} "
            f"| {row.floor_bytes - row.by_hand.peak_bytes:+,} B | {row.floor_ratio:.4f}× "
            f"| {kib(floor_without_segments(structure, row.by_hand.peak_bytes))} | {planned} | {hand_recompute:,.1f} | {recompute} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
