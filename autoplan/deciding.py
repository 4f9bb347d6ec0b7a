"""A profile's plan at one budget: the search, the whole-step simulations that check it, the allocator's fit.

`decide_loss_head` plans one level of units (`planner.ProfiledLevel`) for one request, with the loss head as the
profile's timeline runs it and, where it can be fused, the other way too. A Planner keeps, per loss head and mesh,
what no budget changes (`memo`): every step simulated, each least limit replayed, the lowest-peak solve.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

from autoplan.inputs.devices import Device
from autoplan.inputs.settings import StepOptions
from autoplan.memory.model import predict_peak, predict_step_time
from autoplan.memory.sharded import phase_offsets
from autoplan.memory.segment_terms import choices_by_unit
from autoplan.plan import Choice, Plan, WorldSizePoint
from autoplan.profile.profiler import Profile
from autoplan.solve.allocator_fit import allocator_floor, allocator_floor_of, allocator_room, fit_allocator
from autoplan.solve.assemble import HeadFigures, assemble_plan, faster_loss_head, with_both_heads_figures
from autoplan.solve.ilp import LowestPeak, fastest, minimum_peak
from autoplan.solve.request import SolveRequest
from autoplan.solve.search import offloaded_by_hand, search
from autoplan.solve.worlds import fewest_gpus, points_key
from autoplan.trace.tracer import Traced
from autoplan.verify.simulate import Simulation, reserved_peak, simulate_plan, simulation_of
from autoplan.vocabulary.formatting import format_bytes


def decide(traced: Traced, measured: Profile, request: SolveRequest, step: StepOptions, say, memo: dict | None = None) -> Plan:
    """The solve and verify stages on a profile: the mesh, the searched choices, the Plan. `memo`: the simulations of
    earlier budgets (`ProfiledLevel.simulated`), by the loss head and the mesh they were run for."""
    curve: tuple[WorldSizePoint, ...] = ()
    if request.fewest_ranks:
        say("finding the smallest number of GPUs")
        kept = memo.setdefault(points_key(measured, request), {}) if memo is not None else None
        mesh, curve = fewest_gpus(measured, request, points=kept)
        request = dataclasses.replace(request, mesh=mesh)
    offsets, extras = phase_offsets(measured, request.mesh)
    simulations, leasts, floors = _memo_of(measured, request, memo if memo is not None else {})
    simulate = _simulator(traced, measured, step, simulations, offsets, extras)
    least_of = _least_limits(measured, request, simulations, simulate, replays_allocator=_replays_allocator(measured, offsets), leasts=leasts)

    def lowest_of(profile: Profile, asked: SolveRequest) -> LowestPeak:
        if "floor" not in floors:
            floors["floor"] = minimum_peak(profile, asked)
            return floors["floor"]
        return dataclasses.replace(floors["floor"], solve_time_s=0.0)  # kept, not solved again: no solver time this plan

    # a deep stack's choices side by side where its step is then simulated a few layers deep (not one GPU's: solve.stacks)
    searched = functools.partial(search, measured, simulate=simulate, progress=say, lowest_of=lowest_of,
                                 side_by_side=not _replays_allocator(measured, offsets))
    fit = fit_allocator(searched(request), request, measured.device, least_of=least_of, simulate=simulate, search_again=searched)
    found = fit.found
    decided = assemble_plan(measured, traced, found, request)
    chosen, predicted = frozenset(found.choices.items()), decided.prediction
    simulation = simulations.get(chosen)
    raised = functools.partial(reserved_peak, predicted.peak_bytes, predicted.simulated_peak_bytes)
    floor = max(predicted.minimum_budget_bytes, allocator_floor(found, request.budget, measured.device, least_of))
    simulated = dataclasses.replace(predicted, world_size_curve=curve, simulated_host_peak_bytes=simulation.host_peak_bytes if simulation else 0,
                                    reserved_peak_bytes=raised(simulation.reserved_bytes if simulation else 0),
                                    least_limit_bytes=fit.least_limit_bytes, minimum_budget_bytes=floor)
    # a plan that does not fit says so in its verdict; the notes are for one that fits by its allocated bytes
    notes = reserved_notes(simulated, request, measured.device, fit.passed_over_least_bytes) if decided.outcome.feasible else ()
    return dataclasses.replace(decided, prediction=simulated, notes=decided.notes + notes)


def _memo_of(measured: Profile, request: SolveRequest, memo: dict) -> tuple[dict[frozenset, Simulation], dict[frozenset, int], dict[str, LowestPeak]]:
    """What a Planner keeps of `measured`'s head on the request's mesh: each simulated step by its choices (the
    reserved memory replayed for the chosen one only), each least limit, and the lowest-peak solve (no budget changes it)."""
    return memo.setdefault((measured.timeline.fused_loss, request.mesh), ({}, {}, {}))


def _simulator(traced: Traced, measured: Profile, step: StepOptions, simulations: dict[frozenset, Simulation],
               offsets: Mapping, extras: Mapping):
    """choices -> the simulated peak of their whole step, each simulated once (kept in `simulations`); per rank by the
    mesh's `offsets` and `extras` (`memory.sharded.phase_offsets`)."""
    base = frozenset((unit.name, unit.base) for unit in measured.units)  # the profile's timeline is that step, simulated
    simulations.setdefault(base, simulation_of(measured.timeline, offsets, extras))

    def simulate(choices: Mapping[str, Choice]) -> int:
        key = frozenset(choices.items())
        if key not in simulations:  # the same choices simulate the same step
            simulations[key] = simulate_plan(
                traced, choices_by_unit(measured, choices), device=measured.device, optimizer=step.optimizer,
                rest_precision=measured.rest_precision, loss_fn=step.loss_fn, rank_offsets=offsets, loop=measured.loop,
                fused_loss=measured.timeline.fused_loss, start_extras=extras,
                shortcut=not _replays_allocator(measured, offsets),  # its shortened steps make no allocation log
            )
        return simulations[key].peak_bytes

    return simulate


