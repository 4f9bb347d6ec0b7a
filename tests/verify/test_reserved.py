"""On one GPU the plan predicts the caching allocator's reserved memory and the least limit it runs in, and fits the latter."""

from __future__ import annotations

import json

import pytest

import autoplan
from tests.verify.test_real import batch_of


@pytest.mark.slow  # the whole pipeline
def test_a_gpu_plan_predicts_reserved_memory_and_the_least_limit_it_runs_in():
    model, inputs = batch_of("tiny_gpt", repeat=16)
    roomy = autoplan.plan(model, "8GB", example_inputs=inputs, device="h100-80gb", reserve=0)
    reserved, least, peak = roomy.prediction.reserved_peak_bytes, roomy.prediction.least_limit_bytes, roomy.predicted_peak_bytes
    assert peak < reserved < 2 * peak  # segments hold free space; a few MiB of 2 MiB and 20 MiB segments
    assert peak < least <= reserved  # giving the cache back at the limit can run in less, never in less than is allocated
    as_json = json.loads(roomy.to_json())
    assert as_json["reserved_peak_bytes"] == reserved and as_json["least_limit_bytes"] == least
    report = roomy.report()
    assert "caching allocator's reserved memory" in report and "least limit the allocator runs it in" in report
    assert not any("caching allocator" in note for note in roomy.notes)  # 8 GB leaves it room


@pytest.mark.slow  # the whole pipeline
def test_a_budget_the_allocated_peak_fits_but_the_allocator_does_not_is_planned_for_the_allocator():
    model, inputs = batch_of("tiny_gpt", repeat=16)
    planner = autoplan.Planner(model, example_inputs=inputs, device="h100-80gb", reserve=0)
    roomy = planner.plan("8GB")
    budget = (roomy.predicted_peak_bytes + roomy.prediction.least_limit_bytes) // 2  # the roomy plan's peak fits, its allocator does not
    tight = planner.plan(budget)
    assert tight.feasible and tight.prediction.least_limit_bytes <= budget  # reserve=0: the allocator has the whole budget
    assert any("a faster plan fits by its allocated peak, but the caching allocator needs" in note for note in tight.notes)
    assert tight.prediction.step_time_s >= roomy.prediction.step_time_s
    # at the floor the lowest-peak choices fit, the allocator's need included; below it nothing does
    floor = roomy.prediction.minimum_budget_bytes
    at_floor = planner.plan(floor)
    assert at_floor.feasible and at_floor.prediction.least_limit_bytes <= floor
    # between the lowest peak and the floor the allocated peak fits, the allocator does not: the verdict says which
    assert floor > roomy.prediction.minimum_peak_bytes
    short = planner.plan((roomy.prediction.minimum_peak_bytes + floor) // 2)
    assert not short.feasible
    assert "fits the" in short.report().splitlines()[0] and "but the caching allocator needs" in " ".join(short.report().split())
    under = planner.plan(roomy.prediction.minimum_peak_bytes // 2)
    assert not under.feasible and under.prediction.minimum_budget_bytes == floor
    assert not any("caching allocator" in note for note in under.notes)  # the verdict says it; no note repeats it


@pytest.mark.slow  # the whole pipeline
def test_a_cpu_plan_predicts_no_reserved_memory():
    model, inputs = batch_of("tiny_gpt", repeat=16)
    plan = autoplan.plan(model, "8GB", example_inputs=inputs, device="cpu")
    assert plan.prediction.reserved_peak_bytes == 0
    assert "caching allocator" not in plan.report()
