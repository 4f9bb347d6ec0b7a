"""Advice under the caching allocator: what a GPU plan's budget leaves the allocator, and the plan as advice sees it.

A plan's allocated peak can fit while the allocator's least limit (`plan.prediction.least_limit_bytes`) does not;
the verdict names that (`allocator_bound`), and advice estimates allocated peaks under a usable budget lowered by
what the allocator needs above them (`allocator_view`). The room itself is one formula, in `solve.allocator_fit`.
"""

from __future__ import annotations

import dataclasses

from autoplan.plan import Plan
from autoplan.solve.allocator_fit import allocator_room_bytes


def allocator_room_of(plan: Plan) -> int:
    """What the plan's budget leaves the caching allocator (solve.allocator_fit.allocator_room_bytes), with the
    context the plan reserved: the card's, or the one given (`cuda_context`)."""
    reserve = plan.request.budget_bytes - plan.request.usable_bytes
    return allocator_room_bytes(plan.request.budget_bytes, reserve, plan.request.context_bytes)


def allocator_bound(plan: Plan) -> bool:
    """`plan` does not fit though its lowest allocated peak does: the caching allocator needs more than the budget leaves it."""
    least = plan.prediction.least_limit_bytes
    return (not plan.outcome.feasible and least > 0 and plan.prediction.minimum_peak_bytes <= plan.request.usable_bytes
            and least > allocator_room_of(plan))


def allocator_view(plan: Plan) -> Plan:
    """The plan with its usable bytes lowered by what the caching allocator needs beyond its allocated peak and the
    budget leaves it (solve.allocator_fit): every estimate below is of allocated peaks, and the allocator's need
    above them comes along with them, so that is what they must fit under. Unchanged where it has room."""
    room = allocator_room_of(plan)
    excess = plan.prediction.least_limit_bytes - plan.prediction.peak_bytes  # 0 where not predicted (no allocator)
    if not plan.prediction.least_limit_bytes or room - excess >= plan.request.usable_bytes:
        return plan
    return dataclasses.replace(plan, request=dataclasses.replace(plan.request, usable_bytes=room - max(0, excess)))
