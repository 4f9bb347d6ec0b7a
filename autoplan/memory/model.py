"""The memory model: live bytes at every moment of a training step, for any set of choices.

The single source of truth for the solver's constraints, the plan's predicted peak and the
report's breakdown. It is built on the profile's timeline (a simulated step with every unit at its
base choice) and changes it unit by unit:

- during unit u's forward, its forward peak changes by the difference of its measured forward peaks;
- from the end of u's forward to the start of its backward, everything live changes by the
  difference of what u keeps (`held_bytes`);
- during u's backward, by that difference plus the difference of its backward peaks (where a
  checkpointed unit recomputes);
- after u's backward, and through the next step's forward (the loop's `loss` holds the graph until
  it is reassigned), by the difference of what u's graph still holds (`spent_bytes`: tensors an
  autograd function keeps as attributes, which backward does not free; 0 for most units).

Tensors passed between units (a block's output is the next block's input; a U-Net's skip reaches
a decoder block) are counted once: such a tensor stays alive through a holder's window (its
forward to its backward) when that holder, or any holder before it in forward order, keeps it
(the producer saves its output, a consumer saves its input or checkpoints it). Windows of later
units nest inside those of earlier ones, so this is an OR that the solver linearises.

Peak = max over phases. Static memory (parameters, optimizer state, gradients as they appear, the
batch, the rest of the model) is in the timeline exactly as simulated.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Hashable, Literal, Mapping, Sequence, TypeVar

from autoplan.memory.segment_terms import Covered, chosen_segments, covered_units, member_held_delta, segment_terms, unit_windows
from autoplan.memory.sharded import RankTerms, rank_moments, rank_offsets, rank_terms
from autoplan.mesh import Mesh
from autoplan.plan import BACKWARD_START, OPTIMIZER_STEP, Choice, MemoryBreakdown, Phase, ShardedPeak
from autoplan.profile.profiler import Profile, UnitProfile

Relation = Literal["fwd", "held", "bwd", "spent"]
HOLDING: tuple[Relation, ...] = ("held", "bwd")  # the relations in which a unit's held bytes are alive
T = TypeVar("T")


@dataclass(frozen=True)
class Point:
    """One phase of the step as a constraint: base bytes, and which units change it and how."""

    index: int
    phase: Phase
    base_bytes: int  # the timeline's peak in this phase
    relations: tuple[tuple[int, Relation], ...]  # (unit index, how that unit's choice reaches this phase)
    # on a mesh: (the phase's unit, its relation, what FSDP holds at the phase's start beyond its terms, how far the
    # base timeline rises from that start to the peak), where FSDP holds more there (`copy_out_bytes`)
    start: tuple[int, Relation, int, int] | None = None


_PER_PROFILE: dict[int, dict] = {}  # what does not depend on the choices, by profile (`_once`)


def _once(profile: Profile, key: Hashable, compute: Callable[[], T]) -> T:
    """`compute()` for this profile object and `key`, made at the first call and dropped with the profile: a solve's
    tie-break asks for hundreds of predicted peaks of one profile (80 units: ~500), each of which remade these."""
    entry = _PER_PROFILE.get(id(profile))
    if entry is None:
        entry = _PER_PROFILE[id(profile)] = {}
        weakref.finalize(profile, _PER_PROFILE.pop, id(profile), None)
    if key not in entry:
        entry[key] = compute()
    return entry[key]


def points(profile: Profile, mesh: Mesh = Mesh()) -> list[Point]:
    """One constraint per phase; on a mesh of more than one device, rank 0's bytes (see `rank_offsets`)."""
    return list(_once(profile, ("points", mesh), lambda: _points(profile, mesh)))


