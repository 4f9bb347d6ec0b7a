"""The search around the ILP: solve, check the answer against a whole-step simulation, tighten, repeat.

The memory model is linear in the choices and the ILP trusts it; the simulation of the rewritten
model runs every op. When the simulation (or the model) puts a solved plan over the usable budget,
the budget the ILP sees is tightened by the overshoot and the program solved again, at most
MAX_RESOLVES times. The simulation is passed in as a function: it belongs to a later stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping

from autoplan.errors import OptionError, SolverTimeoutError
from autoplan.memory.model import predict_peak
from autoplan.axes.checkpoint import MODES, Mode
from autoplan.plan import Choice, Precision
from autoplan.profile.named_policies import NAMED_POLICIES
from autoplan.profile.profiler import Profile
from autoplan.vocabulary.names import match_units
from autoplan.solve.ilp import STOPPED_WITH_PLAN, LowestPeak, allowed_choices, minimum_peak, solve
from autoplan.solve.request import SolveRequest
from autoplan.solve import stacks

MAX_RESOLVES = 4
RESOLVE_SLACK_BYTES = 2**20  # tighten by the overshoot and a MiB more, so a re-solve cannot land on the same point


def resolve_slack(usable_bytes: int) -> int:
    """What a re-solve tightens by beyond the overshoot: a MiB, or a hundredth of a small budget (a MiB off a
    2 MB budget would jump below the floor, where a few KiB find the plan that fits)."""
    return min(RESOLVE_SLACK_BYTES, max(1, usable_bytes // 100))


@dataclass(frozen=True)
class SearchResult:
    choices: dict[str, Choice]  # the plan's choices; the lowest-peak ones when nothing fits
    feasible: bool  # the choices fit by the memory model and by the simulation
    simulated_peak_bytes: int  # the whole-step simulation of `choices`
    lowest_peak_bytes: int  # the lowest peak any allowed choice reaches (model and simulation agreeing)
    solver_status: str  # pulp's status of the last solve
    solve_time_s: float  # every solve together
    resolves: int  # how often the budget was tightened and the program solved again
    timed_out: bool = False  # the solver stopped at its time limit: the plan fits but may not be the fastest
    lowest_choices: Mapping[str, Choice] = dataclasses.field(default_factory=dict)  # the lowest-peak choices


def pinned_choices(
    units: list[str], precisions: tuple[Precision, ...], keep_fp32, checkpoint,
    profile: Profile | None = None,
) -> dict[str, tuple[Choice, ...]]:
    """Per unit, the choices the person allows (absent: any profiled choice). A unit pinned to a named policy
    (`profile.named_policies`) allows that policy's choices, one per precision, as `profile` measured them."""
    named_choices = {unit.name: tuple(c for c, words in unit.policies.items() if words.name) for unit in profile.units} if profile else {}
    modes: dict[str, tuple[Mode, ...]] = {}
    named: dict[str, str] = checkpoint_policies(units, checkpoint)
    for pattern, mode in requested_modes(checkpoint).items():
        if mode in MODES:
            for unit in match_units(units, [pattern], "checkpoint"):
                modes[unit] = (mode,)  # one of MODES (the check narrows its type)
    fp32_units = match_units(units, keep_fp32, "keep_fp32") if keep_fp32 else set()
    pins = {}
    for unit in units:
        unit_precisions: tuple[Precision, ...] = ("fp32",) if unit in fp32_units else precisions
        if unit in named:
            pins[unit] = tuple(c for c in named_choices.get(unit, ()) if c.precision in unit_precisions)
        else:
            pins[unit] = tuple(Choice(m, p) for p in unit_precisions for m in modes.get(unit, MODES))
    return pins


def requested_modes(checkpoint) -> dict[str, str]:
    """The `checkpoint` option as pattern -> mode or named policy, each checked."""
    if not checkpoint:
        return {}
    requested = checkpoint if isinstance(checkpoint, Mapping) else {p: "full" for p in ([checkpoint] if isinstance(checkpoint, str) else checkpoint)}
    for pattern, mode in requested.items():
        if mode not in MODES and mode not in NAMED_POLICIES:
            raise OptionError(f"checkpoint mode for {pattern!r} must be one of {MODES} or a named policy "
                              f"({', '.join(NAMED_POLICIES)}); got {mode!r}")
    return dict(requested)


