"""The training loops of six frameworks (eight cases), planned by autoplan and counted by the CPU allocator on real runs.

The cases are `tests/framework_loops/`'s: transformers' `Trainer` (a Qwen2, 2 micro-batches per step),
trl's `SFTTrainer` on a 4-bit NF4 Llama with LoRA (bf16, as trl's SFTConfig sets it), a loop by hand
under accelerate's `Accelerator` (a GPT-2, 2 micro-batches), nanoGPT's train.py loop,
`lightning.Trainer` on a wrapped Llama, and the step of diffusers' train_text_to_image.py (a UNet beside
a frozen VAE and text encoder, with an EMA copy); and two more Trainers, as issue 37 named them: trl's
`SFTTrainer` on a 4-bit Qwen2 + LoRA with `optim="adamw_bnb_8bit"` and 2 micro-batches, and the Trainer on
a Qwen2-VL with an image-text collator. Tiny models with random weights from configs, nothing downloaded,
on the CPU, in fp32 but for the QLoRA cases.

Each is planned at the budget halfway between its lowest peak and its peak with no plan, with the
`TrainingLoop` its case describes (the two Trainers through `autoplan.hf.optimize_for_trainer`,
which describes the Trainer's loop itself), rewritten by `autoplan.apply`, and trained for 4 optimizer
steps by the framework's own loop, counted by the CPU allocator's own reports
(`autoplan/verify/allocator.py`): the measured peak is the highest of steps 2-4 (step 1 makes the
optimizer's state). The same loop on the model without a plan gives the loss difference and the
peak without a plan. The planning and the counting are `tests/framework_loops/measure.py`'s, which
`tests/end_to_end/test_framework_loops.py` asserts on.

    python benchmarks/framework_loops.py                  # every case (a few minutes on 2 cores)
    python benchmarks/framework_loops.py nanogpt lightning
    python benchmarks/framework_loops.py --base           # planned with TrainingLoop's first six fields only
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import describe_machine  # noqa: E402
from tests.framework_loops import CASES, STEPS, build  # noqa: E402
from tests.framework_loops.measure import counted, hushed, planned  # noqa: E402

LIBRARIES = ("transformers", "accelerate", "trl", "peft", "bitsandbytes", "lightning", "diffusers")


def row(name: str, base: bool) -> tuple[str, str]:
    """The table's row for case `name`, and the line that says which loop was planned."""
    started = time.perf_counter()
    with hushed():
        case = build(name)
    decided = planned(case, base)
    run = counted(case, case.model, **decided.run_options)
    with hushed():
        unplanned = build(name)
    free = counted(unplanned, unplanned.model)
    seconds = time.perf_counter() - started
    predicted = decided.plan.prediction.peak_bytes
    drift = max(abs(a - b) for a, b in zip(run.losses, free.losses))
    modes = " ".join(unit.choice.mode for unit in decided.plan.decisions.units)
    unseen = f" ({run.unreported_frees} unreported frees)" if run.unreported_frees else ""
    error = (run.peak_bytes - predicted) / predicted
    line = (f"| {name} | {predicted:,} | {run.peak_bytes:,}{unseen} | {error:+.2%} | "
            f"{'yes' if run.peak_bytes <= predicted else 'NO'} | {drift:.1e} | {free.peak_bytes:,} | {modes} | "
            f"{seconds:.0f} |")
    return line, "; ".join([f"- {name}: {decided.loop.describe()}", *case.notes])


def quiet() -> None:
    """Lightning's and transformers' notices and warnings: the table is the output."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for logger in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers", "diffusers", "accelerate"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()


def main(argv: list[str]) -> None:
    base = "--base" in argv
    names = [arg for arg in argv if not arg.startswith("--")] or list(CASES)
    quiet()
    fields = "TrainingLoop's first six fields" if base else "every TrainingLoop field the case describes"
    print(f"<!-- python benchmarks/framework_loops.py{' --base' if base else ''} · "
          f"{describe_machine(libraries=LIBRARIES)} -->")
    print(f"CPU, fp32, halfway budgets, planned with {fields}; the CPU allocator's count "
          f"(autoplan/verify/allocator.py), 512 B blocks, peak of steps 2-{STEPS}\n")
    print("| loop | predicted peak (B) | measured peak (B) | error % | held (measured <= predicted) | max loss diff | "
          "no plan, measured (B) | modes | s |")
    print("|---|---:|---:|---:|---|---:|---:|---|---:|")
    loops, started = [], time.perf_counter()
    for name in names:
        try:
            line, loop = row(name, base)
        except Exception as error:  # one framework that cannot run here leaves the others' rows
            said = (str(error).splitlines() or [""])[0][:200]
            line, loop = f"| {name} | failed: {type(error).__name__}: {said} |", f"- {name}: not planned"
        print(line, flush=True)
        loops.append(loop)
    print(f"\nPlanned loops ({time.perf_counter() - started:.0f} s in all):")
    print("\n".join(loops))


if __name__ == "__main__":
    main(sys.argv[1:])