def _points(profile: Profile, mesh: Mesh) -> list[Point]:
    windows = unit_windows(profile)
    offsets, extras = rank_moments(profile, mesh)
    spending = {u for u, unit in enumerate(profile.units) if len({cost.spent_bytes for cost in unit.options.values()}) > 1}
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
            if unit_index in spending and (phase.kind == "fwd" or index > backward):
                # after its backward, and through the next step's forward while the loop holds the graph
                relations.append((unit_index, "spent"))
        own = [(u, r) for u, r in relations if r in ("fwd", "bwd")]
        start = (*own[0], extras[index], phase.peak_bytes - phase.start_bytes) if extras[index] and own else None
        result.append(Point(index, phase.phase, phase.peak_bytes + offsets[index], tuple(relations), start))
    return result


def copy_out_bytes(profile: Profile, point: Point, choice: Choice | Covered) -> int:
    """What a phase holds on a rank beyond its peak with FSDP's terms when the phase's unit takes `choice`: FSDP's
    extra at the start (`RankTerms.start_extra`) less how far the unit's activations rise after it (a segment's
    unit: all of it)."""
    if point.start is None:
        return 0
    unit, relation, extra, rise = point.start
    if isinstance(choice, Covered):
        return extra
    return max(0, extra - max(0, rise + transient_delta(profile.units[unit], relation, choice)))


def transient_delta(unit: UnitProfile, relation: Relation, choice: Choice | Covered) -> int:
    """How much `choice` (instead of the base) changes the unit's own peak in its forward or backward
    (inside a segment: nothing here, the segment's own terms say it)."""
    if isinstance(choice, Covered):
        return 0
    cost, base = unit.options[choice], unit.options[unit.base]
    if relation == "fwd":
        return cost.fwd_peak_bytes - base.fwd_peak_bytes
    if relation == "bwd":
        return cost.bwd_peak_bytes - base.bwd_peak_bytes
    if relation == "spent":
        return cost.spent_bytes - base.spent_bytes
    return 0


@dataclass(frozen=True)
class Holder:
    unit: int  # index in profile.units
    side: Literal["in", "out"]
    leaf: int  # which tensor of the unit's inputs or output


@dataclass(frozen=True)
class SharedTensor:
    """A tensor units pass along, and the units that may keep it, in forward order."""

    bytes: int
    holders: tuple[Holder, ...]
    last_use: int = -1  # index of the last forward phase that reads it (-1: unknown)
    rest_until: int = -1  # index of the last phase in which an op outside the units keeps it (-1: none)


def shared_tensors(profile: Profile) -> list[SharedTensor]:
    """Tensors between units whose lifetime depends on the units' choices (not the batch or output)."""
    return list(_once(profile, "shared tensors", lambda: _shared_tensors(profile)))


def _shared_tensors(profile: Profile) -> list[SharedTensor]:
    index = {unit.name: i for i, unit in enumerate(profile.units)}
    phase_index = {sample.phase: i for i, sample in enumerate(profile.timeline.phases)}
    result = []
    for boundary in profile.timeline.boundaries:
        if boundary.held_by_rest:
            continue  # the batch or a parameter: alive whatever the units choose
        holders = [Holder(index[name], "in", leaf) for name, leaf in boundary.consumers if name in index]
        if boundary.producer and boundary.producer[0] in index:
            holders.insert(0, Holder(index[boundary.producer[0]], "out", boundary.producer[1]))
        holders.sort(key=lambda h: h.unit)
        if holders:
            rest_until = _rest_backward_end(profile, boundary.rest_saved_in, phase_index) if boundary.rest_saved_in else -1
            last_use = phase_index.get(boundary.last_forward_use, -1) if boundary.last_forward_use else -1
            result.append(SharedTensor(boundary.bytes, tuple(holders), last_use, rest_until))
    return result


