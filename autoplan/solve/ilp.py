"""Solve stage: an integer program that picks one choice per unit.

Variables: x[u, c] = 1 when unit u takes choice c (checkpoint mode × precision), one choice per
unit. Constraints: for every phase of the training step, the memory model's bytes (see
`memory.model`) stay under the usable budget. Objective: the least predicted step time (forward,
backward, recomputation). The bytes a unit keeps until its backward reach every later phase, so
they are summed once into prefix variables H[i] (held bytes of the first i units), which keeps
the program's size linear in the number of units.

`minimum_peak` answers "how low can the peak go with everything turned on" by minimising the
peak instead; an infeasible budget is reported with it, never raised.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping


def _import_on_a_thread_of_its_own(name: str) -> None:
    """Import `name` from a fresh thread's stack. pulp's solver modules (copt_api, cplex_api) keep the
    exceptions of their failed library loads at import, tracebacks and all, and a traceback keeps every
    frame of the stack that first imported pulp: imported from the caller's stack, the caller's locals
    (a model, its batch, on a GPU too) were never freed. Seen on an H100: a first model's 610 MiB of
    parameters stayed allocated through the next models' steps. A failed import is left to the import
    below, which raises it where it is read."""
    thread = threading.Thread(target=lambda: _quietly_import(name), daemon=True)
    thread.start()
    thread.join()


def _quietly_import(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError:
        pass


_import_on_a_thread_of_its_own("pulp")
import pulp  # noqa: E402  (imported above on a thread of its own; this binds it)

from autoplan.errors import OptionError, SolverTimeoutError
from autoplan.vocabulary.descriptors import silenced
from autoplan.memory.model import (
    HOLDING,
    Point,
    alive_regardless,
    copy_out_bytes,
    holds,
    host_peak,
    kept_flags,
    points,
    predict_peak,
    shared_bytes,
    shared_tensors,
    transient_delta,
    unit_windows,
)
from autoplan.memory.segment_terms import SegmentCandidate, SegmentTerms, member_held_delta, segment_candidates, segment_choices, segment_terms
from autoplan.axes.checkpoint import CHECKPOINT
from autoplan.mesh import Mesh
from autoplan.plan import Choice
from autoplan.profile.profiler import Profile
from autoplan.solve.request import SolveRequest

MIB = 2**20  # the program works in MiB so the solver's tolerances stay meaningful


STOPPED_WITH_PLAN = "Stopped at the time limit"  # the status of a solve that ran out of time holding a feasible answer


@dataclass(frozen=True)
class Solution:
    choices: Mapping[str, Choice]  # one per unit; empty when no choice fits
    status: str  # pulp's status: "Optimal", "Infeasible", ..., or STOPPED_WITH_PLAN (feasible, maybe not the fastest)
    feasible: bool
    solve_time_s: float


@dataclass(frozen=True)
class LowestPeak:
    choices: Mapping[str, Choice]  # one per unit: the lowest predicted peak the solver found
    solve_time_s: float
    proven: bool  # False when the solver stopped at its time limit: a lower peak may exist


def allowed_choices(profile: Profile, pins: Mapping[str, tuple[Choice, ...]] | None = None) -> list[list[Choice]]:
    """Per unit (profile order): the choices the solver may pick, after the person's pins."""
    pins = pins or {}
    result = []
    for unit in profile.units:
        options = sorted(unit.options)
        if unit.name in pins:
            # a pinned mode allows every menu point of that mode, on the device or offloaded; a named policy its own choice
            options = [c for c in options if c in pins[unit.name] or dataclasses.replace(c, saves=None, placement="device") in pins[unit.name]]
            if not options:
                raise OptionError(f"the pins on unit {unit.name!r} leave it no choice it can take")
        result.append(options)
    return result


@dataclass(frozen=True)
class SegmentOption:
    """One segment in one choice, as the program sees it."""

    candidate: SegmentCandidate
    choice: Choice
    terms: SegmentTerms


def segment_options(profile: Profile, request: SolveRequest) -> list[SegmentOption]:
    """Every segment the program may choose (none on several GPUs: FSDP wraps blocks one by one)."""
    if request.mesh.size != 1 or not request.segments:
        return []
    return [
        SegmentOption(candidate, choice, segment_terms(profile, candidate, choice))
        for candidate in segment_candidates(profile)
        for choice in segment_choices(profile, candidate, request.pins)
    ]


