"""The memory model against whole-step fake-tensor simulation, for random per-unit choices."""

from __future__ import annotations

import random

import pytest

from autoplan.inputs.devices import get_device
from autoplan.memory.model import predict_peak
from autoplan.plan import MODES, Choice
from autoplan.profile.units import profile
from autoplan.trace.tracer import trace
from autoplan.verify.simulate import simulate_plan
from tests.models import ALL_MODELS

DEVICE = get_device("h100-80gb")


def activation_heavy(name: str):
    """The zoo model with a 16× batch, so activations (what the plan decides about) dominate."""
    model, inputs = ALL_MODELS[name]()
    return model, tuple(t.repeat(16, *[1] * (t.dim() - 1)) for t in inputs)


def errors(name: str, trials: int = 4) -> list[float]:
    model, inputs = activation_heavy(name)
    traced = trace(model, inputs)
    measured = profile(traced, DEVICE, precisions=("fp32", "bf16"))
    rng = random.Random(0)
    result = []
    for trial in range(trials):
        if trial == 0:
            choices = {u.name: Choice("full", "fp32") for u in measured.units}
        else:
            choices = {u.name: Choice(rng.choice(MODES), rng.choice(["fp32", "bf16"])) for u in measured.units}
        predicted = predict_peak(measured, choices).bytes
        simulated = simulate_plan(traced, choices, device=DEVICE, optimizer="adamw", rest_precision="fp32").peak_bytes
        result.append((predicted - simulated) / simulated)
    return result


@pytest.mark.parametrize(
    "name", ["mlp", "residual_mlp", "tiny_gpt", "tiny_gpt_eager", "tiny_gpt_dropout", "small_resnet", "skipnet", "lora", "flat"]
)
def test_prediction_within_5_percent_of_simulation(name):
    result = errors(name, trials=8 if name == "skipnet" else 4)
    assert all(abs(error) <= 0.05 for error in result), result


def test_baseline_prediction_is_the_simulation_exactly():
    model, inputs = activation_heavy("tiny_gpt")
    traced = trace(model, inputs)
    measured = profile(traced, DEVICE, precisions=("fp32",))
    base = {u.name: u.base for u in measured.units}
    assert predict_peak(measured, base).bytes == measured.timeline.peak_bytes
    # the peak includes the parameters, their gradients and AdamW's two states
    static = measured.timeline.static
    assert measured.timeline.peak_bytes > static.parameters + static.optimizer
    steps = 512 * sum(1 for p in model.parameters() if p.requires_grad)  # AdamW keeps a scalar step per parameter
    assert 2 * static.gradients <= static.optimizer <= 2 * static.gradients + steps
