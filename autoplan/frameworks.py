"""The training loops of accelerate and Lightning as `TrainingLoop`s, read from the objects a person already has.

`accelerate_loop(accelerator)` reads an `accelerate.Accelerator`: its gradient accumulation, its
mixed precision (fp16 brings a GradScaler; the precision to plan is `accelerate_precision`), and the
batch its prepared data loader reads ahead. `lightning_loop(trainer)` is Lightning's automatic
optimization: `training_step` (the outputs die with it, the loss is returned), then `zero_grad`,
then backward, so the last step's gradients are alive through the forward; its accumulation is
`trainer.accumulate_grad_batches`. (transformers' Trainer has its own: `autoplan.hf.optimize_for_trainer`.)

Both frameworks' data loaders read the next batch while the current one trains (accelerate's
`DataLoaderShard`, Lightning's prefetching fetcher), on the host: on a CPU target the host is the
device, so it counts there (`host_batches_ahead`). Neither library is imported here: the objects
are read by their attributes.
"""

from __future__ import annotations

from typing import Any

from autoplan.errors import OptionTypeError
from autoplan.inputs.devices import get_device
from autoplan.inputs.loop import TrainingLoop

ACCELERATE_PRECISIONS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}


def host_batches_ahead(device: Any = None) -> int:
    """Batches a data loader reads ahead on the host that the plan's device holds: 1 on a CPU target, else 0."""
    return 1 if get_device(device).kind == "cpu" else 0


def accelerate_loop(accelerator: Any, *, keep_outputs: bool = True, device: Any = None) -> TrainingLoop:
    """The loop of `for batch in dataloader: with accelerator.accumulate(model): outputs = model(**batch);
    accelerator.backward(outputs.loss); optimizer.step(); optimizer.zero_grad()` under this `accelerator`.
    keep_outputs: False for `accelerator.backward(model(**batch).loss)`. device: the plan's (for the batch read ahead)."""
    if not all(hasattr(accelerator, name) for name in ("gradient_accumulation_steps", "mixed_precision")):
        raise OptionTypeError(f"accelerate_loop takes an accelerate.Accelerator; got {type(accelerator).__name__}")
    accelerate_precision(accelerator)  # an unplannable precision is an error here, not after planning
    return TrainingLoop(keep_outputs=keep_outputs, accumulation_steps=int(accelerator.gradient_accumulation_steps),
                        grad_scaler=getattr(accelerator, "scaler", None) is not None,
                        batches_ahead=host_batches_ahead(device))


def accelerate_precision(accelerator: Any) -> str:
    """The precision to plan for the accelerator's mixed_precision: "fp32", "fp16" or "bf16"."""
    mixed = str(accelerator.mixed_precision)
    if mixed not in ACCELERATE_PRECISIONS:
        raise OptionTypeError(f"accelerate's mixed_precision={mixed!r} is not planned; autoplan plans "
                              f"{sorted(ACCELERATE_PRECISIONS)} (fp8 is not one of its precisions yet)")
    return ACCELERATE_PRECISIONS[mixed]


def lightning_loop(trainer: Any = None, *, device: Any = None) -> TrainingLoop:
    """Lightning's automatic optimization: training_step returns the loss, then zero_grad, then backward, then the
    step; `trainer.accumulate_grad_batches` micro-batches per step (None: 1)."""
    accumulation = 1 if trainer is None else getattr(trainer, "accumulate_grad_batches", None)
    if not isinstance(accumulation, int):
        raise OptionTypeError(f"lightning_loop takes a lightning.Trainer (or None); got {type(trainer).__name__}")
    return TrainingLoop(keep_outputs=False, accumulation_steps=accumulation, zero_grad_before_backward=True,
                        batches_ahead=host_batches_ahead(device))