def _build(profile: Profile, request: SolveRequest, name: str) -> "Program":
    """The program both objectives share: one choice per unit or a covering segment, each phase's bytes, and
    the offloaded units' host bytes within the request's host memory."""
    allowed = allowed_choices(profile, request.pins)
    segments = segment_options(profile, request)
    problem = pulp.LpProblem(name, pulp.LpMinimize)
    x = {
        (u, c): problem.add_variable(f"x_{u}_{i}_{c.mode}_{c.precision}_{c.placement}", cat=pulp.LpBinary)
        for u, options in enumerate(allowed)
        for i, c in enumerate(options)
    }
    y = [problem.add_variable(f"segment_{g}_{option.choice.precision}", cat=pulp.LpBinary) for g, option in enumerate(segments)]
    covering: dict[int, list[tuple[object, bool]]] = {}
    for variable, option in zip(y, segments):
        for position, u in enumerate(option.candidate.members):
            covering.setdefault(u, []).append((variable, position == 0))
    # every unit is covered once: by a choice of its own, or by one segment
    for u, options in enumerate(allowed):
        problem += pulp.lpSum(x[u, c] for c in options) + pulp.lpSum(v for v, _ in covering.get(u, [])) == 1, f"one_choice_unit_{u}"
    held, corrections = _held_expressions(profile, allowed, x, problem, covering)
    host = [(profile.units[u].options[c].host_bytes, v) for (u, c), v in x.items() if c.offloaded]
    if host and request.host is not None:
        problem += pulp.lpSum(nbytes / MIB * v for nbytes, v in host) <= request.host.budget_bytes / MIB, "host_memory"
    segment_bytes: dict[int, list] = {}
    for variable, option in zip(y, segments):
        for index, nbytes in option.terms.phase_bytes.items():
            segment_bytes.setdefault(index, []).append(nbytes / MIB * variable)
    # prefix[i] = held-bytes change of the units that have finished their forward, in forward order
    windows = unit_windows(profile)
    forward_order = sorted(range(len(allowed)), key=lambda u: windows[u][0])
    prefix = [problem.add_variable(f"held_first_{i}") for i in range(len(allowed) + 1)]
    problem += prefix[0] == 0, "held_first_0"
    for i, u in enumerate(forward_order):
        problem += prefix[i + 1] == prefix[i] + held[u], f"held_first_{i + 1}"
    rank = {u: i for i, u in enumerate(forward_order)}  # a unit's place in forward order

    def phase_bytes(point: Point):
        holding = [u for u, relation in point.relations if relation in HOLDING]
        if sorted(rank[u] for u in holding) == list(range(len(holding))):
            held_now = prefix[len(holding)]
        else:  # not a prefix of forward order (parallel branches): sum the units themselves
            held_now = pulp.lpSum(held[u] for u in holding)
        own = pulp.lpSum(
            transient_delta(profile.units[u], r, c) / MIB * x[u, c]
            for u, r in point.relations
            if r != "held"
            for c in allowed[u]
        )
        extra = pulp.lpSum(corrections.get(point.index, [])) + pulp.lpSum(segment_bytes.get(point.index, []))
        return point.base_bytes / MIB + held_now + own + extra + copied_out(point)

    def copied_out(point: Point):
        """On a mesh: what FSDP holds at the phase's start beyond its terms, by the phase's unit's choice (`copy_out_bytes`)."""
        if point.start is None:
            return 0
        u, _, whole, _ = point.start
        return (pulp.lpSum(copy_out_bytes(profile, point, c) / MIB * x[u, c] for c in allowed[u])
                + whole / MIB * pulp.lpSum(v for v, _ in covering.get(u, [])))

    return Program(problem, allowed, segments, x, y, phase_bytes, points(profile, request.mesh))


@dataclass(frozen=True)
class Program:
    problem: pulp.LpProblem
    allowed: list[list[Choice]]  # per unit, the choices it may take (allowed_choices)
    segments: list[SegmentOption]  # the segments it may take instead
    x: dict  # (unit, choice) -> binary
    y: list  # per segment option -> binary
    phase_bytes: Callable[[Point], pulp.LpAffineExpression]  # the phase's bytes in MiB, an expression of x and y
    constraints: list


