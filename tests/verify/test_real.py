"""Real runs: measured unit times in the plan, and `autoplan.verify` against the prediction.

On the CPU the verified peak is the CPU allocator's own count of a real training step
(verify.allocator), which shares nothing with the simulation; it must equal the fake-tensor
prediction. CUDA tests skip without a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autoplan

from autoplan.errors import ProfileError, TrainingStepError
from autoplan.plan import Choice
from autoplan.instruments.tracker import LiveBytesTracker
from autoplan.planned.forwards import apply_choices
from autoplan.verify.real import CPU_ALLOCATOR_SOURCE
from tests.models import ALL_MODELS

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def batch_of(name: str, repeat: int = 4):
    model, inputs = ALL_MODELS[name]()
    return model, tuple(t.repeat(repeat, *[1] * (t.dim() - 1)) for t in inputs)


def tight_plan(model, inputs, **options):
    free = autoplan.plan(model, "4GB", example_inputs=inputs, device="cpu", precision="fp32", reserve=0, **options)
    budget = (free.prediction.baseline_peak_bytes + free.prediction.minimum_peak_bytes) // 2
    return autoplan.plan(model, budget, example_inputs=inputs, device="cpu", precision="fp32", reserve=0, **options)


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("name", ["tiny_gpt", "small_resnet", "skipnet", "flat", "lora"])
def test_verify_on_cpu_measures_the_predicted_peak(name):
    model, inputs = batch_of(name, repeat=64 if name == "flat" else 4)  # flat: activations must matter
    plan = tight_plan(model, inputs)
    assert plan.outcome.feasible and any(u.choice.mode != "keep" for u in plan.decisions.units)
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    result = autoplan.verify(model, plan, example_inputs=inputs, steps=3)
    assert result.peak_source == CPU_ALLOCATOR_SOURCE and result.device == "cpu"
    assert not result.out_of_memory and result.held
    assert abs(result.peak_error) <= 0.01, (result.measured_peak_bytes, result.predicted_peak_bytes)
    assert result.measured_step_time_s > 0
    assert autoplan.planned_choices(model) == plan.decisions.choices()  # verify applied the plan
    # verify trained real steps, then put the model back
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))


@pytest.mark.slow  # the whole pipeline
def test_a_tensor_the_simulation_forgets_is_seen_by_verify(monkeypatch):
    """The simulation's tracker made blind to the logits (the output the loop keeps through backward): the plan
    predicts that much less, and verify, which counts with the CPU allocator and no code of the tracker's, measures
    them. A verify that ran the tracker over the real step would have been blind the same way, and agreed."""
    model, inputs = batch_of("tiny_gpt")
    logits_bytes = model(*inputs).logits.untyped_storage().nbytes()
    honest = tight_plan(model, inputs)
    forgetful = LiveBytesTracker._count

    def forgetting(self, storage, key, **how):
        if storage.nbytes() != logits_bytes:
            forgetful(self, storage, key, **how)

    monkeypatch.setattr(LiveBytesTracker, "_count", forgetting)
    blind = tight_plan(model, inputs)
    assert blind.prediction.peak_bytes < honest.prediction.peak_bytes
    result = autoplan.verify(model, blind, example_inputs=inputs, steps=3)
    assert result.measured_peak_bytes >= blind.prediction.peak_bytes + logits_bytes // 2
    assert abs(result.measured_peak_bytes - honest.prediction.peak_bytes) <= 0.01 * honest.prediction.peak_bytes


@pytest.mark.slow  # the whole pipeline
def test_verify_runs_the_plan_and_judges_it_against_the_usable_budget():
    model, inputs = batch_of("tiny_gpt")
    plan = tight_plan(model, inputs)
    apply_choices(model, {u.unit: Choice("keep", "fp32") for u in plan.decisions.units})  # not the plan
    result = autoplan.verify(model, plan, example_inputs=inputs)
    assert autoplan.planned_choices(model) == plan.decisions.choices()
    assert result.held and abs(result.peak_error) <= 0.01
    short = dataclasses.replace(plan, request=dataclasses.replace(plan.request, usable_bytes=result.measured_peak_bytes - 1))
    assert not autoplan.verify(model, short, example_inputs=inputs).held


def test_verify_rejects_bad_input():
    model, inputs = batch_of("mlp")
    plan = tight_plan(model, inputs)
    with pytest.raises(TypeError, match="Plan"):
        autoplan.verify(model, {"units": []}, example_inputs=inputs)
    with pytest.raises(ValueError, match="at least 2"):
        autoplan.verify(model, plan, example_inputs=inputs, steps=1)
    meta = ALL_MODELS["mlp"]()[0].to("meta")
    with pytest.raises(ValueError, match="meta device"):
        autoplan.verify(meta, plan, example_inputs=inputs)


@pytest.mark.slow  # the whole pipeline
def test_measured_profile_times_units_for_real_and_leaves_the_model_alone():
    model, inputs = batch_of("small_resnet")  # BatchNorm: real forwards would move its statistics
    buffers = [b.clone() for b in model.buffers()]
    measured = autoplan.plan(model, "4GB", example_inputs=inputs, device="cpu", precision="fp32", profile="measure", menu_size=0)
    roofline = autoplan.plan(model, "4GB", example_inputs=inputs, device="cpu", precision="fp32", profile="roofline", menu_size=0)
    assert measured.prediction.time_source == "measured (CPU wall clock)" and roofline.prediction.time_source == "roofline"
    assert all(u.step_time_s > 0 for u in measured.decisions.units)
    assert [u.step_time_s for u in measured.decisions.units] != [u.step_time_s for u in roofline.decisions.units]
    assert measured.prediction.baseline_step_time_s != roofline.prediction.baseline_step_time_s
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow  # the whole pipeline
def test_measure_needs_the_model_on_the_target_device():
    model, inputs = batch_of("mlp")
    with pytest.raises(ValueError, match="move the model there"):
        autoplan.plan(model, "4GB", example_inputs=inputs, device="h100-80gb", profile="measure")
    with pytest.raises(ValueError, match="profile must be"):
        autoplan.plan(model, "4GB", example_inputs=inputs, device="cpu", profile="fast")


@pytest.mark.slow  # the whole pipeline
@CUDA
def test_cuda_verify_measures_allocator_peak_within_5_percent():
    model, inputs = batch_of("tiny_gpt", repeat=64)
    model, inputs = model.cuda(), tuple(t.cuda() for t in inputs)
    plan = autoplan.plan(model, "80%", example_inputs=inputs, precision="bf16")
    result = autoplan.verify(model, plan, example_inputs=inputs, steps=4)
    assert result.peak_source == "torch.cuda.max_memory_allocated"
    assert result.held and abs(result.peak_error) <= 0.05, result


@pytest.mark.slow  # the whole pipeline
@CUDA
def test_cuda_verify_reports_out_of_memory_instead_of_raising():
    model, inputs = batch_of("tiny_gpt", repeat=256)
    model, inputs = model.cuda(), tuple(t.cuda() for t in inputs)
    plan = autoplan.plan(model, "80%", example_inputs=inputs)
    small = autoplan.plan(model, plan.prediction.minimum_peak_bytes // 2, example_inputs=inputs, reserve=0)
    result = autoplan.verify(model, small, example_inputs=inputs)
    assert result.out_of_memory and not result.held


@pytest.mark.slow  # the whole pipeline
def test_an_optimizer_instance_is_counted_as_itself():
    """torch 2.13's AdamW keeps `decoupled_weight_decay` in its defaults, which its constructor rejects:
    planning with the person's own optimizer object must still work, and count its state."""
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(3)))
    batch = (torch.randn(4, 16),)
    by_name = autoplan.plan(model, "100%", example_inputs=batch, device="cpu", optimizer="adamw")
    by_object = autoplan.plan(model, "100%", example_inputs=batch, device="cpu", optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    assert by_object.request.optimizer == "AdamW"
    assert by_object.prediction.breakdown.optimizer == by_name.prediction.breakdown.optimizer > 0


class _Regressor(torch.nn.Module):
    """A model given one batch tensor twice (`labels=input_ids` style) and a view of it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)) for _ in range(3))

    def forward(self, x, target, first_row):
        for block in self.blocks:
            x = x + block(x)
        return ((x - target) ** 2).mean() + first_row.sum()


def test_a_batch_tensor_passed_twice_is_counted_once():
    """Regression: each batch tensor was faked on its own, so `labels=input_ids` counted the batch twice."""
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    inputs = {"x": x, "target": x, "first_row": x[0]}
    model = _Regressor()
    plan = tight_plan(model, inputs)
    result = autoplan.verify(model, plan, example_inputs=inputs, steps=3)
    assert result.measured_peak_bytes == result.predicted_peak_bytes == plan.prediction.simulated_peak_bytes


class _FailsOnSecondRealStep(torch.nn.Module):
    """As a library that keeps state its second forward trips over: planning (fake tensors) runs, real step 2 fails."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
        self.real_forwards = 0

    def forward(self, x):
        if type(x) is torch.Tensor:  # a real step: not fake tensors, not a torch.fx trace
            self.real_forwards += 1
            if self.real_forwards == 2:
                raise AttributeError("'NoneType' object has no attribute 'unsqueeze'")
        for block in self.blocks:
            x = torch.relu(block(x))
        return x.sum()


def test_a_model_whose_own_second_step_fails_is_named_not_a_bug():
    model, inputs = _FailsOnSecondRealStep(), (torch.randn(4, 8),)
    plan = autoplan.plan(model, "1GB", example_inputs=inputs, device="cpu", reserve=0, units=["blocks.*"])
    with pytest.raises(TrainingStepError, match=r"training step 2 of 3 failed; the steps before it ran: AttributeError: "
                       r"'NoneType' object has no attribute 'unsqueeze' \(in .*test_real.py:\d+, forward\)") as failed:
        autoplan.verify(model, plan, example_inputs=inputs)
    assert isinstance(failed.value, ProfileError)  # the CLI's "cannot plan" exit code, 6, not a bug's 1
