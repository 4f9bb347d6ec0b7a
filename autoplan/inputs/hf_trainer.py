"""The transformers Trainer's training step as autoplan plans it: its loop, and the micro-batch as it calls the model.

`trainer_loop` is the Trainer's loop as a `TrainingLoop` (every micro-batch of a step fetched before its first
forward, its device scalars, its own autocast); `with_token_count` adds the `num_items_in_batch` the Trainer passes
to a model that takes loss keywords. `autoplan.hf.optimize_for_trainer` plans with both.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from autoplan.inputs.devices import get_device
from autoplan.inputs.loop import TrainingLoop
from autoplan.vocabulary.tensors import ALLOCATION_GRANULE

TRAINER_SCALARS = 3  # the Trainer's device scalars beside the model: _tr_loss, grad_norm, and the last micro-batch's loss (tr_loss_step, reassigned only after the next backward); num_items_in_batch is in the planned batch


def trainer_loop(micro_batches: int, optimizer_impl: str, precision: str, labelled: bool, device: Any = None) -> TrainingLoop:
    """The Trainer's training step as a TrainingLoop: the loss from the model's labels, its outputs dropped, every
    micro-batch of an optimizer step fetched before its first forward (get_batch_samples), and the Trainer's device
    scalars (TRAINER_SCALARS) beside the model; with bf16/fp16 the Trainer's own autocast around the forward and the
    loss (so "no plan" is the model as the Trainer runs it, not in fp32). accelerate's data loader reads one batch
    ahead on the host: on a CPU target that is the device's memory too."""
    return TrainingLoop(keep_outputs=False, accumulation_steps=micro_batches, optimizer_impl=optimizer_impl,
                        grad_scaler=precision == "fp16", loss_in_model=True if labelled else None, fetches_whole_step=True,
                        batches_ahead=host_batches_ahead(device), kept_on_device_bytes=TRAINER_SCALARS * ALLOCATION_GRANULE,
                        outer_autocast=precision if precision != "fp32" else None)


def with_token_count(model: torch.nn.Module, inputs: dict[str, Any], micro_batches: int) -> dict[str, Any]:
    """The micro-batch as the Trainer calls the model: with `num_items_in_batch`, the step's count of predicted tokens,
    where the model takes loss keywords (the loss is then a sum divided by it, which holds more than a mean)."""
    labels = inputs.get("labels")
    if not isinstance(labels, torch.Tensor) or not accepts_loss_keywords(model):
        return inputs
    counted = torch.count_nonzero(labels[..., 1:] != -100)
    return {**inputs, "num_items_in_batch": counted * micro_batches}


def accepts_loss_keywords(model: torch.nn.Module) -> bool:
    """The Trainer's test (model_accepts_loss_kwargs): the model says so, or its forward takes **kwargs."""
    unwrap = getattr(model, "get_base_model", None)  # a peft model: what it wraps
    inner = unwrap() if callable(unwrap) else model
    said = getattr(inner, "accepts_loss_kwargs", None)
    if said is not None:
        return bool(said)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(inner.forward).parameters.values())


def host_batches_ahead(device: Any = None) -> int:
    """Batches a data loader reads ahead on the host that the plan's device holds: 1 on a CPU target, else 0."""
    return 1 if get_device(device).kind == "cpu" else 0