def _held_expressions(profile: Profile, allowed, x, problem, covering) -> tuple[list, dict[int, list]]:
    """Per unit, in MiB: its held-bytes change plus the passed-along tensors alive because of it.

    A passed-along tensor is alive in holder j's window when any of holders 1..j keeps it:
    kept[j] >= kept[j-1] and kept[j] >= holds_j(x), and holder j accounts for kept[j] - kept[j-1].
    """
    windows = unit_windows(profile)
    base_choices = [unit.base for unit in profile.units]
    base = shared_bytes(profile, base_choices)
    corrections: dict[int, list] = {}
    held = [
        pulp.lpSum(profile.units[u].delta_held(c) / MIB * x[u, c] for c in allowed[u]) - base[u] / MIB
        + pulp.lpSum(member_held_delta(profile, u) / MIB * v for v, _ in covering.get(u, []))
        for u in range(len(allowed))
    ]
    for t, tensor in enumerate(shared_tensors(profile)):
        previous = 0
        kept_by = []
        for j, holder in enumerate(tensor.holders):
            keeps = pulp.lpSum(x[holder.unit, c] for c in allowed[holder.unit] if holds(profile, holder, c))
            if holder.side == "in":  # a segment's region saves its first unit's inputs
                keeps = keeps + pulp.lpSum(v for v, first in covering.get(holder.unit, []) if first)
            if j == 0:
                kept = keeps
            else:
                kept = problem.add_variable(f"kept_{t}_{j}", lowBound=0, upBound=1)
                problem += kept >= previous, f"kept_{t}_{j}_after_earlier"
                problem += kept >= keeps, f"kept_{t}_{j}_by_unit_{holder.unit}"
            held[holder.unit] = held[holder.unit] + tensor.bytes / MIB * (kept - previous)
            kept_by.append(kept)
            previous = kept
        # between its making and its last consumer's forward it is alive anyway: undo the credit
        kept_base = kept_flags(profile, tensor, base_choices)
        for index, last in alive_regardless(tensor, windows).items():
            corrections.setdefault(index, []).append(tensor.bytes / MIB * (kept_base[last] - kept_by[last]))
    return held, corrections


def _tie_break(choice: Choice) -> float:
    """Between choices of equal time, prefer less rewriting: keep over checkpointing, fp32 over low precision,
    the device over host memory."""
    return 1e-12 * choice.rewriting


def _run(problem: pulp.LpProblem, time_limit_s: float) -> bool:
    """Solve; True when the solver holds a feasible answer. Running out of time without one is an error."""
    solver = _solver(time_limit_s)
    try:
        # highspy prints its banner from C++ to fd 1 whatever msg=False says: `autoplan plan --json -` stays JSON
        with silenced(1):
            problem.solve(solver)
    except pulp.PulpSolverError:
        if isinstance(solver, pulp.HiGHS):
            raise
        # CBC without preprocessing has crashed on some infeasible programs: ask again with defaults
        with silenced(1):
            problem.solve(_solver(time_limit_s, preprocess=True))
    if isinstance(solver, pulp.HiGHS) and problem.status == pulp.LpStatusOptimal and not _highs_holds_solution(problem):
        # pulp reads HiGHS's "time limit" as integer-feasible even when it found no solution at all
        problem.status, problem.sol_status = pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
    if problem.status == pulp.LpStatusNotSolved:
        raise SolverTimeoutError(time_limit_s)
    return problem.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)


def _highs_holds_solution(problem: pulp.LpProblem) -> bool:
    feasible = 2  # HiGHS's kSolutionStatusFeasible
    return problem.solverModel.getInfo().primal_solution_status == feasible


def _stopped_early(problem: pulp.LpProblem) -> bool:
    return problem.sol_status == pulp.LpSolutionIntegerFeasible


def _solver(time_limit_s: float, preprocess: bool = False) -> pulp.LpSolver:
    """HiGHS (highspy, a dependency) when it imports, else CBC.

    HiGHS proves these programs optimal where CBC cannot: with 24 identical layers near a tight
    budget (the README's Qwen2.5-0.5B sample) CBC stopped at its time limit unproven, its branching
    lost among the layers' symmetric choices, and HiGHS proves the plan well within it. CBC is the fallback on platforms
    without a highspy wheel: a `cbc` on PATH if there is one, else the binary inside pulp; its
    preprocessing stays off (CBC 2.10's preprocessing fixed variables of these programs wrongly and
    reported a slower plan as optimal; tests/solve/test_ilp.py checks against brute force).
    """
    if pulp.HiGHS().available():
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=1e-4)
    options = {"msg": False, "timeLimit": time_limit_s, "gapRel": 1e-4, "options": [] if preprocess else ["preprocess off"]}
    solver = pulp.COIN_CMD(**options)
    if not solver.available():
        solver = pulp.COIN_CMD(**options, path=pulp.PULP_CBC_CMD.pulp_cbc_path)
    return solver


def _read_choices(profile: Profile, program: Program) -> dict[str, Choice]:
    """Per unit its choice; a chosen segment under its own name, in place of its members."""
    choices: dict[str, Choice] = {}
    covered: set[int] = set()
    for variable, option in zip(program.y, program.segments):
        if (variable.value() or 0.0) > 0.5:
            choices[option.candidate.name] = option.choice
            covered.update(option.candidate.members)
    for u, unit in enumerate(profile.units):
        if u not in covered:
            choices[unit.name] = max(program.allowed[u], key=lambda c: program.x[u, c].value() or 0.0)
    return choices


