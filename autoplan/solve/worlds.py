"""How many GPUs: the per-rank peak against the mesh's FSDP dimension, and the fewest ranks on which it fits.

For each candidate N the solver finds the choices with the lowest per-rank peak on the mesh with N
ranks along FSDP (the memory model's FSDP constraints, `memory.sharded.rank_offsets`); the fewest N whose
lowest peak fits the usable budget is the answer to `world_size="auto"`. The per-rank peak falls as N grows (shards shrink)
towards a floor N does not move: activations, the gathered root and units, the communication
buffers. Doubling N finds a fitting N, then bisection the fewest between it and its half. With FSDP2's
MixedPrecisionPolicy (the mesh's `param_dtype`) the search starts at 2: on one GPU nothing is sharded.
"""

from __future__ import annotations

from dataclasses import dataclass
import dataclasses
from typing import Callable

from autoplan.memory.model import predict_peak
from autoplan.memory.sharded import fsdp_group
from autoplan.mesh import FSDP, MAX_RANKS, Mesh  # beyond MAX_RANKS the floor (activations, gathered units) is what does not fit
from autoplan.plan import WorldSizePoint
from autoplan.profile.profiler import Profile
from autoplan.solve.ilp import minimum_peak
from autoplan.solve.request import SolveRequest



def profiled_parameter_count(profile: Profile) -> int:
    """Parameters of the model (units and the rest), tied weights once."""
    # a module called several times (call sites block@0, block@1, ...) has one set of parameters
    layouts = list({fsdp_group(unit.unit): unit.param_layout for unit in profile.units}.values()) + [profile.rest_param_layout]
    return sum(p.rows * p.row_numel for layout in layouts for p in layout)


def world_size_point(profile: Profile, request: SolveRequest) -> WorldSizePoint:
    """The lowest and the no-plan per-rank peak on the request's mesh."""
    mesh = request.mesh
    lowest = minimum_peak(profile, request).choices
    lowest_bytes = predict_peak(profile, lowest, mesh).bytes
    no_plan = {unit.name: unit.base for unit in profile.units}
    return WorldSizePoint(mesh.size, lowest_bytes, predict_peak(profile, no_plan, mesh).bytes, lowest_bytes <= request.usable_bytes)


@dataclass(frozen=True)
class WorldSizeFound:
    world_size: int  # the fewest ranks whose peak fits; when none does, the last tried
    fits: bool


def fewest_ranks(peak_at: Callable[[int], int], usable_bytes: int, smallest: int = 1, largest: int = MAX_RANKS) -> WorldSizeFound:
    """The fewest ranks N (at least `smallest`, at most `largest`) with `peak_at(N)` within `usable_bytes`: the one
    GPU-count search.

    Doubling from `smallest` while the peak still falls (FSDP pads every parameter to a multiple of N rows,
    so past some N more GPUs hold more, not less; and the unsharded part is a floor), then bisection
    between the first N that fits and its half. `peak_at` is called once per N. Below MAX_RANKS, `largest` is tried
    first: where it does not fit, no smaller N is searched (the peak falls with N over the few ranks such a bound
    leaves; padding turns it only past as many ranks as a parameter has rows).
    """
    peaks: dict[int, int] = {}

    def peak(n: int) -> int:
        if n not in peaks:
            peaks[n] = peak_at(n)
        return peaks[n]

    if largest < MAX_RANKS and peak(largest) > usable_bytes:
        return WorldSizeFound(largest, False)
    high = smallest
    while peak(high) > usable_bytes and high < largest:
        if peak(min(2 * high, largest)) >= peak(high):
            break  # more GPUs no longer help
        high = min(2 * high, largest)
    if peak(high) > usable_bytes:
        return WorldSizeFound(high, False)
    low = high // 2 + 1 if high > smallest else smallest  # high // 2 did not fit (or high is the smallest)
    while low < high:
        middle = (low + high) // 2
        if peak(middle) <= usable_bytes:
            high = middle
        else:
            low = middle + 1
    return WorldSizeFound(high, True)


def fewest_gpus(profile: Profile, request: SolveRequest, largest: int = MAX_RANKS,
                points: dict[int, WorldSizePoint] | None = None) -> tuple[Mesh, tuple[WorldSizePoint, ...]]:
    """The request's mesh with the fewest ranks along FSDP (at most `largest`) whose lowest per-rank peak fits, and
    the points measured on the way (sorted by N).

    When none fits (doubling stops once the peak stops falling, or at `largest`), the answer
    is the last N tried, which does not fit. `points`: those of an earlier search of the same profile, request and
    budget (`points_key`), each solved once.
    """
    points = {} if points is None else points

    def at(n: int) -> WorldSizePoint:
        if n not in points:
            points[n] = world_size_point(profile, dataclasses.replace(request, mesh=request.mesh.resized(FSDP, n)))
        return points[n]

    # FSDP2's MixedPrecisionPolicy needs a sharded mesh: one GPU is not a point of the search then
    smallest = 2 if request.mesh.param_dtype else 1
    found = fewest_ranks(lambda n: at(n).lowest_peak_bytes, request.usable_bytes, smallest, largest)
    if found.fits and largest == MAX_RANKS:
        at(2 * found.world_size)  # one point past the answer shows what more GPUs buy
    return request.mesh.resized(FSDP, found.world_size), tuple(points[n] for n in sorted(points))


def points_key(profile: Profile, request: SolveRequest) -> tuple:
    """What a world-size point depends on beside N: the loss head profiled, the budget and the mesh's other settings
    (a Planner's level keeps its points under this key, `deciding.decide`)."""
    return ("world-size points", profile.timeline.fused_loss, request.usable_bytes, request.mesh.resized(FSDP, 1))
