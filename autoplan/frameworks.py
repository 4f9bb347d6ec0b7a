"""The training loops of accelerate and Lightning as `TrainingLoop`s, read from the objects a person already has.

`accelerate_loop(accelerator)` reads an `accelerate.Accelerator`: its gradient accumulation, its
mixed precision (fp16 brings a GradScaler; the precision to plan is `accelerate_precision`), and the
batch its prepared data loader reads ahead. `lightning_loop(trainer)` is Lightning's automatic
optimization: `training_step` (the outputs die with it, the loss is returned), then `zero_grad`,
then backward, so the last step's gradients are alive through the forward; its accumulation is
`trainer.accumulate_grad_batches`; `lightning_callback(budget)` plans `pl_module.model` with that loop on the
first batch, before its forward. (transformers' Trainer has its own: `autoplan.hf.optimize_for_trainer`; a Trainer
already built, such as trl's `SFTTrainer(model, peft_config=...)`, which makes its peft model itself: `optimize_trainer`.)

Both frameworks' data loaders read the next batch while the current one trains (accelerate's
`DataLoaderShard`, Lightning's prefetching fetcher), on the host: on a CPU target the host is the
device, so it counts there (`host_batches_ahead`). Neither library is imported here but by the callback: the
objects are read by their attributes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from autoplan.errors import OptionTypeError
from autoplan.hf import CHECKPOINTING_ARGUMENTS, TrainerPlan, optimize_for_trainer
from autoplan.inputs.hf_trainer import host_batches_ahead
from autoplan.inputs.loop import TrainingLoop

ACCELERATE_PRECISIONS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}


def accelerate_loop(accelerator: Any, *, keep_outputs: bool = True, device: Any = None) -> TrainingLoop:
    """The loop of `for batch in dataloader: with accelerator.accumulate(model): outputs = model(**batch);
    accelerator.backward(outputs.loss); optimizer.step(); optimizer.zero_grad()` under this `accelerator`.
    keep_outputs: False for `accelerator.backward(model(**batch).loss)`. device: the plan's (for the batch read ahead);
    default the accelerator's own device."""
    if not all(hasattr(accelerator, name) for name in ("gradient_accumulation_steps", "mixed_precision")):
        raise OptionTypeError(f"accelerate_loop takes an accelerate.Accelerator; got {type(accelerator).__name__}")
    accelerate_precision(accelerator)  # an unplannable precision is an error here, not after planning
    return TrainingLoop(keep_outputs=keep_outputs, accumulation_steps=int(accelerator.gradient_accumulation_steps),
                        grad_scaler=getattr(accelerator, "scaler", None) is not None,
                        batches_ahead=host_batches_ahead(device if device is not None else _accelerator_device(accelerator)))


def _accelerator_device(accelerator: Any) -> str:
    """Where the accelerator puts the batches: its device's type ("cpu" or "cuda")."""
    device = getattr(accelerator, "device", None)
    return "cpu" if device is None or getattr(device, "type", "cpu") == "cpu" else "cuda"


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


def optimize_trainer(trainer: Any, budget: str | int, **options: Any) -> TrainerPlan:
    """Plan a transformers Trainer (or trl's SFTTrainer) that is already built, rewrite `trainer.model` in place, and
    give the trainer the changed arguments: for `SFTTrainer(model, peft_config=...)`, which makes its peft model (and
    enables gradient checkpointing on it) itself. options: `optimize_for_trainer`'s (device, reserve, units, ...)."""
    if not all(hasattr(trainer, name) for name in ("model", "args", "train_dataset")):
        raise OptionTypeError(f"optimize_trainer takes a built transformers Trainer or trl SFTTrainer; got {type(trainer).__name__}")
    with _accelerate_state_kept():
        setup = optimize_for_trainer(trainer.model, trainer.args, budget, train_dataset=trainer.train_dataset,
                                     data_collator=getattr(trainer, "data_collator", None), **options)
    checkpointing_off = any(change.name in CHECKPOINTING_ARGUMENTS and not change.after for change in setup.changes)
    if checkpointing_off and getattr(trainer.model, "is_gradient_checkpointing", False):
        trainer.model.gradient_checkpointing_disable()  # the trainer turned it on when it was built; the plan decides now
    for change in setup.changes:  # on the trainer's own arguments: a new TrainingArguments would reset accelerate's state
        setattr(trainer.args, change.name, change.after)
    return setup


@contextlib.contextmanager
def _accelerate_state_kept() -> Iterator[None]:
    """accelerate's process-wide state as it was: the TrainingArguments optimize_for_trainer makes set up their devices,
    which resets that state under the built trainer's Accelerator (its next prepare() fails without it)."""
    from accelerate.state import AcceleratorState, PartialState

    kept = [(state, dict(state._shared_state)) for state in (AcceleratorState, PartialState)]
    try:
        yield
    finally:
        for state, shared in kept:  # the same dict every instance reads (accelerate's shared-state pattern)
            state._shared_state.clear()
            state._shared_state.update(shared)
