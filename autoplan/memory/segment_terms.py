"""Segments in the memory model: runs of consecutive units checkpointed as one region.

A **segment** over units i..j (`planned.segments`) saves only unit i's inputs during forward. When
the backward reaches unit j, the whole run is recomputed; from then on each unit k of it holds what
it saves in keep mode (in the segment's precision) until its own backward. Priced from the
members' own profiles, without another measurement:

- forward of unit k: its full-mode forward peak (inside the region it saves nothing);
- from unit k's forward to unit j's backward: nothing of k's own is held; the region holds unit
  i's inputs (a holder of those tensors, as a full-mode unit i would be);
- backward of unit j: the recomputation of i..j-1 in keep mode, each unit's forward peak on top of
  what the earlier ones kept (their keep-mode bytes and the outputs they pass on), then unit j's
  full-mode backward (its own recomputation and backward) on top of all of it;
- after it: unit k holds its keep-mode bytes, and the outputs passed between members that keep
  mode keeps, until unit k's backward, which peaks as its keep-mode backward.

Recompute time is the members' full-mode times (each forward once more). Candidates
(`segment_candidates`) are runs of units that the model's code calls back to back, each fed the
previous one's output (or a leaf of it) and otherwise only what the first was given, siblings in
one container: what the region can replay. Their lengths are a small set (2, 3, 4, 6, 8, 12, ...,
and every whole run), aligned, so that the program stays small at a hundred units.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Mapping

from autoplan.axes.checkpoint import MODES
from autoplan.errors import OptionError
from autoplan.plan import OPTIMIZER_STEP, Choice, Phase
from autoplan.profile.profiler import Profile
from autoplan.units import ModuleUnit, Segment, Unit

SEGMENT_LENGTHS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class SegmentCandidate:
    """A run of consecutive units (indices into profile.units, forward order) the plan may checkpoint as one."""

    unit: Segment
    members: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.unit.name


@dataclass(frozen=True)
class Covered:
    """What a unit inside a chosen segment does (instead of a choice of its own)."""

    segment: str
    first: bool  # the segment's first unit: the region holds its inputs


@dataclass(frozen=True)
class SegmentTerms:
    """What choosing a segment adds to the step, beyond its members' held changes (`member_held_delta`)."""

    phase_bytes: Mapping[int, int]  # phase index -> bytes
    time_s: float  # the members' forward, backward and recomputation
    recompute_flops: int


def unit_windows(profile: Profile) -> list[tuple[int, int]]:
    """For each unit: the index of its forward phase and of its backward phase."""
    index = {sample.phase: i for i, sample in enumerate(profile.timeline.phases)}
    end = index[OPTIMIZER_STEP]
    return [(index[Phase("fwd", unit.name)], index.get(Phase("bwd", unit.name), end)) for unit in profile.units]


def _chained(profile: Profile, a: int, b: int, first: int, windows, phase_index) -> bool:
    """Whether unit b runs right after unit a, fed only a's outputs and the run's first unit's inputs."""
    names = [unit.name for unit in profile.units]
    before, after = profile.units[a].unit, profile.units[b].unit
    if not (isinstance(before, ModuleUnit) and isinstance(after, ModuleUnit)):
        return False
    if before.parent != after.parent or not (before.child.isdigit() and after.child.isdigit() and int(after.child) == int(before.child) + 1):
        return False  # neighbours in one ModuleList or Sequential: what a segment denotes
    between = phase_index.get(Phase("fwd", before.name, "after"))
    if between is None or windows[b][0] != between + 1 or not windows[b][1] < windows[a][1]:
        return False
    gap = profile.timeline.phases[between]
    if gap.flops or gap.peak_bytes != gap.start_bytes:
        return False  # the model's code does work between them: the region could not replay it
    calls = {call.name: call for call in profile.timeline.unit_calls}
    before_call, after_call = calls[before.name], calls[after.name]
    allowed = set(before_call.output_keys) | set(calls[names[first]].input_keys)
    return bool(after_call.input_keys) and set(after_call.input_keys) <= allowed and any(
        key in before_call.output_keys for key in after_call.input_keys
    )


