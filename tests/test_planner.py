"""Planner: profile once, plan at many budgets; each plan is autoplan.plan's for that budget."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import autoplan
from autoplan import planner as planner_module
from autoplan.errors import BudgetError, OptionError, PlanMismatchError
from autoplan.trace.discovery import unit_levels
from tests.cli_factories import small_gpt, tiny_gpt
from tests.structures import by_name

OPTIONS: dict[str, Any] = dict(device="h100", reserve=0)


def _without_solve_times(value: Any) -> Any:
    """A plan's JSON less what the solver's clock wrote (how long each solve took)."""
    if isinstance(value, dict):
        return {key: _without_solve_times(item) for key, item in value.items() if "solve" not in key}
    if isinstance(value, list):
        return [_without_solve_times(item) for item in value]
    return value


def _budgets(plan: autoplan.Plan) -> list[int]:
    """The floor, a budget between it and what no plan needs, and that: three different plans (reserve=0 on a GPU
    target: the caching allocator's least limit where it is above the peak)."""
    low, high = plan.prediction.minimum_budget_bytes, max(plan.prediction.baseline_peak_bytes, plan.prediction.least_limit_bytes)
    return [low, (low + high) // 2, high]


@pytest.mark.slow  # the whole pipeline, several times
@pytest.mark.parametrize("build", [
    lambda: small_gpt(batch_size=4, seq_len=128),  # the loss head planned fused and as written
    lambda: by_name("stages of blocks (stages[i].blocks[j])").build(),  # two levels of units, the best kept
], ids=["tiny GPT", "stages of blocks"])
def test_each_plan_is_autoplans_plan_for_that_budget(build, monkeypatch) -> None:
    model, inputs = build()
    traces = []
    real_trace = planner_module.trace
    monkeypatch.setattr(planner_module, "trace", lambda *args, **kwargs: traces.append(1) or real_trace(*args, **kwargs))
    planner = autoplan.Planner(model, example_inputs=inputs, precision="fp32", **OPTIONS)
    assert traces == []  # made, not yet profiled: options only
    budgets = _budgets(planner.plan("1GB"))
    planned = [planner.plan(budget) for budget in budgets]
    assert len(traces) == len(unit_levels(model))  # every level traced once, for four plans
    assert len({tuple(plan.decisions.choices().items()) for plan in planned}) >= 2  # the budgets made different plans
    for budget, plan in zip(budgets, planned):
        alone = autoplan.plan(model, budget, example_inputs=inputs, precision="fp32", **OPTIONS)
        assert _without_solve_times(plan.to_dict()) == _without_solve_times(alone.to_dict())
        assert plan.request.budget_bytes == budget and plan.request.arguments[0] == ("budget", budget)


@pytest.mark.slow  # the whole pipeline, several times
def test_a_loss_head_that_cannot_be_faster_is_not_planned_again_and_the_plan_is_the_same() -> None:
    """Where the head decided first fits and the other's fastest step is no faster, and the other's floor is known
    from earlier budgets, the other is not planned again (deciding.decide_loss_head): the plan is the one planning
    both gives, autoplan.plan's for that budget."""
    from tests.planned.test_loss_head import _llama

    model, inputs = _llama()  # a head that can be fused: both ways planned
    options = dict(example_inputs=inputs, device="cpu", precision="fp32", reserve=0)
    said: list[str] = []
    planner = autoplan.Planner(model, progress=said.append, **options)
    loose = planner.plan("100MB")
    low, high = loose.prediction.minimum_budget_bytes, loose.prediction.baseline_peak_bytes
    skipped = []
    for budget in (low, (low + high) // 2, high):
        said.clear()
        plan = planner.plan(budget)
        skipped.append(any("cannot be faster here: not planned again" in words for words in said))
        alone = autoplan.plan(model, budget, **options)
        assert _without_solve_times(plan.to_dict()) == _without_solve_times(alone.to_dict())
    assert skipped == [False, False, True]  # the floor simulated (at the lowest budget) first; then the loose budget skips


@pytest.mark.slow  # the whole pipeline
def test_options_are_checked_when_made_and_the_budget_when_planned() -> None:
    model, inputs = tiny_gpt(batch_size=2, seq_len=8)
    with pytest.raises(OptionError, match="precision"):
        autoplan.Planner(model, example_inputs=inputs, precision="fp8", **OPTIONS)
    planner = autoplan.Planner(model, example_inputs=inputs, **OPTIONS)
    with pytest.raises(BudgetError, match="20Gb"):
        planner.plan("20Gb")
    assert planner.plan("1GB").outcome.feasible  # a bad budget leaves the planner as it was


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("change, named", [
    ("freeze", r"parameter \S+ is .*, frozen here, .*, trained in the profile"),
    ("cast", r"parameter \S+ is [0-9×]+ float64 on cpu, trained here, [0-9×]+ float32 on cpu, trained in the profile"),
    # the new parameter comes first in named_parameters(): the message still names it, not a neighbour
    ("grow", r"parameter extra \(3 float32 on cpu, trained\) is not in the profile"),
])
def test_a_model_changed_after_profiling_is_refused(change, named) -> None:
    model, inputs = tiny_gpt(batch_size=2, seq_len=8)
    planner = autoplan.Planner(model, example_inputs=inputs, **OPTIONS)
    planner.plan("1GB")
    head = model.lm_head if hasattr(model, "lm_head") else list(model.modules())[-1]
    if change == "freeze":
        next(head.parameters()).requires_grad_(False)
    elif change == "cast":
        head.to(torch.float64)
    else:
        model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(PlanMismatchError, match="changed since this Planner was made.*make a new Planner") as refused:
        planner.plan("1GB")
    assert re.search(named, str(refused.value)), str(refused.value)


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch.compiler.set_stance is torch 2.6+")
def test_planning_a_compiled_model_leaves_it_to_compile():
    """Issue 39: Dynamo, called under planning's dispatch modes, gave up on the model's forward and marked its code
    to be skipped for the rest of the process, so a torch.compile'd model, once planned, trained without compiling."""
    from tests.cli_factories import tiny_mlp

    graphs: list[torch.fx.GraphModule] = []

    def backend(graph_module, example_inputs):  # records what Dynamo captured, and runs it as written
        graphs.append(graph_module)
        return graph_module.forward

    model, inputs = tiny_mlp()
    compiled = torch.compile(model, backend=backend)
    plan = autoplan.plan(compiled, "1GB", example_inputs=inputs, device="cpu")
    assert plan.outcome.feasible and graphs == [], "planning ran the model as written"
    compiled(*inputs)
    assert len(graphs) == 1, "the caller's next call compiles it"