def _rest_backward_end(profile: Profile, forward_phase: Phase, phase_index: dict[Phase, int]) -> int:
    """The last phase in which the backward of the rest-of-model ops run in `forward_phase` runs.

    Ops between unit X and the next unit Y run their backward after Y's ("bwd:after Y") and before
    X's; those after the last unit run first ("bwd:start"); those before the first unit, last.
    """
    names = [unit.name for unit in profile.units]
    end = phase_index[OPTIMIZER_STEP] - 1
    if forward_phase.kind != "fwd" or forward_phase.position not in ("start", "after"):
        return end
    if forward_phase.position == "start":
        position = 0
    else:
        assert forward_phase.unit is not None  # an "after" phase names its unit
        position = names.index(forward_phase.unit) + 1
    backward = BACKWARD_START if position == len(names) else Phase("bwd", names[position], "after")
    if backward not in phase_index:
        return end
    # the rest's backward runs until the next unit's backward begins
    following = [i for i in range(phase_index[backward] + 1, end + 1) if profile.timeline.phases[i].kind == "bwd" and profile.timeline.phases[i].unit]
    return following[0] - 1 if following else end


def holds(profile: Profile, holder: Holder, choice: Choice | Covered) -> bool:
    if isinstance(choice, Covered):
        return choice.first and holder.side == "in"  # a segment's region saves its first unit's inputs
    cost = profile.units[holder.unit].options[choice]
    flags = cost.holds_outputs if holder.side == "out" else cost.holds_inputs
    return flags[holder.leaf] if holder.leaf < len(flags) else True  # unknown: assume kept


def shared_bytes(profile: Profile, chosen: Sequence[Choice | Covered], tensors: list[SharedTensor] | None = None) -> list[int]:
    """Per unit: bytes of passed-along tensors alive in its window only because of it (or nothing earlier)."""
    extra = [0] * len(profile.units)
    for tensor in shared_tensors(profile) if tensors is None else tensors:
        kept = False
        for holder in tensor.holders:
            now = kept or holds(profile, holder, chosen[holder.unit])
            if now and not kept:
                extra[holder.unit] += tensor.bytes
            kept = now
    return extra


def _choices_list(profile: Profile, choices: Mapping[str, Choice]) -> list[Choice | Covered]:
    """Per unit: its choice, or what it does inside a chosen segment (`memory.segment_terms.Covered`)."""
    covered = covered_units(profile, choices)
    return [covered.get(u, choices.get(unit.name, unit.base)) for u, unit in enumerate(profile.units)]


def _delta_held(profile: Profile, u: int, choice: Choice | Covered) -> int:
    return member_held_delta(profile, u) if isinstance(choice, Covered) else profile.units[u].delta_held(choice)


def held_changes(profile: Profile, choices: Mapping[str, Choice]) -> list[int]:
    """Per unit: the change, against the timeline, of the bytes alive through its window because of it."""
    chosen = _choices_list(profile, choices)
    base = [unit.base for unit in profile.units]
    tensors = shared_tensors(profile)
    extra, base_extra = shared_bytes(profile, chosen, tensors), _once(profile, "base shared", lambda: shared_bytes(profile, base, tensors))
    return [_delta_held(profile, u, c) + e - b for u, (c, e, b) in enumerate(zip(chosen, extra, base_extra))]


def kept_flags(profile: Profile, tensor: SharedTensor, chosen: Sequence[Choice | Covered]) -> list[bool]:
    """kept[j]: whether any of the tensor's holders 0..j keeps it."""
    flags, kept = [], False
    for holder in tensor.holders:
        kept = kept or holds(profile, holder, chosen[holder.unit])
        flags.append(kept)
    return flags


def alive_regardless(tensor: SharedTensor, windows: list[tuple[int, int]]) -> dict[int, int]:
    """Phases where the tensor is alive whatever its holders choose.

    That is from its making until it is read for the last time in forward, and, when an op outside
    the units saved it, until that op's backward. Maps phase index -> the last holder (index into
    tensor.holders) whose window holds the phase; the held changes credit that holder's kept-flag
    to the phase, which must not count there.
    """
    starts = [windows[h.unit][0] for h in tensor.holders]
    end = max(starts[-1], tensor.last_use)
    if tensor.last_use > starts[-1]:
        # Read last by the rest of the model, it is usually still named by a Python variable there
        # (`y = self.up(y); y = self.block(cat(y, skip))`) until the next unit returns.
        later = [forward for forward, _ in windows if forward > tensor.last_use]
        end = min(later) if later else end
    consumed = [start for start, h in zip(starts, tensor.holders) if h.side == "in"]
    if consumed:
        end = max(end, consumed[-1] + 1)  # the caller still holds a unit's arguments as the unit returns
    end = max(end, tensor.rest_until)
    result = {}
    for index in range(starts[0] + 1, end + 1):
        # the holders credited here are those whose window holds this phase: a prefix of them
        containing = [j for j, h in enumerate(tensor.holders) if windows[h.unit][0] < index <= windows[h.unit][1]]
        if containing:
            result[index] = containing[-1]
    return result


