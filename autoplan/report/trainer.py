"""The transformers Trainer callback: the plan when training starts, the measured peak after it warms up.

    trainer = Trainer(model=model, args=args, callbacks=[autoplan.hf.AutoplanCallback(plan)])

At `on_train_begin` it writes the plan's report. On CUDA it then measures the peak of one steady
optimizer step (`measure_step`, default 2: step 1 also creates the optimizer state) with
`torch.cuda.max_memory_allocated()` and writes it next to the prediction; on the CPU it measures
nothing (the CPU has no allocator statistics to read). Only the main process writes. The class
subclasses transformers' `TrainerCallback`, so it is made on first use (`callback_class()`):
transformers stays an optional extra.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from autoplan.errors import OptionError
from autoplan.inputs.hf_models import require_transformers
from autoplan.plan import Plan
from autoplan.report.text import format_report
from autoplan.vocabulary.formatting import format_bytes, format_signed_percent

MEASURE_STEP = 2  # the first optimizer step whose peak is the steady state's


def measured_peak_line(plan: Plan, measured_bytes: int, step: int) -> str:
    """One line: the measured peak of a real step against the plan's prediction and usable budget."""
    error = measured_bytes / plan.prediction.peak_bytes - 1 if plan.prediction.peak_bytes else 0.0
    verdict = "within the usable budget" if measured_bytes <= plan.request.usable_bytes else "OVER the usable budget"
    return (f"autoplan: step {step} peaked at {format_bytes(measured_bytes)} (torch.cuda.max_memory_allocated); "
            f"predicted {format_bytes(plan.prediction.peak_bytes)} ({format_signed_percent(error)}), {verdict} of "
            f"{format_bytes(plan.request.usable_bytes)}")


def _on_cuda(args: Any) -> bool:
    device = getattr(args, "device", None)
    return torch.cuda.is_available() and isinstance(device, torch.device) and device.type == "cuda"


@functools.cache
def callback_class() -> type:
    """`AutoplanCallback`, a transformers.TrainerCallback (imports transformers)."""
    transformers = require_transformers()
    trainer_callback: Any = transformers.TrainerCallback  # transformers' types are not followed (pyproject's mypy section)

    class AutoplanCallback(trainer_callback):
        """Writes the plan when training starts and, on CUDA, the measured peak of step `measure_step`.

        write: where lines go (print by default; a logger's info, a list's append).
        measured_peak_bytes: what step `measure_step` peaked at, once measured (None on the CPU).
        """

        def __init__(self, plan: Plan, *, measure_step: int = MEASURE_STEP, write: Callable[[str], Any] = print) -> None:
            if measure_step < 1:
                raise OptionError(f"measure_step counts optimizer steps from 1; got {measure_step}")
            self.plan, self.measure_step, self.write = plan, measure_step, write
            self.measured_peak_bytes: int | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.write(format_report(self.plan, with_code=False).rstrip())  # already applied

        def on_step_begin(self, args, state, control, **kwargs):
            # global_step counts finished optimizer steps: step k begins at k - 1
            if _on_cuda(args) and state.global_step == self.measure_step - 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, args, state, control, **kwargs):
            if _on_cuda(args) and state.global_step == self.measure_step:
                torch.cuda.synchronize()
                self.measured_peak_bytes = torch.cuda.max_memory_allocated()
                if state.is_world_process_zero:
                    self.write(measured_peak_line(self.plan, self.measured_peak_bytes, self.measure_step))

    return AutoplanCallback
