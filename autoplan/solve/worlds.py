"""How many GPUs: the per-rank peak against the world size, and the fewest GPUs on which it fits.

For each candidate N the solver finds the choices with the lowest per-rank peak (the memory
model's FSDP constraints, `memory.rank_offsets`); the fewest N whose lowest peak fits the usable
budget is the answer to `world_size="auto"`. The per-rank peak falls as N grows (shards shrink)
towards a floor N does not move: activations, the gathered root and units, the communication
buffers. Doubling N finds a fitting N, then bisection the fewest between it and its half.
"""

from __future__ import annotations

from typing import Mapping

from autoplan.memory.model import predict_peak
from autoplan.plan import Choice, WorldSizePoint
from autoplan.profile.units import Profile
from autoplan.solve.ilp import minimum_peak

MAX_WORLD_SIZE = 4096  # beyond this the floor (activations, gathered units) is what does not fit


def parameter_count(profile: Profile) -> int:
    """Parameters of the model (units and the rest), tied weights once."""
    layouts = [unit.param_layout for unit in profile.units] + [profile.rest_param_layout]
    return sum(p.rows * p.row_numel for layout in layouts for p in layout)


def world_size_point(profile: Profile, pins, usable_bytes: int, world_size: int, time_limit_s: float) -> WorldSizePoint:
    lowest, _ = minimum_peak(profile, pins=pins, time_limit_s=time_limit_s, world_size=world_size)
    lowest_bytes = predict_peak(profile, lowest, world_size).bytes
    no_plan = {unit.name: unit.base for unit in profile.units}
    return WorldSizePoint(world_size, lowest_bytes, predict_peak(profile, no_plan, world_size).bytes, lowest_bytes <= usable_bytes)


def fewest_gpus(
    profile: Profile, pins: Mapping[str, tuple[Choice, ...]] | None, usable_bytes: int, time_limit_s: float = 10.0
) -> tuple[int, tuple[WorldSizePoint, ...]]:
    """The fewest GPUs whose lowest per-rank peak fits, and the points measured on the way (sorted by N).

    When none fits (doubling stops once the peak stops falling, or at MAX_WORLD_SIZE), the answer
    is the last N tried, which does not fit.
    """
    points: dict[int, WorldSizePoint] = {}

    def at(n: int) -> WorldSizePoint:
        if n not in points:
            points[n] = world_size_point(profile, pins, usable_bytes, n, time_limit_s)
        return points[n]

    high = 1
    while not at(high).fits and high < MAX_WORLD_SIZE:
        if at(2 * high).lowest_peak_bytes >= at(high).lowest_peak_bytes:
            break  # more GPUs no longer help: FSDP pads every parameter to N rows, the rest is not sharded
        high = 2 * high
    if not at(high).fits:
        return high, tuple(points[n] for n in sorted(points))
    low = high // 2 + 1 if high > 1 else 1  # high // 2 did not fit (or high is 1)
    while low < high:
        middle = (low + high) // 2
        if at(middle).fits:
            high = middle
        else:
            low = middle + 1
    at(2 * high)  # one point past the answer shows what more GPUs buy
    return high, tuple(points[n] for n in sorted(points))
