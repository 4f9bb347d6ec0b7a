"""apply (and verify's own rewrite) is all or nothing (`planned.transaction`): an interrupt or an error halfway through rewriting
leaves the caller's model as it was (no unit's forward wrapped, its attributes, hooks, parameters and
config's use_cache unchanged) and training it gives what the untouched model gives; applied again, the
plan then takes whole.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import autoplan
import autoplan.planned.forwards as forwards
from autoplan.planned.transaction import restored_on_failure
from autoplan.planned.forwards import planned_choices


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Net(nn.Module):
    """Three blocks and a config that says use_cache=True, as a transformers model's does."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(3))
        self.config = SimpleNamespace(use_cache=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.fixture(scope="module")
def planned():
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 16)
    # bf16: a model left with some units planned and others not trains to another loss than the untouched one
    plan = autoplan.plan(model, "1GB", example_inputs=(x,), device="cpu", precision="bf16",
                         checkpoint={"blocks.0": "full", "blocks.1": "keep", "blocks.2": "full"})
    return model, x, plan


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = model(x).pow(2).mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _state(model: nn.Module) -> dict:
    """What apply may change, module by module, as values to compare."""
    return {
        "instance forwards": {name: module.__dict__["forward"] for name, module in model.named_modules() if "forward" in module.__dict__},
        "attributes": {name: sorted(module.__dict__) for name, module in model.named_modules()},
        "hooks": {name: (list(module._forward_hooks), list(module._forward_pre_hooks)) for name, module in model.named_modules()},
        "use_cache": model.config.use_cache,
    }


def _failing_on_the_second_unit(monkeypatch, error: BaseException) -> list[nn.Module]:
    """Rewriting a unit raises `error` at the second unit (the first is rewritten by then); the units tried."""
    tried: list[nn.Module] = []

    class FailingPlannedForward(forwards.PlannedForward):
        def __init__(self, module, *args, **kwargs) -> None:
            tried.append(module)
            if len(tried) == 2:
                raise error
            super().__init__(module, *args, **kwargs)

    monkeypatch.setattr(forwards, "PlannedForward", FailingPlannedForward)
    return tried


# verify rewrites an unplanned model itself before its steps, and did so outside the transaction (issue 39)
REWRITERS = {
    "apply": lambda model, plan, x: autoplan.apply(model, plan),
    "verify": lambda model, plan, x: autoplan.verify(model, plan, example_inputs=(x,), steps=2),
}


@pytest.mark.parametrize("rewriter", REWRITERS)
@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("a unit could not be rewritten")], ids=["interrupt", "error"])
def test_a_failure_halfway_leaves_the_model_as_it_was(planned, monkeypatch, error, rewriter):
    model, x, plan = planned
    model = copy.deepcopy(model)
    model.blocks[1].register_forward_hook(lambda module, args, output: None)  # the caller's own hook stays
    untouched = copy.deepcopy(model)
    before, parameters = _state(model), dict(model.named_parameters())
    tried = _failing_on_the_second_unit(monkeypatch, error)
    with pytest.raises(type(error)):
        REWRITERS[rewriter](model, plan, x)
    assert tried == [model.blocks[0], model.blocks[1]], "the first unit was rewritten before the failure"
    assert _state(model) == before
    assert dict(model.named_parameters()) == parameters  # the same parameter objects
    assert model.state_dict().keys() == untouched.state_dict().keys()
    assert all(torch.equal(value, untouched.state_dict()[key]) for key, value in model.state_dict().items())
    loss, grads = _step(model, x)
    untouched_loss, untouched_grads = _step(untouched, x)
    assert torch.equal(loss, untouched_loss) and all(torch.equal(a, b) for a, b in zip(grads, untouched_grads, strict=True))

    monkeypatch.undo()
    autoplan.apply(model, plan)
    assert planned_choices(model) == plan.decisions.choices() and model.config.use_cache is False


def test_what_a_rewrite_can_change_besides_forwards_is_put_back():
    """A 4-bit layer's bias cast through `.data` (settle_first_forward), a config's attribute, a hook, a parameter or
    a submodule replaced, the class swapped and an attribute added (as FSDP2's fully_shard does)."""
    model = _Net()
    bias, weight, block = model.blocks[0].up.bias, model.blocks[0].up.weight, model.blocks[2]
    bias_value, before = bias.detach().clone(), _state(model)

    class Swapped(_Net):
        pass

    with pytest.raises(KeyboardInterrupt), restored_on_failure(model):
        bias.data = bias.data.to(torch.bfloat16)
        model.config.use_cache = False
        model.blocks[1].register_forward_pre_hook(lambda module, args: None)
        model.blocks[0].up.weight = nn.Parameter(torch.zeros(32, 16))
        model.blocks[2] = _Block(16)
        model.__class__ = Swapped
        model.added = 1
        raise KeyboardInterrupt
    assert type(model) is _Net and _state(model) == before and not hasattr(model, "added")
    assert model.blocks[0].up.weight is weight and model.blocks[2] is block
    assert model.blocks[0].up.bias is bias and bias.dtype == torch.float32 and torch.equal(bias, bias_value)
