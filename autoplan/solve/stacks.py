"""Identical layers' choices side by side: a deep stack's solved choices put in an order the simulation can shorten.

The integer program prices identical layers alike, so among the plans it finds equally fast it picks which layers
recompute arbitrarily: a 70B's 80 layers came back 42 recomputed and 37 selective in runs of at most 10, and a
step in which no long run makes one choice is simulated whole (`profile.stack` shortens only runs). Ordered by the
bytes each layer's choice keeps from forward to backward, least first, the same choices form one run per choice,
and every moment of the step holds no more: a layer's forward and backward see what the layers before it keep,
and that sum is smallest at every layer when the smallest come first; the time is the same. The memory model
checks that the ordered plan predicts no higher (neighbours' choices decide which tensors between them stay
alive), the search simulates it, and falls back to the solved order where it does not fit.

Only for stacks as deep as the shortcut needs (`MIN_LAYERS`): a shallower stack's plan stays as solved.
"""

from __future__ import annotations

from typing import Mapping

from autoplan.plan import Choice
from autoplan.profile.profiler import Profile, UnitProfile
from autoplan.vocabulary.names import numbered_child

MIN_LAYERS = 24  # profile.stack shortens a step where its shortened steps simulate under half a run: 24 layers for one


def identical_stacks(profile: Profile) -> list[list[UnitProfile]]:
    """Runs of at least MIN_LAYERS consecutive units numbered one after the other in one container, measured alike
    (every choice's costs, parameter layout and base choice equal)."""
    stacks: list[list[UnitProfile]] = []
    current: list[UnitProfile] = []
    for unit in profile.units:
        if not (current and _follows(current[-1], unit)):
            if len(current) >= MIN_LAYERS:
                stacks.append(current)
            current = []
        current.append(unit)
    if len(current) >= MIN_LAYERS:
        stacks.append(current)
    return stacks


def _follows(before: UnitProfile, unit: UnitProfile) -> bool:
    mine, theirs = numbered_child(unit.name), numbered_child(before.name)
    if mine is None or theirs is None or type(unit.unit) is not type(before.unit):
        return False
    same_place = mine == (theirs[0], theirs[1] + 1)
    return same_place and unit.options == before.options and unit.param_layout == before.param_layout and unit.base == before.base


def side_by_side(profile: Profile, choices: Mapping[str, Choice]) -> dict[str, Choice]:
    """`choices` with each deep stack's choices reordered, the layers that keep least first (ties in a fixed order)."""
    ordered = dict(choices)
    for stack in identical_stacks(profile):
        names = [unit.name for unit in stack]
        options = stack[0].options
        picked = [choice for choice in (choices.get(name) for name in names) if isinstance(choice, Choice) and choice in options]
        if len(picked) < len(names):
            continue  # a segment's member, or a choice this stack was not measured in: as solved
        ordered.update(zip(names, sorted(picked, key=lambda choice: (options[choice].held_bytes, repr(choice)))))
    return ordered
