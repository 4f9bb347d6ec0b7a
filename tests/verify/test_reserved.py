"""On one GPU the plan predicts the caching allocator's reserved memory, and says where the budget leaves it too little."""

from __future__ import annotations

import json

import pytest

import autoplan
from tests.verify.test_real import batch_of


@pytest.mark.slow  # the whole pipeline
def test_a_gpu_plan_predicts_reserved_memory_and_fits_it_under_the_budget():
    model, inputs = batch_of("tiny_gpt", repeat=16)
    roomy = autoplan.plan(model, "8GB", example_inputs=inputs, device="h100-80gb", reserve=0)
    reserved, peak = roomy.prediction.reserved_peak_bytes, roomy.predicted_peak_bytes
    assert peak < reserved < 2 * peak  # segments hold free space; a few MiB of 2 MiB and 20 MiB segments
    assert json.loads(roomy.to_json())["reserved_peak_bytes"] == reserved
    assert "caching allocator's reserved memory" in roomy.report()
    assert not any("caching allocator is predicted to reserve" in note for note in roomy.notes)
    # a budget the allocated peak fits but the reserved memory does not: the plan says so, it is not silent
    budget = (peak + reserved) // 2
    tight = autoplan.plan(model, budget, example_inputs=inputs, device="h100-80gb", reserve=0)
    assert tight.feasible and tight.prediction.reserved_peak_bytes > budget
    assert any("caching allocator is predicted to reserve" in note for note in tight.notes)
    # a plan that does not fit says so in its verdict, not in this note
    under = autoplan.plan(model, peak // 4, example_inputs=inputs, device="h100-80gb", reserve=0)
    assert not under.feasible and not any("caching allocator is predicted to reserve" in note for note in under.notes)


@pytest.mark.slow  # the whole pipeline
def test_a_cpu_plan_predicts_no_reserved_memory():
    model, inputs = batch_of("tiny_gpt", repeat=16)
    plan = autoplan.plan(model, "8GB", example_inputs=inputs, device="cpu")
    assert plan.prediction.reserved_peak_bytes == 0
    assert "caching allocator" not in plan.report()
