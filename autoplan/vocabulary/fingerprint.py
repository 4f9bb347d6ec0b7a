"""A plan's fingerprint: the model's parameters and the example batch it was made for, by shape and dtype.

A plan's bytes and times hold for those shapes only: `Net(d=64)`'s plan on `Net(d=256)` has the same
unit names but four times the bytes per parameter. `apply` checks the parameters (`check_model`);
`verify`, which compares a real step with the plan's peak, checks the batch too (`check_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import SequenceKey, keystr, tree_flatten_with_path

from autoplan.errors import PlanMismatchError

REPLAN = "plan again for this model (autoplan.plan)"


@dataclass(frozen=True)
class Fingerprint:
    """The model and the batch a plan was made for, by shape and dtype: what `apply` and `verify` check.

    Each entry is a name and its tensor in words, ("blocks.0.fc.weight", "256×256 float32"): every parameter
    by its qualified name (tied weights once), every tensor of the example batch by where it is passed
    ("argument 0", "input_ids"). Devices are left out: a plan made on meta applies to the model with weights.
    """

    parameters: tuple[tuple[str, str], ...]
    batch: tuple[tuple[str, str], ...]
    values: tuple[tuple[str, str], ...] = ()  # batch inputs whose values the forward read (an image grid), with those values

    def to_dict(self) -> dict[str, dict[str, str]]:
        return {"parameters": dict(self.parameters), "batch": dict(self.batch), "values": dict(self.values)}


def describe_tensor(tensor: torch.Tensor) -> str:
    """A tensor in words: "256×256 float32", "scalar int64"."""
    shape = "×".join(str(size) for size in tensor.shape) or "scalar"
    return f"{shape} {str(tensor.dtype).removeprefix('torch.')}"


def parameter_shapes(model: torch.nn.Module) -> tuple[tuple[str, str], ...]:
    return tuple((name, describe_tensor(parameter)) for name, parameter in model.named_parameters())


def batch_shapes(batch: tuple[tuple, dict]) -> tuple[tuple[str, str], ...]:
    """Each tensor of an (args, kwargs) batch by where it is passed: "argument 0", "input_ids", "inputs['mask']"."""
    leaves, _ = tree_flatten_with_path(batch)
    return tuple((_where(path), describe_tensor(leaf)) for path, leaf in leaves if isinstance(leaf, torch.Tensor))


def input_names(leaves: list[tuple[tuple[Any, ...], Any]]) -> list[str]:
    """The names `batch_shapes` gives the leaves of an (args, kwargs) batch flattened with their paths."""
    return [_where(path) for path, _ in leaves]


def _where(path: tuple[Any, ...]) -> str:
    positional, first, rest = path[0] == SequenceKey(0), path[1], path[2:]
    head = f"argument {first.idx}" if positional else str(getattr(first, "key", first))
    return head + keystr(rest)


def fingerprint_of(model: torch.nn.Module, batch: tuple[tuple, dict]) -> Fingerprint:
    """By shape; the values the forward read are added once planning knows them (`batch_values`)."""
    return Fingerprint(parameter_shapes(model), batch_shapes(batch))


SIZES_LIMIT = 64  # elements: a read input this small holds sizes (an image grid, sequence lengths), checked by value


def batch_values(batch: tuple[tuple, dict], names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """The values of the batch's tensors named `names` that hold sizes (at most SIZES_LIMIT elements), in words.

    Those are what a plan's shapes were simulated with (image grids, lengths); larger inputs the
    forward read (token ids, masks, labels) decide counts a batch of the same shape rarely changes,
    and are named in the plan's notes instead of being checked.
    """
    if not names:
        return ()
    leaves, _ = tree_flatten_with_path(batch)
    tensors = {_where(path): leaf for path, leaf in leaves if isinstance(leaf, torch.Tensor)}
    return tuple((name, str(tensors[name].tolist())) for name in names
                 if name in tensors and tensors[name].numel() <= SIZES_LIMIT and tensors[name].device.type != "meta")


def check_model(fingerprint: Fingerprint | None, model: torch.nn.Module) -> None:
    """Raise PlanMismatchError naming the first parameter that differs from the plan's; None checks nothing."""
    if fingerprint is None:
        return
    difference = first_difference(dict(fingerprint.parameters), dict(parameter_shapes(model)), "parameter")
    if difference:
        raise PlanMismatchError(
            f"this plan was made for another {type(model).__name__}: {difference}. Its bytes and times are for the "
            f"model it was made for: {REPLAN}, or pass check=False to apply it anyway"
        )


def check_batch(fingerprint: Fingerprint | None, batch: tuple[tuple, dict]) -> None:
    """Raise PlanMismatchError when `batch` is not the batch the plan's peak was predicted for."""
    if fingerprint is None or not fingerprint.batch:
        return
    here = batch_shapes(batch)
    difference = first_difference(dict(fingerprint.batch), dict(here), "input")
    if difference:
        planned = ", ".join(f"{name} {shape}" for name, shape in fingerprint.batch)
        raise PlanMismatchError(
            f"the plan's peak is for a batch of {planned}; this batch differs: {difference}. Verify with the batch "
            "the plan was made for, or plan for this batch (autoplan.plan(..., example_inputs=...))"
        )
    values = batch_values(batch, tuple(name for name, _ in fingerprint.values))
    difference = first_difference(dict(fingerprint.values), dict(values), "value of")
    if difference:
        raise PlanMismatchError(
            f"the model's forward reads values of {', '.join(name for name, _ in fingerprint.values)}, and the plan's "
            f"peak is for the values it was made with; this batch differs: {difference}. Verify with that batch, or plan "
            "for this one (autoplan.plan(..., example_inputs=...))"
        )


def first_difference(planned: dict[str, str], here: dict[str, str], what: str, source: str = "the plan") -> str:
    """The first name whose shape differs, in words, and how many more do; "" when none. `source`: what
    `planned` describes ("the plan", or "the profile" of a Planner)."""
    differences = [
        f"{what} {name} is {here[name]} here, {shape} in {source}" if name in here
        else f"{what} {name} of {source} is missing here"
        for name, shape in planned.items() if here.get(name) != shape
    ] + [f"{what} {name} ({shape}) is not in {source}" for name, shape in here.items() if name not in planned]
    if not differences:
        return ""
    more = len(differences) - 1
    return differences[0] + (f" (and {more} more {what}{'s' if more > 1 else ''} differ{'' if more > 1 else 's'})" if more else "")
