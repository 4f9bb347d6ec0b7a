"""planned.wrappers: a checkpointed unit called with one tensor several times recomputes with one tensor."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autoplan.plan import Choice
from autoplan.planned.forwards import apply_choices
from autoplan.planned.wrappers import each_tensor_once
from autoplan.units import ModuleUnit


def test_repeats_are_passed_once_and_given_back_as_one_tensor() -> None:
    seen = []
    h, other = torch.ones(2), torch.zeros(2)
    call, args, kwargs = each_tensor_once(lambda *a, **k: seen.append((a, k)), (h, h, other, 3), {"value": h, "scale": 2})
    assert args == (h, None, other, 3) and kwargs == {"scale": 2}
    fresh = h.clone()  # what checkpoint's recomputation hands back: a tensor of its own
    call(fresh, *args[1:], **kwargs)
    (given, given_kwargs), = seen
    assert given[0] is given[1] is given_kwargs["value"] is fresh and given[2] is other
    assert each_tensor_once(print, (h, other), {}) == (print, (h, other), {})  # nothing repeated: unchanged


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_self_attention_recomputes_its_own_path_under_saved_tensor_hooks(mode) -> None:
    """Under hooks (the simulation's, an offload's) each saved argument comes back a tensor of its own; with
    attn(h, h, h) recomputed on three, MultiheadAttention ran other ops: selective checkpointing failed
    ("aten.split.Tensor encountered during backward but not found in storage"), full recomputed other shapes."""
    torch.manual_seed(0)
    attn, h = nn.ModuleDict({"a": nn.MultiheadAttention(16, 2, batch_first=True)}), torch.randn(2, 5, 16, requires_grad=True)
    planned = apply_choices(copy.deepcopy(attn), {ModuleUnit("a"): Choice(mode, "fp32")})
    grads = []
    for net in (attn, planned):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
            out = net["a"](h, h, h, need_weights=False)[0]
        out.square().sum().backward()
        grads.append([p.grad for p in net.parameters()])
    for planned_grad, plain_grad in zip(*grads[::-1]):
        torch.testing.assert_close(planned_grad, plain_grad)