def chains(profile: Profile) -> list[list[int]]:
    """Maximal runs of units that a segment may cover (each at least two units)."""
    windows = unit_windows(profile)
    phase_index = {sample.phase: i for i, sample in enumerate(profile.timeline.phases)}
    order = sorted(range(len(profile.units)), key=lambda u: windows[u][0])
    runs: list[list[int]] = []
    current: list[int] = []
    for u in order:
        if current and _chained(profile, current[-1], u, current[0], windows, phase_index):
            current.append(u)
        else:
            if len(current) >= 2:
                runs.append(current)
            current = [u]
    if len(current) >= 2:
        runs.append(current)
    return runs


def segment_candidates(profile: Profile) -> list[SegmentCandidate]:
    """Segments the plan may choose: aligned runs of SEGMENT_LENGTHS units, and every whole chain."""
    names = [unit.name for unit in profile.units]  # each a module: chains hold nothing else
    found: dict[tuple[int, ...], SegmentCandidate] = {}
    for chain in chains(profile):
        lengths = [n for n in SEGMENT_LENGTHS if n < len(chain)] + [len(chain)]
        for length in lengths:
            for start in range(0, len(chain), length):
                members = tuple(chain[start : start + length])
                if len(members) >= 2:
                    found.setdefault(members, SegmentCandidate(Segment(names[members[0]], names[members[-1]]), members))
    return list(found.values())


def segment_choices(profile: Profile, candidate: SegmentCandidate, pins=None) -> list[Choice]:
    """The choices a segment may take: full in each precision every member can run full and keep in, and whose
    checkpointing no member's pin decides (a unit pinned to a mode is checkpointed on its own, as pinned: a segment
    would recompute its whole run at once, which no one pinning each block asked for)."""
    precisions = [c.precision for c in profile.units[candidate.members[0]].options if c.mode == "full" and c.saves is None]
    result = []
    for precision in dict.fromkeys(precisions):
        full, keep = Choice("full", precision), Choice("keep", precision)
        units = [profile.units[u] for u in candidate.members]
        if all(full in unit.options and keep in unit.options for unit in units) and all(
            pins is None or unit.name not in pins or all(Choice(mode, precision) in pins[unit.name] for mode in MODES) for unit in units
        ):
            result.append(full)
    return result


def chosen_segments(profile: Profile, choices: Mapping[str, Choice]) -> list[tuple[SegmentCandidate, Choice]]:
    """The segments named in `choices` (a name no unit of the profile has), with their members' indices."""
    units = {unit.name for unit in profile.units}
    named = [(name, choice) for name, choice in choices.items() if name not in units]
    if not named:
        return []
    candidates = _candidates_by_name(profile)
    unknown = [name for name, _ in named if name not in candidates]
    if unknown:
        raise OptionError(f"{unknown} name no unit of this profile and no segment of its units")
    return [(candidates[name], choice) for name, choice in named]


_CANDIDATES: dict[int, tuple[weakref.ref, dict[str, SegmentCandidate]]] = {}


def _candidates_by_name(profile: Profile) -> dict[str, SegmentCandidate]:
    """`segment_candidates` by name, found once per profile (the memory model asks at every prediction)."""
    entry = _CANDIDATES.get(id(profile))
    if entry is None or entry[0]() is not profile:
        for key in [key for key, (ref, _) in _CANDIDATES.items() if ref() is None]:
            del _CANDIDATES[key]
        entry = (weakref.ref(profile), {candidate.name: candidate for candidate in segment_candidates(profile)})
        _CANDIDATES[id(profile)] = entry
    return entry[1]


def choices_by_unit(profile: Profile, choices: Mapping[str, Choice]) -> dict[Unit, Choice]:
    """`choices` (by name, a segment's included) keyed by their units: what the planned forwards apply."""
    units: dict[str, Unit] = {unit.name: unit.unit for unit in profile.units}
    segments = {candidate.name: candidate.unit for candidate, _ in chosen_segments(profile, choices)}
    return {(units.get(name) or segments[name]): choice for name, choice in choices.items()}


