"""Whether the caching allocator can run a plan in its budget, not only whether the plan's allocated peak fits.

A plan fits by its allocated peak: what the step holds at once must stay under `usable_bytes`, the budget
less its reserve. On a GPU the caching allocator holds more than it hands out: segments whose free space
the next request could not use. Near its limit it gives back the cached segments none of whose bytes are
in use and asks again, so a step runs in less than it reserves with room to spare, but not in less than
its *least limit* (`instruments.caching_allocator.least_limit_bytes`, the simulated step's allocations
replayed through a model of the allocator under a limit). The allocator's room is the budget less the
CUDA context (the reserve's other part, the fragmentation allowance, is what this room is for).

Where the chosen plan's least limit is above that room, the search runs again with its usable bytes
lowered by the excess, a few times; a plan still over is not reported as fitting. The floor is raised
the same way: the lowest-peak choices need their least limit and the context.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from autoplan.errors import SolverTimeoutError
from autoplan.inputs.budget import Budget
from autoplan.inputs.devices import Device
from autoplan.plan import Choice
from autoplan.solve.request import SolveRequest
from autoplan.solve.search import SearchResult, resolve_slack

MAX_ALLOCATOR_RESOLVES = 3  # a re-solve's plan lies near the last one, whose least limit the next tightening is sized by


def allocator_room_bytes(budget_bytes: int, reserve_bytes: int, context_bytes: int) -> int:
    """What the caching allocator may reserve in a budget: the budget less the part of its reserve that is the context."""
    return budget_bytes - min(reserve_bytes, context_bytes)


def allocator_room(budget: Budget, device: Device) -> int:
    return allocator_room_bytes(budget.total_bytes, budget.reserve_bytes, device.context_bytes)


def reserved_context(budget: Budget, device: Device) -> tuple[int, str]:
    """The part of the budget's reserve that is the device's CUDA context, and where its figure comes from ("" where
    the reserve holds none of it: reserve=0, or a CPU): what a Plan records (`Request.context_bytes`)."""
    context = budget.total_bytes - allocator_room(budget, device)
    return context, device.context_source if context else ""


@dataclasses.dataclass(frozen=True)
class AllocatorFit:
    found: SearchResult  # the search's answer, re-solved where the allocator needed more room
    least_limit_bytes: int  # the chosen choices' least limit (0: not predicted, not a single GPU)
    tightened_bytes: int  # how far the usable bytes were lowered for it (0: not at all)
    passed_over_least_bytes: int = 0  # the least limit of the faster plan passed over for it (0: none was)


def fit_allocator(found: SearchResult, request: SolveRequest, device: Device, *,
                  least_of: Callable[[Mapping[str, Choice]], int], simulate: Callable[[Mapping[str, Choice]], int],
                  search_again: Callable[[SolveRequest], SearchResult]) -> AllocatorFit:
    """The search's answer, solved again under a lower usable budget while its least limit is above the allocator's room."""
    room = allocator_room(request.budget, device)
    tightened = 0
    least = least_of(found.choices)
    passed_over = least if found.feasible and least > room else 0
    for _ in range(MAX_ALLOCATOR_RESOLVES):
        if not found.feasible or least <= room:
            break
        tightened += least - room + resolve_slack(request.usable_bytes)
        budget = dataclasses.replace(request.budget, reserve_bytes=request.budget.reserve_bytes + tightened)
        try:
            again = search_again(dataclasses.replace(request, budget=budget))
        except SolverTimeoutError:  # the tighter search could not tell: the lowest-peak choices are judged below
            break
        if not again.feasible:
            break
        found = dataclasses.replace(again, resolves=found.resolves + again.resolves + 1,
                                    solve_time_s=found.solve_time_s + again.solve_time_s, lowest_choices=found.lowest_choices)
        least = least_of(found.choices)
    if found.feasible and least > room:
        # no faster plan leaves the allocator its room: the lowest-peak choices, as the floor counts them, fit or nothing does
        lowest = dict(found.lowest_choices) or found.choices
        simulated, least = simulate(lowest), least_of(lowest)
        found = dataclasses.replace(found, choices=lowest, simulated_peak_bytes=simulated,
                                    feasible=least <= room and simulated <= request.usable_bytes)
    return AllocatorFit(found, least, tightened, passed_over)


def allocator_floor(found: SearchResult, budget: Budget, device: Device,
                    least_of: Callable[[Mapping[str, Choice]], int]) -> int:
    """The smallest budget whose allocator room holds the lowest-peak choices' least limit (0: not predicted)."""
    return allocator_floor_of(found.lowest_choices, budget, device, least_of)


def allocator_floor_of(choices: Mapping[str, Choice], budget: Budget, device: Device,
                       least_of: Callable[[Mapping[str, Choice]], int]) -> int:
    """The smallest budget whose allocator room holds `choices`' least limit (0: not predicted, or no choices)."""
    least = least_of(choices) if choices else 0
    return least + budget.total_bytes - allocator_room(budget, device) if least else 0