def checkpoint_policies(units: list[str], checkpoint) -> dict[str, str]:
    """unit -> the named checkpoint policy `checkpoint` pins it to (`profile.named_policies`), for the profile to measure."""
    named: dict[str, str] = {}
    for pattern, mode in requested_modes(checkpoint).items():
        if mode in NAMED_POLICIES:
            named.update((unit, mode) for unit in match_units(units, [pattern], "checkpoint"))
    return named


def _floor(profile: Profile, request: SolveRequest, simulate, lowest_of: Callable[[Profile, SolveRequest], LowestPeak]):
    """The lowest-peak choices, their peak, and their simulated peak where it was needed (else None).

    A whole-step simulation is the slow part at scale: it runs only when it decides something.
    """
    lowest = lowest_of(profile, request)
    lowest_peak = predict_peak(profile, lowest.choices, request.mesh).bytes
    if lowest_peak <= request.usable_bytes:
        return lowest, lowest_peak, None
    # the linear model errs high where units' savings overlap; the whole-step simulation of
    # these very choices is what a real step does, so it decides the floor
    lowest_simulated = simulate(lowest.choices)
    if request.host is not None:
        lowest, lowest_simulated = _offload_floor(profile, request, simulate, (lowest, lowest_simulated, lowest_peak))
    if lowest_simulated > request.usable_bytes and not lowest.proven:
        limit = request.time_limit_s
        raise SolverTimeoutError(limit, f"the solver ran out of time ({limit:g} s) before it could tell "
                                 "whether any plan fits: raise time_limit_s (--time-limit on the command line)")
    return lowest, lowest_simulated, lowest_simulated


def _offload_floor(profile: Profile, request: SolveRequest, simulate, found):
    """With offload allowed, two more floor candidates, each simulated; the lowest of the three stays.

    - checkpointing and offloading every unit, as transformers' offload=True does by hand: the linear
      model counts a unit's input alive through the phase after it wherever no unit keeps it, so it
      cannot see every byte offload frees there;
    - where the simulation came out above the model (mixes of keep and full can share tensors the
      model does not see), the lowest-peak choices on the device alone: offload must not raise the floor.
    """
    lowest, lowest_simulated, lowest_peak = found
    candidates = [offloaded_by_hand(profile, request)]
    if lowest_simulated > lowest_peak:
        on_device = on_device_only(profile)
        candidates.append(dict(minimum_peak(on_device, request).choices))
    for choices in candidates:
        if choices is not None and choices != lowest.choices:
            simulated = simulate(choices)
            if simulated < lowest_simulated:
                lowest, lowest_simulated = dataclasses.replace(lowest, choices=choices), simulated
    return lowest, lowest_simulated


def on_device_only(profile: Profile) -> Profile:
    """`profile` without its host twins: the plan space with offload off."""
    units = tuple(dataclasses.replace(unit, options={c: cost for c, cost in unit.options.items() if not c.offloaded})
                  for unit in profile.units)
    return dataclasses.replace(profile, units=units)


def offloaded_by_hand(profile: Profile, request: SolveRequest) -> dict[str, Choice] | None:
    """Every unit checkpointed (full), its inputs in host memory while the host budget lasts: the allowed
    choice that keeps least of each. None where a unit may not be checkpointed."""
    choices, host = {}, 0
    budget = request.host.budget_bytes if request.host is not None else 0
    for unit, options in zip(profile.units, allowed_choices(profile, request.pins)):
        full = [c for c in options if c.mode == "full"]
        if not full:
            return None
        hosted = [c for c in full if c.offloaded and host + unit.options[c].host_bytes <= budget]
        choice = min(hosted or full, key=lambda c: (unit.options[c].held_bytes, unit.options[c].bwd_peak_bytes, unit.options[c].time_s))
        host += unit.options[choice].host_bytes
        choices[unit.name] = choice
    return choices


@dataclass(frozen=True)
class _Checked:
    choices: Mapping[str, Choice]
    simulated_peak: int
    predicted: int
    fits: bool


def _proposals(profile: Profile, request: SolveRequest, solved: Mapping[str, Choice], side_by_side: bool) -> list[tuple[Mapping[str, Choice], int]]:
    """The solved choices to simulate, each with its predicted peak, in order: first ordered side by side
    (`solve.stacks`) where that moves any and the memory model predicts it no higher, then as solved."""
    as_solved = (solved, predict_peak(profile, solved, request.mesh).bytes)
    ordered = stacks.side_by_side(profile, solved) if side_by_side else dict(solved)
    if ordered == dict(solved):
        return [as_solved]
    predicted = predict_peak(profile, ordered, request.mesh).bytes
    return [(ordered, predicted), as_solved] if predicted <= as_solved[1] else [as_solved]


