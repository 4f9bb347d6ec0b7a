"""Predicted vs measured peak per model × training loop, on this machine's CPU.

For every Hugging Face family of `tests/families.py` (tiny configs, random weights, batch 4 × 64)
and every model of the plain-PyTorch zoo `tests/models.py`, plans each training loop below (the
families at static memory + 50% of their no-plan activations in that loop, the zoo halfway between
its no-plan and its lowest peak), rewrites the model, trains two real steps of that loop
(`autoplan.verify`: the CPU allocator's count of real steps, the peak from the second) and prints the markdown
table that docs/loops.md shows. Error = (measured − predicted) / predicted: never above 0, at most 3% below
is the claim the tests (`tests/inputs/test_loop.py`) assert.

    python benchmarks/loops.py            # everything (a few minutes on 2 cores)
    python benchmarks/loops.py Llama T5   # some models
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402
from autoplan import TrainingLoop  # noqa: E402
from tests import families  # noqa: E402
from tests.models import ALL_MODELS  # noqa: E402

SHAPES = {"outputs kept": TrainingLoop(), "outputs dropped": TrainingLoop(keep_outputs=False)}  # every model
ACCUMULATION = {  # the models of tests/inputs/test_loop.py's accumulation tests, and GPT-2 and T5
    "accumulate 2": TrainingLoop(accumulation_steps=2),
    "accumulate 4, outputs dropped": TrainingLoop(accumulation_steps=4, keep_outputs=False),
}
ACCUMULATION_MODELS = ("GPT-2", "Llama", "T5", "tiny_gpt", "small_resnet", "skipnet")
OTHERS = {  # the optimizer implementation, GradScaler and zero_grad(set_to_none=False)
    "foreach AdamW + GradScaler": TrainingLoop(optimizer_impl="foreach", grad_scaler=True),
    "fused AdamW + zero_grad(set_to_none=False)": TrainingLoop(optimizer_impl="fused", zero_grad_set_to_none=False),
}
OTHER_MODELS = ("Llama", "tiny_gpt")
ZOO_REPEAT = {"flat": 64, "mlp": 64}  # batch multiplier: activations must matter for these


def family_case(name: str, loop: TrainingLoop):
    family = families.BY_NAME[name]
    model = family.build()
    budget = families.half_activation_budget(family, loop=loop)
    plan = autoplan.plan(model, budget, batch_size=families.BATCH, seq_len=families.SEQ, device="cpu",
                         precision="fp32", reserve=0, loop=loop)
    return model, family.inputs(model), plan


def zoo_case(name: str, loop: TrainingLoop):
    model, inputs = ALL_MODELS[name]()
    repeat = ZOO_REPEAT.get(name, 4)
    inputs = tuple(t.repeat(repeat, *[1] * (t.dim() - 1)) for t in inputs)
    options = dict(example_inputs=inputs, device="cpu", precision="fp32", reserve=0, loop=loop)
    free = autoplan.plan(model, "4GB", **options)
    plan = autoplan.plan(model, (free.prediction.baseline_peak_bytes + free.prediction.minimum_peak_bytes) // 2, **options)
    return model, inputs, plan


def row(model_name: str, loop_name: str, case) -> tuple[str, float]:
    model, inputs, plan = case
    result = autoplan.verify(model, plan, example_inputs=inputs, steps=2)
    modes = " ".join(u.choice.mode for u in plan.decisions.units)
    error = result.peak_error
    line = (f"| {model_name} | {loop_name} | {plan.prediction.peak_bytes:,} | {plan.prediction.simulated_peak_bytes:,} | "
            f"{result.measured_peak_bytes:,} | {100 * error:+.2f}% | {'yes' if result.held else 'NO'} | {modes} |")
    return line, error


def loops_for(name: str) -> dict[str, TrainingLoop]:
    return {**SHAPES, **(ACCUMULATION if name in ACCUMULATION_MODELS else {}), **(OTHERS if name in OTHER_MODELS else {})}


def main(names: list[str]) -> None:
    hf = [f.name for f in families.FAMILIES]
    chosen = names or hf + sorted(ALL_MODELS)
    print(f"<!-- python benchmarks/loops.py · {describe_machine(libraries=('transformers',))} -->")
    print("| model | loop | predicted peak (B) | simulated (B) | measured (B) | error | within the usable budget | modes |")
    print("|---|---|---|---|---|---|---|---|")
    errors = []
    started = time.perf_counter()
    for name in chosen:
        for loop_name, loop in loops_for(name).items():
            case = family_case(name, loop) if name in hf else zoo_case(name, loop)
            line, error = row(name, loop_name, case)
            errors.append(error)
            print(line, flush=True)
    print(f"\n{len(errors)} runs; error from {100 * min(errors):+.2f}% to {100 * max(errors):+.2f}%; "
          f"{sum(e > 0 for e in errors)} above the prediction, {sum(e < -0.03 for e in errors)} more than 3% below; "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