def live_bytes(profile: Profile, choices: Mapping[str, Choice]) -> list[int]:
    """Predicted peak bytes of every phase of the step on one GPU (add `rank_offsets` for FSDP)."""
    chosen = _choices_list(profile, choices)
    base = [unit.base for unit in profile.units]
    held = held_changes(profile, choices)
    # per phase: the units whose held bytes are alive there, and those whose choice changes its transient ("held": none)
    terms = _once(profile, "point terms", lambda: [(p.base_bytes, tuple(u for u, r in p.relations if r in HOLDING),
                                                    tuple((u, r) for u, r in p.relations if r != "held")) for p in points(profile)])
    live = [base_bytes + sum(held[u] for u in holding) + sum(transient_delta(profile.units[u], r, chosen[u]) for u, r in changing)
            for base_bytes, holding, changing in terms]
    for tensor, phases, kept_base in _once(profile, "alive", lambda: [  # with who keeps each at the base choices
            (t, alive_regardless(t, unit_windows(profile)), kept_flags(profile, t, base)) for t in shared_tensors(profile)]):
        kept = kept_flags(profile, tensor, chosen)
        for index, last in phases.items():
            live[index] += tensor.bytes * (kept_base[last] - kept[last])
    for candidate, choice in chosen_segments(profile, choices):
        for index, nbytes in segment_terms(profile, candidate, choice).phase_bytes.items():
            live[index] += nbytes
    return live


@dataclass(frozen=True)
class PeakPrediction:
    bytes: int
    phase: Phase
    breakdown: MemoryBreakdown
    rank: ShardedPeak | None = None  # on a mesh of more than one device: the same peak in FSDP's terms


def predict_peak(profile: Profile, choices: Mapping[str, Choice], mesh: Mesh = Mesh()) -> PeakPrediction:
    """The predicted peak of a training step under `choices`, where it happens, and what it is made of.

    On a mesh that shards (FSDP) it is rank 0's peak: parameters are its shards plus the gathered
    ones, transient includes FSDP's communication buffers.
    """
    # FSDP's terms once: the per-rank constants and the breakdown at the peak both come from them
    terms = _once(profile, ("rank terms", mesh), lambda: rank_terms(profile, mesh)) if mesh.shards > 1 else None
    offsets = _once(profile, ("rank offsets", mesh), lambda: rank_offsets(profile, mesh, terms))
    chosen, on_mesh = _choices_list(profile, choices), points(profile, mesh)
    copied = [copy_out_bytes(profile, point, chosen[point.start[0]]) if point.start else 0 for point in on_mesh]
    live = [single + offset + extra for single, offset, extra in zip(live_bytes(profile, choices), offsets, copied)]
    index = max(range(len(live)), key=live.__getitem__)
    phase = profile.timeline.phases[index]
    held = held_changes(profile, choices)
    start = phase.start_bytes + sum(held[u] for u, relation in points(profile)[index].relations if relation in HOLDING)
    static = profile.timeline.static
    activations = start - static.parameters - static.optimizer - phase.grad_bytes - static.workspaces - static.loop_held
    breakdown = MemoryBreakdown(
        parameters=static.parameters,
        gradients=phase.grad_bytes,
        optimizer=static.optimizer,
        activations=activations,
        transient=live[index] - offsets[index] - copied[index] - start,  # one GPU's transient
        workspaces=static.workspaces, loop_held=static.loop_held,
    )
    if terms is None:  # one GPU
        return PeakPrediction(live[index], phase.phase, breakdown)
    rank = _rank_peak(phase.phase, terms[index], live[index], mesh, copied[index])
    # outside the optimizer step activations and transients are a single GPU's; in it, 1/N of them
    transient = breakdown.transient if phase.kind != "step" else 0
    sharded = MemoryBreakdown(
        parameters=rank.parameters + rank.gathered_parameters,
        gradients=rank.gradients,
        optimizer=rank.optimizer,
        activations=rank.activations - transient - static.workspaces - static.loop_held,
        transient=rank.communication_buffers + transient,
        workspaces=static.workspaces,  # each rank's own, not sharded
        loop_held=static.loop_held,  # each rank's loop holds its own
    )
    return PeakPrediction(live[index], phase.phase, sharded, rank)


