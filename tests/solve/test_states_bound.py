"""Where the states alone are over the budget, the answer comes from counting them (solve.states_bound).

The count is checked against the simulation here through the planner itself: the counted plan's states
are the simulated plan's (count_first=False), its verdict is the same, and no step is simulated for it.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import autoplan
import autoplan.inputs.devices
import autoplan.profile.states
from autoplan.errors import OptionError
from autoplan.profile import timeline
from autoplan.report.advice import advise
from tests.models import make_residual_mlp


def _no_simulation(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a step was simulated")
    monkeypatch.setattr(timeline, "_simulated_step", refuse)


def _states(plan) -> int:
    return plan.model.state_bytes


def test_states_over_the_budget_are_answered_from_the_count_without_simulating(monkeypatch) -> None:
    model, inputs = make_residual_mlp()
    simulated = autoplan.plan(model, 10_000, example_inputs=inputs, device="cpu", reserve=0, count_first=False)
    _no_simulation(monkeypatch)
    counted = autoplan.plan(model, 10_000, example_inputs=inputs, device="cpu", reserve=0)
    assert counted.outcome.decided_by == "state count" and simulated.outcome.decided_by == "simulation"
    assert not counted.feasible and not simulated.feasible
    assert _states(counted) == _states(simulated) == counted.prediction.peak_bytes > 10_000
    assert counted.prediction.minimum_peak_bytes <= simulated.prediction.minimum_peak_bytes  # the count is a floor
    assert counted.units == () and counted.to_dict()["decided_by"] == "state count"
    report = counted.report()
    assert "counted, not simulated" in report and "not simulated" in report and "simulated training step" not in report


def test_a_budget_the_states_fit_is_simulated_as_before() -> None:
    model, inputs = make_residual_mlp()
    planner = autoplan.Planner(model, example_inputs=inputs, device="cpu", reserve=0)
    small, large = planner.plan(10_000), planner.plan("1GB")
    assert small.outcome.decided_by == "state count"
    assert large.outcome.decided_by == "simulation" and large.feasible and large.units


class _Unused(nn.Module):
    """Two blocks, the second never called: its parameters get no gradient and no optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(2))

    def forward(self, x):
        return self.blocks[0](x).sum()


def test_a_model_whose_forward_leaves_a_unit_unrun_is_simulated() -> None:
    """Counting every trainable parameter would say more than the real step holds; the simulation decides."""
    model = _Unused()
    counted = autoplan.profile.states.count_states(model, device=autoplan.inputs.devices.get_device("cpu"), optimizer="adamw",
                                                   loop=autoplan.TrainingLoop())
    budget = 2_000_000  # over what the real step holds (one block trains, 1.85 MB), under the count of both (2.1 MB)
    planned = autoplan.plan(model, budget, example_inputs=(torch.randn(4, 256),), device="cpu", reserve=0, units=["blocks.*"])
    assert planned.outcome.decided_by == "simulation" and planned.feasible and counted.total > budget


def test_fsdp_is_never_answered_from_the_count() -> None:
    model, inputs = make_residual_mlp()
    planned = autoplan.plan(model, 10_000, example_inputs=inputs, device="h100-80gb", reserve=0, world_size=2)
    assert planned.outcome.decided_by == "simulation"


def test_a_counted_plan_is_advised_from_counts_and_cannot_be_applied() -> None:
    model, inputs = make_residual_mlp()
    counted = autoplan.plan(model, 10_000, example_inputs=inputs, device="h100-80gb", reserve=0, offload=False)
    advice = advise(counted, None)
    statuses = {step.key: step.status for step in advice.steps}
    assert statuses["checkpointing"] == statuses["bf16"] == "n/a" and statuses["fsdp"] == "try"
    assert advice.first_fix is None  # the peak is a floor: no step is known to fit on its own
    fsdp = advice.step("fsdp").detail
    assert f"at least {-(-_states(counted) // 10_000)} × h100-80gb" in fsdp
    with pytest.raises(OptionError, match="no choices to apply"):
        autoplan.apply(model, counted)
    json.dumps(advice.to_dict())  # the CLI's --json writes it


def test_a_counted_plan_for_a_custom_device_is_advised_with_that_device() -> None:
    custom = autoplan.inputs.devices.get_device("custom:memory=16GB,fp32_tflops=10,bandwidth=500GB")
    model, inputs = make_residual_mlp()
    counted = autoplan.plan(model, 10_000, example_inputs=inputs, device=custom, reserve=0)
    assert counted.outcome.decided_by == "state count"
    assert advise(counted, None, device=custom).step("optimizer_8bit").status == "try"


def test_a_counted_plan_shows_the_ladder_it_was_asked_for() -> None:
    """`--ladder` plans its rungs whatever the states (its QLoRA rung is where such a model fits); a plan answered from
    the count dropped the ladder it had waited minutes for, and printed none."""
    from rich.console import Console

    from autoplan.report.ladder import Ladder, Rung
    from autoplan.report.text import report_renderables

    model, inputs = make_residual_mlp()
    counted = autoplan.plan(model, 10_000, example_inputs=inputs, device="h100-80gb", reserve=0, offload=False)
    rungs = (Rung("baseline", "baseline (fp32, eager attention)", 60_000, 1e-3, False, "planned", ""),
             Rung("qlora", "+ 4-bit QLoRA (NF4, r=16)", 9_000, 2e-3, True, "planned", "lora = ..."))
    ladder = Ladder(rungs, 10_000, 10_000, "h100-80gb", "qlora", "lora = ...")
    advice = advise(counted, None, ladder=ladder)
    assert advice.ladder is ladder
    # a QLoRA step priced by the rung: a counted plan has no step time to price it against
    from autoplan.report.batch_steps import Step
    from autoplan.report.ladder_steps import planned_by_ladder

    priced = planned_by_ladder(Step("qlora", "4-bit QLoRA", "try", "about"), counted, ladder)
    assert priced.status == "try" and priced.saves_bytes == counted.prediction.peak_bytes - 9_000
    assert priced.time_change_s is None and "(its states, counted) for this plan" in priced.detail
    console = Console(width=120, record=True)
    for part in report_renderables(counted, advice):
        console.print(part)
    text = console.export_text()
    assert "the toolbox ladder on h100-80gb" in text and "+ 4-bit QLoRA (NF4, r=16)" in text