def _replays_allocator(measured: Profile, offsets: Mapping) -> bool:
    """Whether a plan's steps are replayed through the caching allocator's model: one GPU (a CPU target has no such
    allocator; per rank, FSDP's gathers and frees are not in the step's allocation log)."""
    return measured.device.kind == "cuda" and not any(offsets.values())


def _least_limits(measured: Profile, request: SolveRequest, simulations: dict[frozenset, Simulation], simulate,
                  replays_allocator: bool, leasts: dict[frozenset, int]):
    """choices -> their least limit (`Simulation.least_limit_bytes`, raised as `reserved_peak` raises the reserved
    peak), each replayed once (kept in `leasts`); 0 on a CPU target or across ranks, where the allocator is not modelled."""

    def least_of(choices: Mapping[str, Choice]) -> int:
        if not replays_allocator:
            return 0
        key = frozenset(choices.items())
        if key not in leasts:
            if key not in simulations:
                simulate(choices)
            simulation = simulations[key]
            predicted = max(predict_peak(measured, choices, request.mesh).bytes, simulation.peak_bytes)
            leasts[key] = reserved_peak(predicted, simulation.peak_bytes, simulation.least_limit_bytes)
        return leasts[key]

    return least_of


def reserved_notes(prediction, request: SolveRequest, device: Device, passed_over_least_bytes: int) -> tuple[str, ...]:
    """Notes on the caching allocator for a plan that fits: where a faster plan that fits by its allocated peak was
    passed over because the allocator could not run it in the budget, where the chosen one reserves more than
    the budget leaves it when free (it then gives cached segments back and retries: slower, and the least limit runs),
    and, under FSDP on a GPU, that its reserved memory is not predicted at all."""
    room = allocator_room(request.budget, device)
    notes = []
    if passed_over_least_bytes:
        notes.append(f"a faster plan fits by its allocated peak, but the caching allocator needs "
                     f"{format_bytes(passed_over_least_bytes)} to run its step (free space inside its segments "
                     f"included), more than the {format_bytes(room)} the budget leaves it (the budget less the CUDA "
                     f"context); this one needs {format_bytes(prediction.least_limit_bytes)}")
    if request.mesh.shards > 1 and device.kind == "cuda":
        notes.append(f"the caching allocator's reserved memory is not predicted under FSDP (FSDP2 gathers and reduces on "
                     f"streams of its own, whose cached blocks the allocator model does not replay); torchtitan's published "
                     f"FSDP2 runs reserved 15-37% more than the allocated peak autoplan predicts for them (docs/published.md): "
                     f"the reserve of {format_bytes(request.budget.reserve_bytes)} may not cover that; leave more with reserve=")
    if prediction.reserved_peak_bytes > room:
        notes.append(f"the caching allocator is predicted to reserve {format_bytes(prediction.reserved_peak_bytes)} "
                     f"(its segments' free space included), above the {format_bytes(room)} the budget leaves it: at that "
                     "limit it gives cached segments back and retries (cudaFree, a synchronisation each; slower), and "
                     f"runs the step in {format_bytes(prediction.least_limit_bytes)}")
    return tuple(notes)


