"""The training loops of accelerate and Lightning as `TrainingLoop`s, read from the objects a person already has.

`accelerate_loop(accelerator)` reads an `accelerate.Accelerator`: its gradient accumulation, its
mixed precision (fp16 brings a GradScaler; the precision to plan is `accelerate_precision`), and the
batch its prepared data loader reads ahead. `lightning_loop(trainer)` is Lightning's automatic
optimization: `training_step` (the outputs die with it, the loss is returned), then `zero_grad`,
then backward, so the last step's gradients are alive through the forward; its accumulation is
`trainer.accumulate_grad_batches`; `lightning_callback(budget)` plans `pl_module.model` with that loop on the
first batch, before its forward. (transformers' Trainer has its own: `autoplan.hf.optimize_for_trainer`.)

Both frameworks' data loaders read the next batch while the current one trains (accelerate's
`DataLoaderShard`, Lightning's prefetching fetcher), on the host: on a CPU target the host is the
device, so it counts there (`host_batches_ahead`). Neither library is imported here but by the callback: the
objects are read by their attributes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

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


def lightning_callback(budget: str | int, *, module: str = "model", inputs: Callable[[Any], Any] | None = None,
                       **options: Any) -> Any:
    """A Lightning `Callback` that plans `pl_module.<module>` for `budget` on the first training batch, before its
    forward, in Lightning's loop (`lightning_loop(trainer)`), and applies the plan; `callback.plan` holds it.

    inputs: what the module is called with, from the batch as Lightning hands it to `training_step` (default: the
    batch itself, a dict as keyword arguments). options: `autoplan.plan`'s (device, precision, loss_fn, ...).
    """
    from lightning.pytorch.callbacks import Callback

    from autoplan import api

    class AutoplanCallback(Callback):
        plan = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if self.plan is not None:
                return
            planned = getattr(pl_module, module, None)
            if not isinstance(planned, torch.nn.Module):
                raise OptionTypeError(f"lightning_callback plans pl_module.{module}, and {type(pl_module).__name__} has no "
                                      f"module there: pass module= the attribute that holds the model training_step calls")
            loop = lightning_loop(trainer, device=options.get("device"))
            self.plan = api.plan(planned, budget, example_inputs=inputs(batch) if inputs else batch, loop=loop, **options)
            api.apply(planned, self.plan)

    return AutoplanCallback()
