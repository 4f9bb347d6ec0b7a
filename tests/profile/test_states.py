"""Counted states (profile.states) are the simulated step's StaticBytes, byte for byte, with no forward run.

The planner answers DOES NOT FIT from the count alone when it is over the budget (solve.states_bound), so
the count must be the simulation's: checked on every zoo model, the transformers families, and the
optimizers whose state differs in kind (none, fp32 moments, bitsandbytes' 8-bit blocks, paged).
"""

from __future__ import annotations

import pytest
import torch

from autoplan.inputs.batch import training_batch
from autoplan.inputs.devices import get_device
from autoplan.inputs.loop import TrainingLoop
from autoplan.profile.simulation import run_timeline
from autoplan.profile.states import count_states
from autoplan.trace.tracer import trace
from tests.families import FAMILIES
from tests.models import ALL_MODELS


def _simulated_static(model, inputs, device, optimizer, loop=TrainingLoop()):
    traced = trace(model, training_batch(model, inputs, None, None))
    return run_timeline(traced, {}, device=device, optimizer=optimizer, loop=loop).static


def _assert_counted_is_simulated(model, inputs, device, optimizer="adamw", loop=TrainingLoop()):
    counted = count_states(model, device=device, optimizer=optimizer, loop=loop)
    static = _simulated_static(model, inputs, device, optimizer, loop)
    assert (counted.parameters, counted.gradients, counted.optimizer) == (static.parameters, static.gradients, static.optimizer)
    assert counted.total > 0


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
@pytest.mark.parametrize("device", ["cpu", "h100-80gb"])
def test_counted_states_are_the_simulated_steps_on_the_zoo(name, device) -> None:
    model, inputs = ALL_MODELS[name]()
    _assert_counted_is_simulated(model, inputs, get_device(device))


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_counted_states_are_the_simulated_steps_on_the_transformers_families(family) -> None:
    model = family.build()
    _assert_counted_is_simulated(model, family.inputs(model), get_device("h100-80gb"))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "sgd-momentum", "adam", "adamw8bit", "paged-adamw8bit", "lion8bit", "paged-adamw"])
def test_counted_states_are_the_simulated_steps_for_each_kind_of_optimizer_state(optimizer) -> None:
    """On 4 layers: a named optimizer steps two parameters of each shape and counts the rest alike (profile.states)."""
    pytest.importorskip("bitsandbytes")
    llama = next(family for family in FAMILIES if family.name == "Llama")
    model = llama.build()
    _assert_counted_is_simulated(model, llama.inputs(model), get_device("h100-80gb"), optimizer)


def test_counted_states_follow_the_loop_and_a_frozen_part() -> None:
    model, inputs = ALL_MODELS["residual_mlp"]()
    next(model.parameters()).requires_grad_(False)  # a frozen layer: no gradient, no state
    loop = TrainingLoop(accumulation_steps=2, zero_grad_set_to_none=False, optimizer_impl="fused", grad_scaler=True)
    _assert_counted_is_simulated(model, inputs, get_device("h100-80gb"), "adamw", loop)
    counted = count_states(model, device=get_device("cpu"), optimizer="adamw", loop=TrainingLoop())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(counted.trainable_numels) == trainable < sum(p.numel() for p in model.parameters())


def test_counting_runs_no_forward_and_leaves_the_model_as_it_was() -> None:
    model, _ = ALL_MODELS["tiny_gpt"]()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    count_states(model, device=get_device("cpu"), optimizer="adamw", loop=TrainingLoop())
    handle.remove()
    assert calls == []
    assert all(p.grad is None and torch.equal(p, before[name]) for name, p in model.named_parameters())
