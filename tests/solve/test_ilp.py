"""Tests for autoplan.solve: the integer program on synthetic chains whose optimum is known.

Every profile here is built by `synthetic_chain` (the only place that constructs Profile,
Timeline, UnitProfile and UnitCost objects), so a change to those internals is one edit.
Sizes are given in MiB and turned into bytes there; budgets sit half a MiB away from any
reachable peak, so the solver's tolerances never decide a test.
"""

from __future__ import annotations

import itertools
import random
import time
import warnings
from typing import Sequence

import pytest

from autoplan.inputs.budget import Budget
from autoplan.inputs.devices import get_device
from autoplan.memory.model import live_bytes, points, predict_peak, predict_step_time
from autoplan.plan import BACKWARD_START, FORWARD_START, OPTIMIZER_STEP, ZERO_GRAD, Phase, Choice
from autoplan.profile.profiler import Profile, UnitCost, UnitProfile
from autoplan.solve.ilp import Solution, allowed_choices, check, fastest, minimum_peak, solve
from autoplan.solve.request import SolveRequest
from autoplan.profile.recorder import Boundary
from autoplan.profile.timeline import PhaseSample, StaticBytes, Timeline
from autoplan.units import ModuleUnit

MIB = 2**20
HALF = MIB // 2


def asked(usable_bytes: int = 10**15, **rules) -> SolveRequest:
    """A solve request for `usable_bytes` (no reserve), with the rules given (pins, time limit, mesh, host memory)."""
    return SolveRequest(Budget(usable_bytes, 0, f"{usable_bytes}B"), **rules)
KEEP, SEL, FULL = Choice("keep", "fp32"), Choice("selective", "fp32"), Choice("full", "fp32")