def predict_step_time(profile: Profile, choices: Mapping[str, Choice]) -> float:
    """Step time: the base step's (roofline, or measured), with each unit's time swapped for its chosen one."""
    chosen = _choices_list(profile, choices)
    change = sum((0.0 if isinstance(c, Covered) else unit.options[c].time_s) - unit.options[unit.base].time_s for unit, c in zip(profile.units, chosen))
    change += sum(segment_terms(profile, candidate, choice).time_s for candidate, choice in chosen_segments(profile, choices))
    base = profile.base_step_time_s if profile.base_step_time_s is not None else profile.timeline.step_time_s
    return base + change


def host_peak(profile: Profile, choices: Mapping[str, Choice]) -> int:
    """Pinned host bytes the offloaded units hold at once: each from its forward to its backward, so all
    of them when the first backward begins."""
    chosen = _choices_list(profile, choices)
    return sum(unit.options[c].host_bytes for unit, c in zip(profile.units, chosen) if not isinstance(c, Covered))


# -- per-phase split and sharding (for the report's curve and the advice) ----------------------


@dataclass(frozen=True)
class PhaseBytes:
    """One phase of the step under some choices: its predicted peak, and how much of it is static."""

    phase: Phase
    live_bytes: int  # predicted peak of the phase (what the solver constrains)
    static_bytes: int  # parameters + optimizer state + gradients alive when the phase began

    @property
    def activation_bytes(self) -> int:
        """Everything else: the batch, saved activations, temporaries (optimizer temporaries in "step")."""
        return self.live_bytes - self.static_bytes

    @property
    def kind(self) -> str:
        return self.phase.kind


def phase_bytes(profile: Profile, choices: Mapping[str, Choice]) -> list[PhaseBytes]:
    """The memory model's prediction for every phase, split into static and batch-dependent bytes."""
    static = profile.timeline.static
    return [
        PhaseBytes(phase.phase, live, static.parameters + static.optimizer + phase.grad_bytes)
        for phase, live in zip(profile.timeline.phases, live_bytes(profile, choices))
    ]


def _rank_peak(phase: Phase, terms: RankTerms, live: int, mesh: Mesh, copied: int) -> ShardedPeak:
    """`copied`: what the phase's start holds beyond the terms (`copy_out_bytes`), counted as buffers."""
    fsdp = terms.parameters + terms.gradients + terms.optimizer + terms.gathered + terms.buffers + copied
    return ShardedPeak(
        mesh.size, phase, terms.parameters, terms.gradients, terms.optimizer, terms.gathered, terms.buffers + copied,
        activations=live - fsdp,
    )


def sharded_peak(profile: Profile, choices: Mapping[str, Choice], mesh: Mesh) -> ShardedPeak:
    """Rank 0's peak on `mesh` with `choices` (on one device, exactly `predict_peak`)."""
    prediction = predict_peak(profile, choices, mesh)
    if prediction.rank is not None:
        return prediction.rank
    b = prediction.breakdown
    return ShardedPeak(1, prediction.phase, b.parameters, b.gradients, b.optimizer, 0, 0, b.total - b.parameters - b.gradients - b.optimizer)