def _time_objective(profile: Profile, program: Program):
    units = pulp.lpSum((profile.units[u].options[c].time_s + _tie_break(c)) * v for (u, c), v in program.x.items())
    # a segment takes as long as its members each checkpointed: between the two, prefer the members
    grouped = pulp.lpSum(
        (option.terms.time_s + 1e-12 * (len(option.candidate.members) * CHECKPOINT.rewriting("full") + 1)) * v
        for v, option in zip(program.y, program.segments)
    )
    return units + grouped


def _fastest_step(profile: Profile) -> float:
    """The units' fastest step time: objectives are in this unit, so the solvers' absolute tolerances
    (HiGHS: 1e-6) cannot call any plan optimal when a tiny model's step takes microseconds."""
    return sum(min(option.time_s for option in unit.options.values()) for unit in profile.units) or 1.0


def solve(profile: Profile, request: SolveRequest, margin_bytes: int = 0) -> Solution:
    """The fastest choices whose predicted peak fits the request's usable bytes less `margin_bytes` (per rank
    on its mesh), offloading no more than its host memory holds."""
    started = time.perf_counter()
    usable_bytes = request.usable_bytes - margin_bytes
    program = _build(profile, request, "autoplan_fastest")
    problem = program.problem
    for point in program.constraints:
        problem += program.phase_bytes(point) <= usable_bytes / MIB, f"peak_at_{point.index}"
    problem += _time_objective(profile, program) / _fastest_step(profile), "step_time"
    has_solution = _run(problem, request.time_limit_s)
    status = STOPPED_WITH_PLAN if _stopped_early(problem) else pulp.LpStatus[problem.status]
    elapsed = time.perf_counter() - started
    if not has_solution:
        return Solution({}, status, False, elapsed)
    choices = _prefer_less_rewriting(profile, program.allowed, _read_choices(profile, program), request, usable_bytes)
    return Solution(choices, status, True, time.perf_counter() - started)


def _prefer_less_rewriting(profile: Profile, allowed, choices: dict[str, Choice], request: SolveRequest, usable_bytes: int) -> dict[str, Choice]:
    """Swap in a choice of no more time and less rewriting wherever the budget still holds.

    The solver's optimality gap is far larger than the objective's tie-break, so ties are settled here.
    """
    for u, unit in enumerate(profile.units):
        if unit.name not in choices:
            continue  # inside a chosen segment
        current = choices[unit.name]
        for option in sorted(allowed[u], key=_tie_break):
            if _tie_break(option) >= _tie_break(current):
                break
            if unit.options[option].time_s <= unit.options[current].time_s:
                trial = {**choices, unit.name: option}
                if predict_peak(profile, trial, request.mesh).bytes <= usable_bytes and (
                        request.host is None or host_peak(profile, trial) <= request.host.budget_bytes):
                    choices, current = trial, option
                    break
    return choices


def minimum_peak(profile: Profile, request: SolveRequest) -> LowestPeak:
    """The choices with the lowest predicted peak (per rank on the request's mesh), and the solve time; the
    request's budget plays no part.

    Every choice is feasible here (the peak is a variable), so the solver always holds an answer unless it
    ran out of time first (SolverTimeoutError); stopped at the limit with one, `proven` is False.
    """
    started = time.perf_counter()
    program = _build(profile, request, "autoplan_lowest_peak")
    problem = program.problem
    peak = problem.add_variable("peak_mib")
    for point in program.constraints:
        problem += program.phase_bytes(point) <= peak, f"peak_at_{point.index}"
    # among the lowest-peak choices prefer fast ones: time in units of the fastest step (about 1) is
    # worth 1e-4 MiB, under the 512 B that peaks differ by, yet above the solvers' absolute tolerance
    # (in seconds it fell under it, and which equal-peak plan came back changed with the solver's version)
    problem += peak + 1e-4 * _time_objective(profile, program) / _fastest_step(profile), "peak"
    if not _run(problem, request.time_limit_s):
        raise RuntimeError(f"the lowest-peak program has no solution ({pulp.LpStatus[problem.status]}): a bug, every unit has a choice")
    choices = _read_choices(profile, program)
    return LowestPeak(choices, time.perf_counter() - started, proven=not _stopped_early(problem))


def fastest(profile: Profile, pins: Mapping[str, tuple[Choice, ...]] | None = None) -> dict[str, Choice]:
    """The fastest choice of every unit, memory ignored."""
    allowed = allowed_choices(profile, pins)
    return {
        unit.name: min(allowed[u], key=lambda c: unit.options[c].time_s + _tie_break(c)) for u, unit in enumerate(profile.units)
    }



def check(profile: Profile, choices: Mapping[str, Choice], usable_bytes: int, mesh: Mesh = Mesh()) -> bool:
    return predict_peak(profile, choices, mesh).bytes <= usable_bytes