def _per_unit(value, n: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


def synthetic_chain(
    n: int,
    keep_held: float | Sequence[float] = 10,
    full_held: float | Sequence[float] = 1,
    keep_time: float | Sequence[float] = 1.0,
    full_time: float | Sequence[float] = 1.3,
    *,
    static: float = 100,
    keep_fwd: float | Sequence[float] = 1,
    keep_bwd: float | Sequence[float] = 2,
    full_bwd: float | Sequence[float] | None = None,
    selective: tuple | None = None,
    low_precision: bool = False,
    optimizer_transient: float = 0,
    passed: Sequence[tuple[int, tuple[int, ...], float]] = (),
    holds: dict[Choice, tuple[bool, bool]] | None = None,
) -> Profile:
    """A chain of `n` units u0..u{n-1}, each with options keep/fp32 and full/fp32 (more on request).

    Sizes are MiB (per unit: a number or a list). The timeline is the step with every unit at
    keep/fp32: static bytes `static`, plus in forward the kept bytes of the units already run (and
    the running unit's forward transient), in backward the kept bytes of the units not yet
    differentiated (and the running unit's backward transient); optimizer and zero_grad see only
    the static bytes (plus `optimizer_transient`).

    full_bwd: the backward transient of a fully checkpointed unit (default: keep_bwd + keep_held,
    the recomputed activations). selective: (held, bwd, time) of an extra selective/fp32 option.
    low_precision: add bf16 twins of every option with half the bytes and 0.6 of the time.
    passed: tensors handed between units, as (producer, consumers, MiB); holds[choice] says whether
    a unit in that choice keeps its (inputs, outputs) alive, default: keep keeps both, checkpointed
    modes keep their inputs only.
    """
    keep_held, full_held = _per_unit(keep_held, n), _per_unit(full_held, n)
    keep_time, full_time = _per_unit(keep_time, n), _per_unit(full_time, n)
    keep_fwd, keep_bwd = _per_unit(keep_fwd, n), _per_unit(keep_bwd, n)
    full_bwd = [kb + kh for kb, kh in zip(keep_bwd, keep_held)] if full_bwd is None else _per_unit(full_bwd, n)
    holds = holds or {KEEP: (True, True), SEL: (True, False), FULL: (True, False)}
    names = [f"u{i}" for i in range(n)]

    def mib(value: float) -> int:
        return int(round(value * MIB))

    def cost(held: float, fwd: float, bwd: float, seconds: float, flags: tuple[bool, bool], bwd_flops: int) -> UnitCost:
        return UnitCost(
            fwd_peak_bytes=mib(fwd),
            held_bytes=mib(held),
            bwd_peak_bytes=mib(bwd),
            fwd_time_s=seconds / 3,
            bwd_time_s=seconds - seconds / 3,
            fwd_flops=1000,
            bwd_flops=bwd_flops,
            holds_inputs=(flags[0],) * 4,
            holds_outputs=(flags[1],) * 4,
        )

    units = []
    for i, name in enumerate(names):
        options = {
            KEEP: cost(keep_held[i], keep_fwd[i], keep_bwd[i], keep_time[i], holds[KEEP], 2000),
            FULL: cost(full_held[i], keep_fwd[i], full_bwd[i], full_time[i], holds[FULL], 3000),
        }
        if selective is not None:
            held, bwd, seconds = (_per_unit(v, n)[i] for v in selective)
            options[SEL] = cost(held, keep_fwd[i], bwd, seconds, holds[SEL], 2500)
        if low_precision:
            for choice, c in list(options.items()):
                options[Choice(choice.mode, "bf16")] = UnitCost(
                    c.fwd_peak_bytes // 2, c.held_bytes // 2, c.bwd_peak_bytes // 2,
                    c.fwd_time_s * 0.6, c.bwd_time_s * 0.6, c.fwd_flops, c.bwd_flops,
                    c.holds_inputs, c.holds_outputs,
                )
        units.append(UnitProfile(ModuleUnit(name), options, KEEP))

    def phase(label: Phase, start: float, peak: float, seconds: float = 0.0) -> PhaseSample:
        return PhaseSample(label, mib(start), mib(peak), 0, seconds, 0)

    phases = [phase(FORWARD_START, static, static)]
    held = static
    for i, name in enumerate(names):
        phases.append(phase(Phase("fwd", name), held, held + keep_fwd[i], keep_time[i] / 3))
        held += keep_held[i]
        phases.append(phase(Phase("fwd", name, "after"), held, held))
    phases.append(phase(BACKWARD_START, held, held))
    for i in reversed(range(n)):
        name = names[i]
        phases.append(phase(Phase("bwd", name), held, held + keep_bwd[i], keep_time[i] - keep_time[i] / 3))
        held -= keep_held[i]
        phases.append(phase(Phase("bwd", name, "after"), held, held))
    phases.append(phase(OPTIMIZER_STEP, static, static + optimizer_transient))
    phases.append(phase(ZERO_GRAD, static, static))

    boundaries = tuple(
        Boundary(
            key=k + 1,
            bytes=mib(size),
            producer=(names[producer], 0),
            consumers=tuple((names[c], j) for j, c in enumerate(consumers)),
            held_by_rest=False,
        )
        for k, (producer, consumers, size) in enumerate(passed)
    )
    static_bytes = StaticBytes(parameters=mib(static) // 2, gradients=0, optimizer=mib(static) // 2, inputs=0)
    timeline = Timeline(tuple(phases), max(p.peak_bytes for p in phases), (), static_bytes, boundaries)
    return Profile(
        model_name="SyntheticChain",
        device=get_device("h100-80gb"),
        optimizer="adamw",
        rest_precision="fp32",
        timeline=timeline,
        reference=timeline,
        units=tuple(units),
        trace_method="symbolic_trace",
        skip_edges=(),
    )


# -- helpers ----------------------------------------------------------------------------------


def keep_peak(profile: Profile) -> int:
    return predict_peak(profile, {u.name: u.base for u in profile.units}).bytes


def step_time(profile: Profile, choices) -> float:
    return sum(unit.options[choices[unit.name]].time_s for unit in profile.units)


def brute_force(profile: Profile, usable: int, pins=None) -> tuple[float | None, int]:
    """(least step time over every assignment that fits, lowest peak of any assignment)."""
    options = allowed_choices(profile, pins)
    best, lowest = None, None
    for combo in itertools.product(*options):
        choices = {unit.name: c for unit, c in zip(profile.units, combo)}
        peak = predict_peak(profile, choices).bytes
        lowest = peak if lowest is None else min(lowest, peak)
        if peak <= usable:
            seconds = step_time(profile, choices)
            best = seconds if best is None else min(best, seconds)
    return best, lowest


def count(choices, choice: Choice) -> int:
    return sum(c == choice for c in choices.values())


# -- the synthetic chain itself ---------------------------------------------------------------


def test_synthetic_chain_timeline_is_the_keep_step() -> None:
    profile = synthetic_chain(4)
    names = [p.name for p in profile.timeline.phases]
    assert names[:3] == ["fwd:start", "fwd:u0", "fwd:after u0"]
    assert names[-4:] == ["bwd:u0", "bwd:after u0", "optimizer", "zero_grad"]
    assert names.index("bwd:start") == 1 + 2 * 4
    # base choices reproduce the timeline exactly
    base = {u.name: u.base for u in profile.units}
    assert live_bytes(profile, base) == [p.peak_bytes for p in profile.timeline.phases]
    # static 100 + 4 x 10 kept + 2 transient of the last unit's backward
    assert keep_peak(profile) == 142 * MIB
    assert predict_step_time(profile, base) == pytest.approx(4 * 1.0)
    assert len(points(profile)) == len(names)


def test_memory_model_arithmetic_on_the_chain() -> None:
    """peak = S + B + H + sum of held bytes of u0..u{n-2} + F if the last unit is full."""
    n, profile = 6, synthetic_chain(6)
    for combo in itertools.product([KEEP, FULL], repeat=n):
        choices = dict(zip([f"u{i}" for i in range(n)], combo))
        held = sum(10 if c == KEEP else 1 for c in combo[:-1])
        expected = 100 + 2 + 10 + held + (1 if combo[-1] == FULL else 0)
        assert predict_peak(profile, choices).bytes == expected * MIB, combo


# -- solve ------------------------------------------------------------------------------------


def test_generous_budget_keeps_everything() -> None:
    profile = synthetic_chain(8)
    for usable in (keep_peak(profile), keep_peak(profile) + HALF, 10**12):
        solution = solve(profile, asked(usable))
        assert isinstance(solution, Solution)
        assert solution.feasible and solution.status == "Optimal"
        assert dict(solution.choices) == {f"u{i}": KEEP for i in range(8)}
        assert solution.solve_time_s > 0


@pytest.mark.parametrize("k", range(0, 8))
def test_tight_budget_checkpoints_the_least_number_of_units(k: int) -> None:
    """Each full unit among u0..u6 saves 9 MiB; the last never helps (its recompute is at the peak)."""
    n = 8
    profile = synthetic_chain(n, keep_held=10, full_held=1, keep_time=1.0, full_time=1.3)
    usable = keep_peak(profile) - k * 9 * MIB + HALF
    solution = solve(profile, asked(usable))
    assert solution.feasible
    choices = solution.choices
    assert set(choices) == {f"u{i}" for i in range(n)}
    assert count(choices, FULL) == k
    assert count(choices, KEEP) == n - k
    assert choices[f"u{n - 1}"] == KEEP
    assert predict_peak(profile, choices).bytes <= usable
    assert check(profile, choices, usable)
    assert step_time(profile, choices) == pytest.approx(n * 1.0 + k * 0.3)


def test_budget_below_the_lowest_peak_is_infeasible() -> None:
    n = 8
    profile = synthetic_chain(n)
    lowest = (100 + 2 + 10 + (n - 1) * 1) * MIB  # all but the last unit full
    assert solve(profile, asked(lowest + HALF)).feasible
    solution = solve(profile, asked(lowest - HALF))
    assert solution.feasible is False
    assert solution.choices == {}
    assert solution.status != "Optimal"
    assert not check(profile, {f"u{i}": FULL for i in range(n)}, lowest - HALF)


def test_budget_below_static_memory_is_infeasible() -> None:
    solution = solve(synthetic_chain(4), asked(50 * MIB))
    assert not solution.feasible and solution.choices == {}


def random_chain(seed: int, n: int, *, three_modes: bool = False, passed: bool = False) -> Profile:
    rng = random.Random(seed)
    keep_held = [rng.randint(4, 20) for _ in range(n)]
    full_held = [rng.randint(0, 3) for _ in range(n)]
    # times in tenths of a second: distinct totals differ by >= 0.1, far above the solver's gap
    keep_time = [rng.randint(5, 15) / 10 for _ in range(n)]
    full_time = [t + rng.randint(1, 6) / 10 for t in keep_time]
    keep_bwd = [rng.randint(0, 6) for _ in range(n)]
    extra = {}
    if three_modes:
        sel_held = [f + (k - f) // 2 for k, f in zip(keep_held, full_held)]
        sel_bwd = [b + (k - s) for b, k, s in zip(keep_bwd, keep_held, sel_held)]
        sel_time = [round(k + (f - k) * rng.choice([0.2, 0.5]), 2) for k, f in zip(keep_time, full_time)]
        extra["selective"] = (sel_held, sel_bwd, sel_time)
    if passed:
        tensors = [(i, (i + 1,), rng.randint(1, 5)) for i in range(n - 1)]
        tensors += [(0, (n - 1,), 7), (1, (n - 2,), 3)]  # two skips, U-Net style
        extra["passed"] = tensors
        holds = {KEEP: (True, rng.random() < 0.5), SEL: (True, False), FULL: (True, False)}
        extra["holds"] = holds
    return synthetic_chain(
        n, keep_held, full_held, keep_time, full_time, keep_bwd=keep_bwd, static=rng.randint(50, 200), **extra
    )


def _assert_solver_matches_brute_force(profile: Profile, fractions=(0.0, 0.2, 0.5, 0.8, 1.0), pins=None) -> None:
    _, lowest = brute_force(profile, 0, pins)
    top = max(keep_peak(profile), lowest)
    for fraction in fractions:
        usable = (lowest + int(fraction * (top - lowest))) // MIB * MIB + HALF
        best, _ = brute_force(profile, usable, pins)
        solution = solve(profile, asked(usable, pins=pins))
        if best is None:
            assert not solution.feasible, fraction
            continue
        assert solution.feasible, (fraction, usable, best)
        assert predict_peak(profile, solution.choices).bytes <= usable
        assert step_time(profile, solution.choices) == pytest.approx(best, abs=1e-9), fraction
    # just under the lowest peak nothing fits
    assert not solve(profile, asked(lowest - HALF, pins=pins)).feasible


@pytest.mark.slow  # hundreds of solves against brute force
@pytest.mark.parametrize(("seed", "n"), [(0, 4), (1, 6), (2, 8), (3, 10)])
def test_solver_matches_brute_force_keep_or_full(seed: int, n: int) -> None:
    _assert_solver_matches_brute_force(random_chain(seed, n))


@pytest.mark.slow  # hundreds of solves against brute force
@pytest.mark.parametrize(("seed", "n"), [(5, 6), (13, 5)])
def test_solver_matches_brute_force_three_modes(seed: int, n: int) -> None:
    _assert_solver_matches_brute_force(random_chain(seed, n, three_modes=True))


@pytest.mark.parametrize(
    ("seed", "n", "three_modes", "passed", "fraction", "best", "cbc_answered"),
    [
        (4, 4, True, False, 0.2, 4.2, 4.52),
        (101, 5, False, True, 0.7, 4.6, 4.9),
        (123, 5, False, True, 0.7, 4.4, 4.8),
        (123, 5, True, True, 0.1, 5.26, 5.3),
        (130, 5, True, False, 0.1, 7.5, 7.7),
        (138, 5, True, False, 0.1, 5.22, 5.45),
    ],
)
def test_solver_is_optimal_where_cbc_preprocessing_was_not(seed, n, three_modes, passed, fraction, best, cbc_answered) -> None:
    """Regression: CBC 2.10's preprocessing fixed variables of these programs wrongly and reported
    the slower plans `cbc_answered` as 'Optimal'; solve() now runs HiGHS, or CBC without preprocessing."""
    profile = random_chain(seed, n, three_modes=three_modes, passed=passed)
    _, lowest = brute_force(profile, 0)
    usable = (lowest + int(fraction * (keep_peak(profile) - lowest))) // MIB * MIB + HALF
    assert brute_force(profile, usable)[0] == pytest.approx(best)
    solution = solve(profile, asked(usable))
    assert solution.feasible
    assert step_time(profile, solution.choices) == pytest.approx(best, abs=1e-9)
    assert step_time(profile, solution.choices) < cbc_answered


@pytest.mark.slow  # hundreds of solves against brute force
@pytest.mark.parametrize(("seed", "n", "three_modes", "passed"), [(2, 8, False, False), (5, 6, True, False), (7, 7, False, True)])
def test_cbc_fallback_matches_brute_force(monkeypatch, seed, n, three_modes, passed) -> None:
    """Without a highspy wheel the solver is pulp's CBC; its plans are as optimal."""
    import pulp

    monkeypatch.setattr(pulp.HiGHS, "available", lambda self: False)
    used = []
    monkeypatch.setattr(pulp.COIN_CMD, "actualSolve", _recording(pulp.COIN_CMD.actualSolve, used))
    _assert_solver_matches_brute_force(random_chain(seed, n, three_modes=three_modes, passed=passed))
    assert used, "the fallback never ran CBC"


def _recording(method, calls: list):
    def recorded(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return method(self, *args, **kwargs)

    return recorded


def test_highs_is_the_solver_when_highspy_imports(monkeypatch) -> None:
    import pulp

    used = []
    monkeypatch.setattr(pulp.HiGHS, "actualSolve", _recording(pulp.HiGHS.actualSolve, used))
    profile = random_chain(3, 6, three_modes=True)
    assert solve(profile, asked(keep_peak(profile))).feasible and used == ["HiGHS"]


@pytest.mark.parametrize(("seed", "n"), [(6, 5), (7, 7), (8, 8)])
def test_solver_matches_brute_force_with_tensors_passed_between_units(seed: int, n: int) -> None:
    _assert_solver_matches_brute_force(random_chain(seed, n, passed=True))


def test_solver_matches_brute_force_under_pins() -> None:
    profile = random_chain(9, 7)
    pins = {"u2": (KEEP,), "u5": (FULL,)}
    _assert_solver_matches_brute_force(profile, pins=pins)


def test_low_precision_options_are_picked_when_faster() -> None:
    profile = synthetic_chain(6, low_precision=True)
    solution = solve(profile, asked(10**12))
    assert solution.feasible
    assert all(c == Choice("keep", "bf16") for c in solution.choices.values())
    assert fastest(profile) == dict(solution.choices)


# -- minimum_peak -----------------------------------------------------------------------------


def test_minimum_peak_is_all_full_when_full_always_saves_memory() -> None:
    # recomputation does not raise the backward transient: every full unit lowers every peak
    profile = synthetic_chain(6, full_bwd=2)
    lowest = minimum_peak(profile, asked())
    choices, seconds = lowest.choices, lowest.solve_time_s
    assert choices == {f"u{i}": FULL for i in range(6)} and lowest.proven
    assert seconds >= 0
    assert predict_peak(profile, choices).bytes == (100 + 6 * 1 + 2) * MIB


def test_minimum_peak_keeps_the_unit_whose_recompute_sits_at_the_peak() -> None:
    profile = synthetic_chain(6)
    choices = minimum_peak(profile, asked()).choices
    assert choices == {**{f"u{i}": FULL for i in range(5)}, "u5": KEEP}


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_minimum_peak_matches_brute_force(seed: int) -> None:
    profile = random_chain(seed, 7, passed=seed == 12)
    _, lowest = brute_force(profile, 0)
    choices = minimum_peak(profile, asked()).choices
    assert predict_peak(profile, choices).bytes == lowest


def test_minimum_peak_prefers_the_fastest_among_equal_peaks() -> None:
    # the last unit is never at the peak when full_bwd is small and the others are full;
    # making u0 full or keep both leave the peak where it is only if its held bytes do not matter.
    profile = synthetic_chain(3, keep_held=[10, 10, 10], full_held=[1, 1, 1], full_bwd=[2, 2, 30])
    choices = minimum_peak(profile, asked()).choices
    peak = predict_peak(profile, choices).bytes
    # every alternative with the same peak is no faster
    for combo in itertools.product([KEEP, FULL], repeat=3):
        other = dict(zip(["u0", "u1", "u2"], combo))
        if predict_peak(profile, other).bytes == peak:
            assert step_time(profile, choices) <= step_time(profile, other) + 1e-9


# -- pins -------------------------------------------------------------------------------------


def test_pinned_keep_stays_keep_and_others_go_full() -> None:
    n, k = 8, 3
    profile = synthetic_chain(n)
    usable = keep_peak(profile) - k * 9 * MIB + HALF
    free = solve(profile, asked(usable))
    assert free.feasible
    # pin keep on units the free solution checkpointed: others must take their place
    pinned_units = [name for name, c in free.choices.items() if c == FULL][:2]
    pins = {name: (KEEP,) for name in pinned_units}
    solution = solve(profile, asked(usable, pins=pins))
    assert solution.feasible
    for name in pinned_units:
        assert solution.choices[name] == KEEP
    assert count(solution.choices, FULL) == k
    assert solution.choices[f"u{n - 1}"] == KEEP
    assert predict_peak(profile, solution.choices).bytes <= usable


def test_pins_that_cannot_fit_are_infeasible() -> None:
    n = 6
    profile = synthetic_chain(n)
    usable = keep_peak(profile) - 2 * 9 * MIB + HALF
    assert solve(profile, asked(usable)).feasible
    # u0..u4 pinned keep: only u5 could go full, and that never helps
    pins = {f"u{i}": (KEEP,) for i in range(n - 1)}
    assert not solve(profile, asked(usable, pins=pins)).feasible


def test_pinned_full_is_full_even_when_memory_is_plentiful() -> None:
    profile = synthetic_chain(5)
    solution = solve(profile, asked(10**12, pins={"u3": (FULL,)}))
    assert solution.choices == {"u0": KEEP, "u1": KEEP, "u2": KEEP, "u3": FULL, "u4": KEEP}
    assert fastest(profile, {"u3": (FULL,)})["u3"] == FULL
    choices = minimum_peak(profile, asked(pins={"u0": (KEEP,)})).choices
    assert choices["u0"] == KEEP


def test_pins_leaving_no_option_raise_value_error() -> None:
    profile = synthetic_chain(4)  # options are keep/fp32 and full/fp32 only
    pins = {"u1": (Choice("keep", "bf16"),)}
    with pytest.raises(ValueError, match="u1"):
        allowed_choices(profile, pins)
    with pytest.raises(ValueError, match="u1"):
        solve(profile, asked(10**12, pins=pins))
    with pytest.raises(ValueError, match="u1"):
        minimum_peak(profile, asked(pins=pins))
    with pytest.raises(ValueError, match="u1"):
        fastest(profile, pins)
    with pytest.raises(ValueError):
        allowed_choices(profile, {"u0": ()})


def test_allowed_choices_filters_and_keeps_profile_order() -> None:
    profile = synthetic_chain(3, selective=(5, 7, 1.1))
    allowed = allowed_choices(profile)
    assert len(allowed) == 3
    assert all(set(options) == {KEEP, SEL, FULL} for options in allowed)
    allowed = allowed_choices(profile, {"u1": (FULL, SEL), "nonexistent": (KEEP,)})
    assert set(allowed[1]) == {FULL, SEL}
    assert set(allowed[0]) == set(allowed[2]) == {KEEP, SEL, FULL}


def test_fastest_ignores_memory() -> None:
    profile = synthetic_chain(5, selective=(5, 7, 1.1))
    assert fastest(profile) == {f"u{i}": KEEP for i in range(5)}
    # when checkpointing is (oddly) faster, fastest takes it
    profile = synthetic_chain(3, keep_time=2.0, full_time=1.0)
    assert fastest(profile) == {f"u{i}": FULL for i in range(3)}


def test_equal_times_prefer_less_rewriting() -> None:
    profile = synthetic_chain(4, keep_time=1.0, full_time=1.0)
    solution = solve(profile, asked(10**12))
    assert all(c == KEEP for c in solution.choices.values())


def test_solver_uses_the_current_pulp_api() -> None:
    """PuLP 3.3 warns on old constructors; autoplan uses the current API."""
    profile = synthetic_chain(4, selective=(5, 7, 1.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert solve(profile, asked(keep_peak(profile) - 9 * MIB)).feasible
        minimum_peak(profile, asked())


# -- solve time -------------------------------------------------------------------------------


def test_solve_time_96_unit_chain_under_5_seconds() -> None:
    """Not a benchmark: a 96-block model (six choices per block) must plan in interactive time."""
    n = 96
    profile = synthetic_chain(
        n,
        keep_held=[10 + i % 7 for i in range(n)],
        full_held=1,
        keep_time=[1.0 + (i % 5) / 10 for i in range(n)],
        full_time=[1.3 + (i % 5) / 10 for i in range(n)],
        selective=(4, 8, [1.1 + (i % 5) / 10 for i in range(n)]),
        low_precision=True,
    )
    top = keep_peak(profile)
    started = time.perf_counter()
    solution = solve(profile, asked(top - (top - 100 * MIB) // 2, time_limit_s=10))
    elapsed = time.perf_counter() - started
    assert solution.feasible
    assert predict_peak(profile, solution.choices).bytes <= top - (top - 100 * MIB) // 2
    assert elapsed < 5.0, f"96-unit solve took {elapsed:.2f}s"
    started = time.perf_counter()
    minimum_peak(profile, asked())
    assert time.perf_counter() - started < 5.0