def covered_units(profile: Profile, choices: Mapping[str, Choice]) -> dict[int, Covered]:
    return {
        u: Covered(candidate.name, position == 0)
        for candidate, _ in chosen_segments(profile, choices)
        for position, u in enumerate(candidate.members)
    }


def member_held_delta(profile: Profile, unit: int) -> int:
    """A member's own held change through its window: it keeps nothing of its own in forward
    (what it keeps after the recomputation is in the segment's phase terms)."""
    member = profile.units[unit]
    return -member.options[member.base].held_bytes


def _passed_on(profile: Profile, members: tuple[int, ...], keep: Choice) -> list[tuple[int, int, int]]:
    """Outputs one member hands a later one: (producer position, bytes, position of the earliest member that keeps it; -1: none)."""
    calls = {call.name: call for call in profile.timeline.unit_calls}
    units = [profile.units[u] for u in members]
    result = []
    for position, unit in enumerate(units[:-1]):
        call = calls[unit.name]
        produced = unit.options[keep].holds_outputs
        for leaf, (key, nbytes) in enumerate(zip(call.output_keys, call.output_bytes)):
            keepers = [position] if leaf < len(produced) and produced[leaf] else []
            for later in range(position + 1, len(units)):
                later_call = calls[units[later].name]
                flags = units[later].options[keep].holds_inputs
                keepers += [later for i, k in enumerate(later_call.input_keys) if k == key and (i >= len(flags) or flags[i])]
            result.append((position, nbytes, min(keepers) if keepers else -1))
    return result


def segment_terms(profile: Profile, candidate: SegmentCandidate, choice: Choice) -> SegmentTerms:
    """The phase terms, time and recomputed FLOPs of `candidate` checkpointed as one region (module docstring)."""
    windows = unit_windows(profile)
    keep, full = Choice("keep", choice.precision), Choice("full", choice.precision)
    units = [profile.units[u] for u in candidate.members]
    spans = [windows[u] for u in candidate.members]
    terms: dict[int, int] = {}

    def add(index: int, nbytes: int) -> None:
        terms[index] = terms.get(index, 0) + nbytes

    for unit, (forward, _) in zip(units, spans):
        add(forward, unit.options[full].fwd_peak_bytes - unit.options[unit.base].fwd_peak_bytes)
    last_backward = spans[-1][1]
    passed = _passed_on(profile, candidate.members, keep)
    # the recomputation, in the phase of the last member's backward
    running, peak = 0, 0
    for position, unit in enumerate(units):
        cost = unit.options[keep]
        if position == len(units) - 1:
            peak = max(peak, running + unit.options[full].bwd_peak_bytes)
            break
        peak = max(peak, running + cost.fwd_peak_bytes)
        running += cost.held_bytes + sum(nbytes for producer, nbytes, _ in passed if producer == position)
        # an output handed on that no member keeps is freed once the next member has run
        running -= sum(nbytes for producer, nbytes, keeper in passed if producer == position - 1 and keeper < 0)
    add(last_backward, peak - units[-1].options[units[-1].base].bwd_peak_bytes)
    # after it, every earlier member holds its keep-mode bytes until its own backward
    for position, (unit, (_, backward)) in enumerate(zip(units[:-1], spans[:-1])):
        for index in range(last_backward + 1, backward + 1):
            add(index, unit.options[keep].held_bytes)
        add(backward, unit.options[keep].bwd_peak_bytes - unit.options[unit.base].bwd_peak_bytes)
    for producer, nbytes, keeper in passed:
        if keeper >= 0:
            for index in range(last_backward + 1, spans[keeper][1] + 1):
                add(index, nbytes)
    time_s = sum(unit.options[full].time_s for unit in units)
    flops = sum(unit.recompute_flops(full) for unit in units)
    return SegmentTerms({i: b for i, b in terms.items() if b}, time_s, flops)