def decide_loss_head(traced: Traced, measured: Profile, request: SolveRequest, step: StepOptions, say,
                     memo: dict | None = None) -> tuple[Plan, Profile]:
    """Decided with the loss head as the profile's timeline runs it and, where it can be fused, the other
    way too: the faster plan that fits (`faster_loss_head`). Fusing is then chosen by time like any choice.

    The head whose fastest step is faster is decided first. The other is not decided where its plan cannot be
    chosen (the first fits, and the other's fastest step is no faster than the first's plan) and its figures the
    plan reports are known without a search (`_known_figures`, from an earlier budget of the same Planner): the
    plan is the one deciding both would give. A Planner's later budgets so solve and simulate one head, not two.
    """
    if measured.alternative is None or measured.base_step_time_s is not None:  # measured times are for the timeline's head only
        return decide(traced, measured, request, step, say, memo), measured
    other = dataclasses.replace(measured, timeline=measured.alternative, alternative=measured.timeline)
    memo = memo if memo is not None else {}
    heads = [(measured, _fastest_time(measured, request)), (other, _fastest_time(other, request))]
    if heads[1][1] < heads[0][1]:
        heads.reverse()
    (first_head, _), (second_head, second_fastest_s) = heads
    first = decide(traced, first_head, request, step, say, memo)
    known = (_known_figures(traced, second_head, second_fastest_s, request, step, memo)
             if _cannot_win(first, first_head is other, second_fastest_s) else None)
    if known is not None:
        say(f"the loss head {_way(second_head)} cannot be faster here: not planned again")
        figures = (HeadFigures.of(first), known)
        return with_both_heads_figures((first, first_head), *(figures if first_head is measured else figures[::-1]))
    say(f"planning again with the loss head {_way(second_head)}")
    second = decide(traced, second_head, request, step, say, memo)
    decided = [(first, first_head), (second, second_head)]
    return faster_loss_head(*(decided if first_head is measured else decided[::-1]))


def _way(profile: Profile) -> str:
    return "fused" if profile.timeline.fused_loss else "as written"


def _fastest_time(profile: Profile, request: SolveRequest) -> float:
    """The step time of every unit's fastest allowed choice: no plan of `profile` is faster."""
    return predict_step_time(profile, fastest(profile, request.pins))


def _cannot_win(first: Plan, first_is_alternative: bool, other_fastest_s: float) -> bool:
    """Whether `faster_loss_head` keeps `first` whatever the other head's plan: `first` fits, and the other's fastest
    step (`_fastest_time`) is no faster (slower, where `first` is the alternative's head: a tie keeps the timeline's;
    a billionth apart, as the sums of float times may round differently)."""
    time_s = first.prediction.step_time_s
    if not first.outcome.feasible:
        return False
    return other_fastest_s > time_s * (1 + 1e-9) if first_is_alternative else other_fastest_s >= time_s * (1 + 1e-9)


def _known_figures(traced: Traced, profile: Profile, fastest_s: float, request: SolveRequest, step: StepOptions,
                   memo: dict) -> HeadFigures | None:
    """The fastest step (`fastest_s`), lowest peak and its budget `decide` would report for `profile` at this request, where an
    earlier budget left them known (else None): its lowest-peak choices solved and proven, and simulated to the peak
    the memory model predicts for them (then every path of `search` reports that peak); with offload, checkpointing
    and offloading every unit by hand simulates no lower (`search._offload_floor` would take it below the floor; it is
    simulated here once). Not where a world size is to be found (the mesh is chosen inside `decide`)."""
    simulations, leasts, floors = _memo_of(profile, request, memo)
    lowest = floors.get("floor")
    if request.fewest_ranks or lowest is None or not lowest.proven:
        return None
    simulation = simulations.get(frozenset(lowest.choices.items()))
    peak = predict_peak(profile, lowest.choices, request.mesh).bytes
    if simulation is None or simulation.peak_bytes != peak:
        return None
    offsets, extras = phase_offsets(profile, request.mesh)
    by_hand = offloaded_by_hand(profile, request) if request.host is not None else None
    if by_hand is not None and by_hand != dict(lowest.choices) and _simulator(traced, profile, step, simulations, offsets, extras)(by_hand) < peak:
        return None
    least_of = _least_limits(profile, request, simulations, simulate=None, replays_allocator=_replays_allocator(profile, offsets), leasts=leasts)
    budget = max(request.budget.needed_for(peak, profile.device), allocator_floor_of(lowest.choices, request.budget, profile.device, least_of))
    return HeadFigures(fastest_s, peak, budget)
