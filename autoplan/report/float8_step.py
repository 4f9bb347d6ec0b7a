"""The advice's float8 rung: torchao's float8 linears on a card with float8 tensor cores (`axes.precisions.float8`).

On such a card its matmuls run at twice bf16's rate, and its casts (an absolute maximum, a scale and a cast per
operand) are memory traffic that torch.compile fuses: eager float8 is slower than bf16 on all but large matmuls, so
the rung is priced from the units' float8 options as the profile measured them (compiled where the plan was).
"""

from __future__ import annotations

from autoplan.axes.precisions.float8 import is_float8
from autoplan.memory.model import predict_peak, predict_step_time
from autoplan.plan import Plan
from autoplan.profile.profiler import Profile
from autoplan.report.batch_steps import Step
from autoplan.vocabulary.formatting import format_bytes, format_seconds

KEY, TITLE = "float8", "float8 linears (torchao)"
CODE = 'autoplan.optimize(model, budget, example_inputs=batch, precision="auto-float8", compile=True)  # then torch.compile'


def float8_step(plan: Plan, profile: Profile, lowered: dict | None, float8: dict | None) -> Step:
    """`lowered`, `float8`: every unit kept in the plan's low precision, and in float8 (None: not profiled so)."""
    device = profile.device
    if "float8" not in device.peak_flops:
        return Step(KEY, TITLE, "n/a", f"{device.name} has no float8 tensor cores (H100, H200, L40S, RTX 4090 and L4 have)")
    chosen = plan.decisions.unit_choices()
    used = sum(1 for choice in chosen.values() if is_float8(choice.precision))
    low = plan.target.low_precision
    if float8 is None or lowered is None:
        return Step(KEY, TITLE, "try", f"not measured: plan with --precision auto-float8 --compile to price each unit's "
                    f"linears in float8 against {low} ({device.name} rates float8 at "
                    f"{device.peak_flops['float8'] / 1e12:.0f} TFLOP/s, {low} at {device.peak_flops[low] / 1e12:.0f})",
                    None, None, CODE)
    saves = predict_peak(profile, lowered).bytes - predict_peak(profile, float8).bytes
    change = predict_step_time(profile, float8) - predict_step_time(profile, lowered)
    pace = f"{format_seconds(abs(change))} {'faster' if change <= 0 else 'slower'}"
    height = f"{format_bytes(abs(saves))} {'lower' if saves >= 0 else 'higher'}"
    compiled = "compiled" if plan.prediction.time_source.startswith("roofline, compiled") else "eager (plan with --compile: fused casts)"
    detail = (f"every unit's linears in float8 (no checkpointing) peak {height} than every unit in {low}, and the step is "
              f"{pace}, {compiled}; the plan runs {used} of {len(chosen)} units' linears in float8")
    return Step(KEY, TITLE, "chosen" if used else "try" if change < 0 else "n/a", detail, saves, change, CODE)

