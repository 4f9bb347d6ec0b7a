"""Fake twins of models and inputs: FakeTensors with the shapes, dtypes and ties of the real ones
and no data, so a 70B-parameter model is simulated on a laptop.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only


def _fake_like(tensor: torch.Tensor, fake_mode: FakeTensorMode) -> torch.Tensor:
    with fake_mode:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")


def fake_copy(model: torch.nn.Module, fake_mode: FakeTensorMode) -> torch.nn.Module:
    """A twin of `model` whose parameters and buffers are FakeTensors on the CPU.

    Tied parameters stay tied (deepcopy's memo maps each original tensor to one fake), and no
    parameter data is copied, so this works for meta-device models of any size.
    """
    memo: dict[int, Any] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in memo:
            continue
        fake = _fake_like(tensor, fake_mode)
        if isinstance(tensor, torch.nn.Parameter):
            fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = fake
    return copy.deepcopy(model, memo)


def fake_tree(tree: Any, fake_mode: FakeTensorMode) -> Any:
    """Replace every tensor in a pytree of inputs by a fake of the same shape, dtype and grad flag."""

    def to_fake(tensor: torch.Tensor) -> torch.Tensor:
        fake = _fake_like(tensor, fake_mode)
        return fake.requires_grad_(tensor.requires_grad) if fake.is_floating_point() else fake

    return tree_map_only(torch.Tensor, to_fake, tree)