def _first_fitting(request: SolveRequest, simulate, proposals: list[tuple[Mapping[str, Choice], int]]) -> _Checked:
    """The first proposal whose simulated and predicted peaks both fit; else the last one's figures (the solved order)."""
    checked = None
    for choices, predicted in proposals:
        simulated_peak = simulate(choices)
        checked = _Checked(choices, simulated_peak, predicted, simulated_peak <= request.usable_bytes and predicted <= request.usable_bytes)
        if checked.fits:
            return checked
    assert checked is not None  # one proposal at least
    return checked


def search(profile: Profile, request: SolveRequest, *, simulate: Callable[[Mapping[str, Choice]], int],
           progress: Callable[[str], None] | None = None,
           lowest_of: Callable[[Profile, SolveRequest], LowestPeak] = minimum_peak, side_by_side: bool = False) -> SearchResult:
    """The fastest choices whose predicted and simulated peaks both fit the request's usable bytes.

    `simulate(choices)` returns the simulated peak of a training step with those choices. When the
    solver runs out of time, the answer is still one the memory model and the simulation agree fits
    (the lowest-peak choices, or the best the solver held), with `timed_out` set; a time-out that
    leaves it unknown whether anything fits is a SolverTimeoutError, never "does not fit". `lowest_of` solves
    for the lowest-peak choices (`ilp.minimum_peak`, which no budget changes: a Planner keeps its answer).
    """
    say = progress or (lambda message: None)
    say("solving")
    usable_bytes = request.usable_bytes
    lowest, lowest_peak, lowest_simulated = _floor(profile, request, simulate, lowest_of)
    solve_time = lowest.solve_time_s

    margin, resolves, status, timed_out = 0, 0, "Infeasible", False
    chosen, simulated, feasible = lowest.choices, lowest_simulated, False
    while lowest_peak <= usable_bytes and resolves <= MAX_RESOLVES:
        try:
            solution = solve(profile, request, margin)
        except SolverTimeoutError:
            status, timed_out = "Not Solved (time limit)", True
            break
        solve_time += solution.solve_time_s
        status = solution.status
        timed_out = timed_out or status == STOPPED_WITH_PLAN
        if not solution.feasible:
            break
        say("verifying the plan with a simulated training step")
        fitting = _first_fitting(request, simulate, _proposals(profile, request, solution.choices, side_by_side))
        if fitting.fits:
            chosen, simulated, feasible = fitting.choices, fitting.simulated_peak, True
            break
        simulated_peak, predicted = fitting.simulated_peak, fitting.predicted
        # the next solve must land below this one (else it returns it again), and below the usable budget by as
        # much as the linear model erred here: plans near this one err alike
        error = max(simulated_peak - predicted, 0)
        margin = max(margin, usable_bytes - min(predicted, usable_bytes - error)) + resolve_slack(usable_bytes)
        resolves += 1
    if not feasible and lowest_simulated is None and lowest_peak <= usable_bytes and not timed_out:
        # every solve the simulation put over: the lowest-peak choices are the same at every budget, so if they fit
        # a smaller budget they fit this one; checked whole here, more memory never turns a fit into no fit
        say("verifying the lowest-peak plan with a simulated training step")
        lowest_simulated = simulate(lowest.choices)
        lowest_peak = max(lowest_peak, lowest_simulated)
    if not feasible and lowest_simulated is not None and lowest_simulated <= usable_bytes:
        chosen, simulated, feasible = lowest.choices, lowest_simulated, True  # no solution the linear model admits, but these fit
    if not feasible and timed_out and lowest_peak <= usable_bytes:
        # out of time before a faster plan that fits: the lowest-peak choices fit by the model; check them whole
        say("verifying the lowest-peak plan with a simulated training step")
        simulated = simulate(lowest.choices)
        chosen, feasible = lowest.choices, simulated <= usable_bytes
        lowest_peak = max(lowest_peak, simulated)
    if simulated is None:  # nothing fitted after all: report the lowest-peak choices as simulated
        simulated = lowest_simulated if lowest_simulated is not None else simulate(lowest.choices)
        lowest_peak = max(lowest_peak, simulated)
    return SearchResult(dict(chosen), feasible, simulated, lowest_peak, status, solve_time, resolves, timed_out,
                        dict(lowest.choices))
