"""The batch a training step is planned with: the caller's example inputs, normalised to (args, kwargs),
or one built from a Hugging Face model's config."""

from __future__ import annotations

from typing import Any

import torch

from autoplan.errors import OptionError, OptionTypeError
from autoplan.inputs.hf_models import default_seq_len, example_inputs_for, is_hf_model, training_inputs


def training_batch(model: torch.nn.Module, example_inputs: Any, batch_size: int | None, seq_len: int | None):
    """The (args, kwargs) a training step is profiled with: the caller's, or one built for a HF model."""
    if example_inputs is None:
        if not is_hf_model(model):
            raise OptionError(
                f"example_inputs is required for {type(model).__name__}: pass one batch, e.g. "
                "example_inputs=(x,) or example_inputs={'input_ids': ids}. batch_size= and seq_len= "
                "build a batch only for Hugging Face transformers models."
            )
        size = 1 if batch_size is None else batch_size
        length = default_seq_len(model) if seq_len is None else seq_len
        example_inputs = example_inputs_for(model, size, length)
    elif batch_size is not None or seq_len is not None:
        raise OptionError(
            "batch_size= and seq_len= build example inputs when example_inputs is omitted; "
            "pass either them or example_inputs, not both"
        )
    batch = training_inputs(model, normalize_inputs(example_inputs))
    _refuse_empty(batch)
    return batch


def _refuse_empty(batch: tuple[tuple, dict]) -> None:
    """A batch of 0 examples trains nothing, and a plan for it would fit anything: refused."""
    args, kwargs = batch
    named = [(f"argument {i}", value) for i, value in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 0:
            raise OptionError(f"the batch is empty: {name} has shape {tuple(value.shape)}, 0 examples; plan with "
                              "at least one example (the batch you will train with)")


def normalize_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Accept a tuple of positional args, a dict of kwargs, a pair (args, kwargs), or one tensor."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if (
        isinstance(example_inputs, (tuple, list))
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], (tuple, list))
        and isinstance(example_inputs[1], dict)
    ):
        return tuple(example_inputs[0]), dict(example_inputs[1])
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise OptionTypeError(
        "example_inputs must be a tuple of positional arguments, a dict of keyword arguments, "
        f"or a pair (args, kwargs); got {type(example_inputs).__name__}"
    )
