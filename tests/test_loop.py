"""The training loop is an input of the plan, and the predicted peak holds in that loop.

Every prediction here is checked against a real CPU training step of the rewritten model, run as
the loop says (`autoplan.verify`: the live tensor bytes of real tensors, counted by the same
tracker as the simulation). The claim, for the Hugging Face families of `tests/families.py`, the
plain-PyTorch zoo of `tests/models.py` and gradient accumulation: the measured peak is never above
the predicted one, and at most 3% below it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import autoplan
from autoplan import TrainingLoop
from tests import families
from tests.models import ALL_MODELS

KEPT = TrainingLoop()  # outputs = model(**batch); outputs.loss.backward(): logits alive through backward
DROPPED = TrainingLoop(keep_outputs=False)  # model(**batch).loss.backward(): the output dropped first
LOOPS = {"outputs-kept": KEPT, "outputs-dropped": DROPPED}
TOLERANCE = 0.03  # the measured peak is at most this far below the prediction (and never above)


def assert_holds(result: autoplan.Verification) -> None:
    measured, predicted = result.measured_peak_bytes, result.predicted_peak_bytes
    assert measured <= predicted, f"under-predicted: measured {measured} > predicted {predicted}"
    assert measured >= (1 - TOLERANCE) * predicted, f"over-predicted by more than 3%: measured {measured}, predicted {predicted}"
    assert result.held


def family_plan(family: families.Family, loop: TrainingLoop) -> tuple[torch.nn.Module, autoplan.Plan]:
    model = family.build()
    budget = families.half_activation_budget(family, loop=loop)
    plan = autoplan.plan(
        model, budget, batch_size=families.BATCH, seq_len=families.SEQ, device="cpu", precision="fp32", reserve=0, loop=loop
    )
    return model, plan


@pytest.mark.parametrize("loop", LOOPS.values(), ids=LOOPS.keys())
@pytest.mark.parametrize("family", families.FAMILIES, ids=[f.name for f in families.FAMILIES])
def test_hf_family_peak_holds_in_the_planned_loop(family, loop):
    pytest.importorskip("transformers")
    model, plan = family_plan(family, loop)
    assert plan.feasible and plan.loop == loop
    assert any(u.choice.mode != "keep" for u in plan.units)  # the budget makes the plan checkpoint
    result = autoplan.verify(model, plan, example_inputs=family.inputs(model), steps=2)
    assert_holds(result)


def zoo_plan(name: str, loop: TrainingLoop, repeat: int = 4):
    model, inputs = ALL_MODELS[name]()
    inputs = tuple(t.repeat(repeat, *[1] * (t.dim() - 1)) for t in inputs)
    options = dict(example_inputs=inputs, device="cpu", precision="fp32", reserve=0, loop=loop)
    free = autoplan.plan(model, "4GB", **options)
    budget = (free.baseline_peak_bytes + free.minimum_peak_bytes) // 2
    return model, inputs, autoplan.plan(model, budget, **options)


ZOO_LOOPS = {
    **LOOPS,
    "accumulate-2": TrainingLoop(accumulation_steps=2),
    "accumulate-4-dropped": TrainingLoop(accumulation_steps=4, keep_outputs=False),
}


@pytest.mark.parametrize("loop", ZOO_LOOPS.values(), ids=ZOO_LOOPS.keys())
@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_zoo_peak_holds_in_the_planned_loop(name, loop):
    model, inputs, plan = zoo_plan(name, loop, repeat=64 if name in ("flat", "mlp") else 4)
    assert plan.feasible and plan.loop == loop
    result = autoplan.verify(model, plan, example_inputs=inputs, steps=2)
    assert_holds(result)


ACCUMULATING = {"2": TrainingLoop(accumulation_steps=2), "4-dropped": TrainingLoop(accumulation_steps=4, keep_outputs=False)}


@pytest.mark.parametrize("loop", ACCUMULATING.values(), ids=ACCUMULATING.keys())
@pytest.mark.parametrize("name", ["GPT-2", "Llama", "T5"])
def test_hf_gradient_accumulation_peak_holds(name, loop):
    pytest.importorskip("transformers")
    family = families.BY_NAME[name]
    model, plan = family_plan(family, loop)
    assert plan.feasible
    result = autoplan.verify(model, plan, example_inputs=family.inputs(model), steps=2)
    assert_holds(result)


def peak_of(loop: TrainingLoop, name: str = "tiny_gpt") -> autoplan.Plan:
    model, inputs = ALL_MODELS[name]()
    return autoplan.plan(model, "4GB", example_inputs=inputs, device="cpu", precision="fp32", reserve=0, loop=loop)


def test_each_loop_field_changes_the_predicted_peak_the_way_it_changes_memory():
    kept, dropped = peak_of(KEPT), peak_of(DROPPED)
    # the logits stay alive through backward
    assert kept.baseline_peak_bytes > dropped.baseline_peak_bytes
    # gradients alive through forward and backward: from the earlier micro-batches, or zeroed instead of freed
    assert peak_of(TrainingLoop(accumulation_steps=2)).baseline_peak_bytes > kept.baseline_peak_bytes
    assert peak_of(TrainingLoop(zero_grad_set_to_none=False)).baseline_peak_bytes > kept.baseline_peak_bytes
    # the foreach implementation's temporaries are as large as all parameters at once; fused has none
    foreach = peak_of(TrainingLoop(optimizer_impl="foreach"), "mlp")
    fused = peak_of(TrainingLoop(optimizer_impl="fused"), "mlp")
    assert fused.baseline_peak_bytes <= peak_of(TrainingLoop(optimizer_impl="for-loop"), "mlp").baseline_peak_bytes
    assert fused.baseline_peak_bytes <= foreach.baseline_peak_bytes


@pytest.mark.parametrize("implementation", ["foreach", "fused", "for-loop"])
def test_optimizer_implementation_and_grad_scaler_hold_for_real(implementation):
    for loop in (TrainingLoop(optimizer_impl=implementation), TrainingLoop(optimizer_impl=implementation, grad_scaler=True)):
        model, inputs, plan = zoo_plan("tiny_gpt", loop)
        result = autoplan.verify(model, plan, example_inputs=inputs, steps=2)
        assert_holds(result)


def test_zero_grad_keeping_gradients_holds_for_real():
    model, inputs, plan = zoo_plan("tiny_gpt", TrainingLoop(zero_grad_set_to_none=False))
    assert_holds(autoplan.verify(model, plan, example_inputs=inputs, steps=2))


def test_the_plan_states_the_loop_it_assumed():
    loop = TrainingLoop(keep_outputs=False, accumulation_steps=4, optimizer_impl="fused")
    plan = peak_of(loop)
    assert plan.loop == loop
    stated = json.loads(plan.to_json())["loop"]
    assert stated == {**dataclasses.asdict(loop), "loss_in_model": stated["loss_in_model"]}
    assert "4 micro-batches" in plan.report() and "dropped" in plan.report()
    assert peak_of(None).loop == TrainingLoop()  # None: the common loop


def test_bad_loops_are_clear_errors():
    with pytest.raises(ValueError, match="accumulation_steps"):
        TrainingLoop(accumulation_steps=0)
    with pytest.raises(ValueError, match="optimizer_impl"):
        TrainingLoop(optimizer_impl="apex")
    with pytest.raises(TypeError, match="TrainingLoop"):
        peak_of({"keep_outputs": False})
    model, inputs = ALL_MODELS["tiny_gpt"]()
    with pytest.raises(ValueError, match="loss"):
        autoplan.plan(model, "4GB", example_inputs=inputs, device="cpu", loop=TrainingLoop(loss_in_model=True))
