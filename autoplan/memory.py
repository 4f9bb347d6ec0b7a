"""The memory model: live bytes at every moment of a training step, for any set of choices.

The single source of truth for the solver's constraints, the plan's predicted peak and the
report's breakdown. It is built on the profile's timeline (a simulated step with every unit at its
base choice) and changes it unit by unit:

- during unit u's forward, its forward peak changes by the difference of its measured forward peaks;
- from the end of u's forward to the start of its backward, everything live changes by the
  difference of what u keeps (`held_bytes`);
- during u's backward, by that difference plus the difference of its backward peaks (where a
  checkpointed unit recomputes).

Peak = max over phases. Static memory (parameters, optimizer state, gradients as they appear, the
batch, the rest of the model) is in the timeline exactly as simulated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

from autoplan.plan import Choice, MemoryBreakdown
from autoplan.profile import Profile, UnitProfile

Relation = Literal["fwd", "held", "bwd"]


@dataclass(frozen=True)
class Point:
    """One phase of the step as a constraint: base bytes, and which units change it and how."""

    index: int
    name: str
    base_bytes: int  # the timeline's peak in this phase
    relations: tuple[tuple[int, Relation], ...]  # (unit index, how that unit's choice reaches this phase)


def unit_windows(profile: Profile) -> list[tuple[int, int]]:
    """For each unit: the index of its forward phase and of its backward phase."""
    names = [phase.name for phase in profile.timeline.phases]
    end = names.index("optimizer")
    windows = []
    for unit in profile.units:
        forward = names.index(f"fwd:{unit.name}")
        backward = names.index(f"bwd:{unit.name}") if f"bwd:{unit.name}" in names else end
        windows.append((forward, backward))
    return windows


def points(profile: Profile) -> list[Point]:
    windows = unit_windows(profile)
    result = []
    for index, phase in enumerate(profile.timeline.phases):
        relations: list[tuple[int, Relation]] = []
        for unit_index, (forward, backward) in enumerate(windows):
            if index == forward:
                relations.append((unit_index, "fwd"))
            elif index == backward:
                relations.append((unit_index, "bwd"))
            elif forward < index < backward:
                relations.append((unit_index, "held"))
        result.append(Point(index, phase.name, phase.peak_bytes, tuple(relations)))
    return result


def delta(unit: UnitProfile, relation: Relation, choice: Choice) -> int:
    """How much `choice` (instead of the unit's base choice) changes the bytes of a phase."""
    cost, base = unit.options[choice], unit.options[unit.base]
    if relation == "fwd":
        return cost.fwd_peak_bytes - base.fwd_peak_bytes
    held = cost.held_bytes - base.held_bytes
    if relation == "held":
        return held
    return held + cost.bwd_peak_bytes - base.bwd_peak_bytes


def _choices_list(profile: Profile, choices: Mapping[str, Choice]) -> list[Choice]:
    return [choices.get(unit.name, unit.base) for unit in profile.units]


def live_bytes(profile: Profile, choices: Mapping[str, Choice]) -> list[int]:
    """Predicted peak bytes of every phase of the step."""
    chosen = _choices_list(profile, choices)
    return [
        point.base_bytes + sum(delta(profile.units[u], relation, chosen[u]) for u, relation in point.relations)
        for point in points(profile)
    ]


@dataclass(frozen=True)
class PeakPrediction:
    bytes: int
    phase: str
    breakdown: MemoryBreakdown


def predict_peak(profile: Profile, choices: Mapping[str, Choice]) -> PeakPrediction:
    """The predicted peak of a training step under `choices`, where it happens, and what it is made of."""
    live = live_bytes(profile, choices)
    index = max(range(len(live)), key=live.__getitem__)
    phase = profile.timeline.phases[index]
    chosen = _choices_list(profile, choices)
    start = phase.start_bytes + sum(
        profile.units[u].delta_held(chosen[u]) for u, relation in points(profile)[index].relations if relation != "fwd"
    )
    static = profile.timeline.static
    activations = start - static.parameters - static.optimizer - phase.grad_bytes
    breakdown = MemoryBreakdown(
        parameters=static.parameters,
        gradients=phase.grad_bytes,
        optimizer=static.optimizer,
        activations=activations,
        transient=live[index] - start,
    )
    return PeakPrediction(live[index], phase.name, breakdown)


def predict_step_time(profile: Profile, choices: Mapping[str, Choice]) -> float:
    """Roofline step time: the timeline's, with each unit's time swapped for its chosen one."""
    chosen = _choices_list(profile, choices)
    change = sum(unit.options[c].time_s - unit.options[unit.base].time_s for unit, c in zip(profile.units, chosen))
    return profile.timeline.step_time_s + change
