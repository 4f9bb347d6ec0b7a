"""solve.search: solve, check against the simulation, tighten; more budget never turns a fit into no fit."""

from __future__ import annotations

from autoplan.memory.model import predict_peak
from autoplan.solve.ilp import minimum_peak
from autoplan.solve.search import resolve_slack, search
from tests.solve.test_ilp import asked, synthetic_chain

MIB = 2**20


def _simulation_erring_above_the_model_except_at_the_floor(profile, floor_choices, error: int):
    """A simulation that puts every plan but the lowest-peak one `error` bytes above the linear model."""
    def simulate(choices) -> int:
        predicted = predict_peak(profile, choices).bytes
        return predicted if dict(choices) == dict(floor_choices) else predicted + error
    return simulate


def test_feasibility_is_monotonic_when_the_simulation_rejects_every_solve():
    """The 8-bit LoRA base's sweep: at a budget above the floor every solved plan simulated over it, the re-solves
    ran out, and the plan said DOES NOT FIT, while the lowest-peak choices (which fit a smaller budget) fit here too."""
    profile = synthetic_chain(6)
    floor = minimum_peak(profile, asked()).choices
    floor_peak = predict_peak(profile, floor).bytes
    simulate = _simulation_erring_above_the_model_except_at_the_floor(profile, floor, error=40 * MIB)
    keep_peak = predict_peak(profile, {u.name: u.base for u in profile.units}).bytes
    feasible = []
    for step in range(10):
        budget = floor_peak + (keep_peak - floor_peak) * step // 9
        result = search(profile, asked(budget), simulate=simulate)
        feasible.append(result.feasible)
        assert not result.feasible or result.simulated_peak_bytes <= budget
    assert all(feasible), feasible  # the floor fits every budget from the floor up


def test_a_resolve_lands_below_the_last_plan_by_what_the_model_missed():
    profile = synthetic_chain(6)
    floor = minimum_peak(profile, asked()).choices
    keep_peak = predict_peak(profile, {u.name: u.base for u in profile.units}).bytes
    error = 3 * MIB
    result = search(profile, asked(keep_peak), simulate=_simulation_erring_above_the_model_except_at_the_floor(profile, floor, error))
    assert result.feasible and result.simulated_peak_bytes <= keep_peak
    assert result.choices != dict(floor)  # a plan between the floor and no plan, found by tightening by the error


def test_the_slack_of_a_resolve_is_small_for_a_small_budget():
    assert resolve_slack(2_000_000) == 20_000
    assert resolve_slack(80 * 2**30) == MIB
