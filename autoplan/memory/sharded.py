"""What FSDP2 adds to, and takes from, one rank's memory: the arithmetic behind the per-rank model.

`memory.model` turns a single-GPU prediction into a per-rank one with these terms, for a mesh whose
dimension is FSDP's (`mesh.FSDP`: each rank holds 1/N of the state and trains its own batch); this
module only knows FSDP2's buffers (torch.distributed.fsdp.fully_shard, read from its source in torch 2.13):

- every parameter is sharded on dim 0, padded to a multiple of N rows: each rank keeps
  ceil(rows / N) rows of it, one storage per parameter;
- to run a group (a unit, or the root: everything outside the units) FSDP all-gathers it into
  one flat buffer of N shards, then copies out into one padded, unsharded storage per parameter;
  in forward the flat buffer is kept until the next group's copy-out; in backward it is freed at the copy-out,
  after which the next group's all-gather is issued (the prefetch). A copy-out happens at its phase's start,
  before the unit's activations rise: `RankTerms.start_extra` is what that moment holds beyond the phase's terms;
- the root stays unsharded from its forward until the end of its backward (FSDP2 does not reshard
  the root after forward);
- in backward each group's gradients are made unsharded by autograd, copied into one flat
  reduce-scatter input (kept until the next group's reduce-scatter) and reduced into one flat
  shard per rank, which holds that rank's gradients of the group until zero_grad;
- buffers are not sharded;
- with `reshard_after_forward=False` (the mesh's, for every unit or per unit) a unit's gathered parameters stay
  from its forward until its backward has finished, which gathers nothing; the flat buffers are as above;
- a module called k times per forward (call-site units `block@0` … `block@{k-1}`) is one group:
  its shards, its gradient shard and its optimizer state count once, but every call gathers it
  again (in forward and in backward), and its gradient shard exists from the first call whose
  backward finishes (later calls' gradients are reduced into it).

Sizes are rounded like the caching allocator (512 bytes per storage). Rank 0 holds the largest
shards (the ceiling), so these are its bytes: the rank that peaks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoplan.errors import OptionError
from autoplan.mesh import FSDP, Mesh
from autoplan.plan import Phase
from autoplan.profile.layout import ParamShape
from autoplan.units import CallSite, ModuleUnit, Unit
from autoplan.vocabulary.names import match_units
from autoplan.vocabulary.tensors import rounded_bytes

if TYPE_CHECKING:
    from autoplan.profile.profiler import Profile


@dataclass(frozen=True)
class GroupBytes:
    """One FSDP group on one rank of `ranks`."""

    full: int  # its parameters unsharded and unpadded, as computed in: what one GPU holds, and its gradients' size
    sharded: int  # this rank's padded shards, one storage per parameter (alive all the time)
    unsharded: int  # the gathered, padded parameters while the group runs
    flat: int  # one flat all-gather output: N shards
    grad_shard: int  # the flat reduce-scatter output: this rank's gradients of the group
    reduce_flat: int = -1  # one flat reduce-scatter input: N shards (-1: as `flat`, parameters reduced as gathered)

    @property
    def reduce_input(self) -> int:
        return self.flat if self.reduce_flat < 0 else self.reduce_flat

    @staticmethod
    def of(layout: tuple[ParamShape, ...], ranks: int, kept_per_computed: int = 1) -> "GroupBytes":
        """`layout` in the dtype the group computes in; `kept_per_computed`: bytes of the dtype its shards are kept and
        its gradients reduced in per byte of that one (FSDP2's MixedPrecisionPolicy: fp32 over bf16 is 2)."""
        shards = [p.shard_bytes(ranks) for p in layout]
        return GroupBytes(
            full=sum(rounded_bytes(p.rows * p.row_numel * p.itemsize) for p in layout),
            sharded=sum(rounded_bytes(s * kept_per_computed) for s in shards),
            unsharded=sum(rounded_bytes(s * ranks) for s in shards),
            flat=rounded_bytes(sum(shards) * ranks) if shards else 0,
            grad_shard=rounded_bytes(sum(shards) * kept_per_computed) if shards else 0,
            reduce_flat=rounded_bytes(sum(shards) * ranks * kept_per_computed) if shards else 0,
        )


@dataclass(frozen=True)
class RankTerms:
    """FSDP's part of one phase on one rank; what the single-GPU timeline had instead is replaced."""

    parameters: int  # this rank's shards of every group, plus the (unsharded) buffers
    gradients: int  # gradients alive as the phase begins: shards of reduced groups, the root's unsharded
    optimizer: int  # this rank's optimizer state
    gathered: int  # unsharded parameters: the root, the running unit and the prefetched one
    buffers: int  # all-gather outputs and reduce-scatter inputs alive while the phase's unit computes
    step_share: float  # the fraction of the optimizer step's temporaries on this rank (1.0 outside "step")
    # what the phase's start holds beyond those terms, before its activations rise: the unit's all-gather output while
    # its parameters are copied out of it (in forward the previous group's too), less a prefetch not yet issued
    start_extra: int = 0


def rank_terms(profile: "Profile", mesh: Mesh) -> list[RankTerms]:
    """Per phase of the profiled step: FSDP's terms on rank 0 of the mesh's FSDP dimension.

    Units are FSDP groups in forward order; in backward the group before the running one is prefetched (FSDP2's
    default), in forward the previous group's flat all-gather output is alive until the next one's copy-out (the
    phase's start: `RankTerms.start_extra`). The root's unsharded gradients are reduced at the end of backward. Each
    term is a constant of the phase, whatever the units choose: the solver's per-rank constraints are its single-GPU
    ones with another constant."""
    ranks, kept_per_computed = mesh.along(FSDP), kept_bytes_ratio(mesh)
    units = [GroupBytes.of(unit.param_layout, ranks, kept_per_computed) for unit in profile.units]
    group = [fsdp_group(unit.unit) for unit in profile.units]  # the module each unit runs: call sites share one
    root = GroupBytes.of(profile.rest_param_layout, ranks, kept_per_computed)
    groups = list({key: units[i] for i, key in enumerate(group)}.values()) + [root]  # each module once
    phase_count = len(profile.timeline.phases)
    position = {unit.name: i for i, unit in enumerate(profile.units)}  # forward order
    phase_index = {sample.phase: i for i, sample in enumerate(profile.timeline.phases)}
    # (index of the unit's backward phase, unit) in the order backward finishes them
    backward_order = sorted((phase_index.get(Phase("bwd", u.name), phase_count), i) for i, u in enumerate(profile.units))
    last_backward = max((i for i, phase in enumerate(profile.timeline.phases) if phase.kind == "bwd"), default=-1)
    static = profile.timeline.static
    full = sum(g.full for g in groups)
    sharded = sum(g.sharded for g in groups)
    share = sharded / full if full else 1.0
    parameters = sharded + profile.buffer_bytes
    optimizer = _optimizer_shard(static.optimizer, full, sharded)
    result = []
    last_forward_group = root  # whose flat all-gather output is still alive in forward
    kept, run = kept_gathered(profile, mesh), dict[Unit, int]()  # units kept gathered until backward; those run so far
    done: list[int] = []  # units whose backward has finished, in the order they finished
    reduced: set[Unit] = set()  # groups with a gradient shard: one of their calls finished backward
    done_full = done_shards = 0
    for index, phase in enumerate(profile.timeline.phases):
        running = position.get(phase.unit) if phase.unit is not None else None
        while len(done) < len(units) and backward_order[len(done)][0] < index:
            unit = backward_order[len(done)][1]
            done.append(unit)
            if group[unit] not in reduced:
                reduced.add(group[unit])
                done_full, done_shards = done_full + units[unit].full, done_shards + units[unit].grad_shard
        if phase.kind == "step":
            gradients = sum(g.grad_shard for g in groups) if phase.grad_bytes else 0
            result.append(RankTerms(parameters, gradients, optimizer, 0, 0, share))
            continue
        if phase.kind == "fwd":
            gathered = root.unsharded + _gathered_in_forward(units, group, running, kept, run)
            buffers, start_extra = last_forward_group.flat, 0
            if running is not None:  # the previous group's output lives until this group's copy-out, at the start
                buffers, start_extra = units[running].flat, last_forward_group.flat
                last_forward_group = units[running]
            result.append(RankTerms(parameters, 0, optimizer, gathered, buffers, 1.0, start_extra))
            continue
        # backward: the running unit and the one before it (prefetched) are gathered; between
        # units, the next unit to run backward (prefetched by the one that just finished)
        gathered = root.unsharded + _gathered_in_backward(units, group, running, done, kept)
        buffers = units[done[-1]].reduce_input if done else 0  # kept until the next reduce-scatter
        if index == last_backward:
            buffers = max(buffers, root.reduce_input - root.unsharded)  # the root's reduce-scatter, once it is resharded
        gradients = done_shards + max(0, phase.grad_bytes - done_full)  # the root's stay unsharded until the end
        result.append(RankTerms(parameters, gradients, optimizer, gathered, buffers, 1.0, _copy_out_excess(units, group, running, kept)))
    return result


@dataclass(frozen=True)
class ShardPadding:
    """What FSDP's padding costs rank 0 where some parameters have fewer rows (dim 0) than there are ranks: each
    rank then holds a whole padded row of such a parameter, and gathering it makes `ranks` rows of it."""

    short: int  # parameters with fewer rows than ranks
    parameters: int  # every parameter (each FSDP group's once)
    fewest_rows: int  # the fewest rows of any parameter: at most this many ranks pad no parameter whole rows
    shard_bytes: int  # rank 0's parameter shards, padded (its gradient and optimizer-state shards are alike)
    even_bytes: int  # the same parameters split evenly over the ranks
    gathered_bytes: int  # the largest group's gathered parameters, padded
    gathered_full_bytes: int  # that group's parameters as one GPU holds them


def shard_padding(profile: "Profile", mesh: Mesh) -> ShardPadding | None:
    """FSDP's padding on rank 0 when some parameter has fewer rows than the mesh has FSDP ranks; None otherwise,
    where padding is at most a row per parameter."""
    ranks = mesh.along(FSDP)
    layouts = list({fsdp_group(unit.unit): unit.param_layout for unit in profile.units}.values()) + [profile.rest_param_layout]
    shapes = [shape for layout in layouts for shape in layout]
    short = [shape for shape in shapes if shape.rows < ranks]
    if ranks <= 1 or not short:
        return None
    groups = [GroupBytes.of(layout, ranks) for layout in layouts]
    largest = max(groups, key=lambda group: group.unsharded)
    return ShardPadding(
        short=len(short), parameters=len(shapes), fewest_rows=min(shape.rows for shape in shapes),
        shard_bytes=sum(shape.shard_bytes(ranks) for shape in shapes) * kept_bytes_ratio(mesh),  # kept as FSDP keeps them
        even_bytes=-(-sum(shape.rows * shape.row_numel * shape.itemsize for shape in shapes) * kept_bytes_ratio(mesh) // ranks),
        gathered_bytes=largest.unsharded, gathered_full_bytes=largest.full,
    )


def _optimizer_shard(optimizer: int, full: int, sharded: int) -> int:
    """This rank's optimizer state: state shaped like each parameter (AdamW: two) is sharded, the rest
    (AdamW's step counters) is not."""
    per_parameter = optimizer // full if full else 0
    return per_parameter * sharded + optimizer - min(optimizer, per_parameter * full)


def kept_gathered(profile: "Profile", mesh: Mesh) -> frozenset[int]:
    """Positions of the units that keep their gathered parameters from forward to backward (the mesh's
    reshard_after_forward False for them); refused for a module called more than once per forward, whose calls
    FSDP2 gathers and frees between."""
    names = [unit.name for unit in profile.units]
    kept_by_name = kept_names(mesh.reshard_after_forward, names)
    kept = {i for i, name in enumerate(names) if name in kept_by_name}
    calls = [str(profile.units[i].unit) for i in sorted(kept) if isinstance(profile.units[i].unit, CallSite)]
    if calls:
        raise OptionError(f"reshard_after_forward=False is not modelled for a module called more than once per forward "
                          f"({', '.join(calls)[:120]}): plan it with reshard_after_forward=True (FSDP2's default) for those")
    return frozenset(kept)


def kept_bytes_ratio(mesh: Mesh) -> int:
    """Bytes per parameter element of the dtype FSDP keeps shards and reduces gradients in, over the one the profile
    computed in: 2 under a MixedPrecisionPolicy (fp32 kept and reduced, bf16 or fp16 gathered); else 1."""
    return 2 if mesh.param_dtype else 1


def kept_names(setting: bool | tuple[tuple[str, bool], ...], names: list[str]) -> set[str]:
    """The units (of `names`) that `setting` (a mesh's reshard_after_forward) keeps gathered from forward to backward:
    none, all, or per unit the first (pattern, reshard) pair whose pattern it matches (unmatched: resharded)."""
    if isinstance(setting, bool):
        return set() if setting else set(names)
    matched = [(match_units(names, pattern, "reshard_after_forward"), reshard) for pattern, reshard in setting]
    return {name for name in names if not next((reshard for units, reshard in matched if name in units), True)}


def _gathered_in_forward(units: list[GroupBytes], group: list[Unit], running: int | None, kept: frozenset[int],
                         run: dict[Unit, int]) -> int:
    """Unsharded unit parameters in a forward phase: the running unit's, and every kept unit run so far (`run`,
    which this adds the running unit's group to if it is kept)."""
    if running is not None and running in kept:
        run.setdefault(group[running], units[running].unsharded)
    return sum(run.values()) + (units[running].unsharded if running is not None and running not in kept else 0)


def _gathered_in_backward(units: list[GroupBytes], group: list[Unit], running: int | None, done: list[int],
                          kept: frozenset[int]) -> int:
    """Gathered unit parameters in a backward phase: every kept unit whose backward has not finished (`done`), and
    of the others the running unit (unsharded) and the one before it (prefetched: its flat all-gather output, copied
    out only when its own backward starts); between units, the next to run backward (prefetched, flat)."""
    held = sum(units[i].unsharded for i in kept - set(done))
    remaining = len(units) - len(done)  # units at positions < remaining have not finished backward
    if running is None:
        return held + (units[remaining - 1].flat if remaining > 0 and remaining - 1 not in kept else 0)
    prefetched = running > 0 and group[running - 1] != group[running] and running - 1 not in kept  # a module gathered once
    own = units[running].unsharded if running not in kept else 0
    return held + own + (units[running - 1].flat if prefetched else 0)


def _copy_out_excess(units: list[GroupBytes], group: list[Unit], running: int | None, kept: frozenset[int]) -> int:
    """What FSDP2's pre-backward holds beyond the terms of the running unit's backward: the unit's flat all-gather
    output while its parameters are copied out of it, less the prefetched unit's, which it issues only after the copy
    (the terms count that one). A kept unit is not gathered again for its backward."""
    if running is None or running in kept:
        return 0
    prefetched = running > 0 and group[running - 1] != group[running] and running - 1 not in kept
    return max(0, units[running].flat - (units[running - 1].flat if prefetched else 0))


def rank_offsets(profile: "Profile", mesh: Mesh, terms: list[RankTerms] | None = None) -> list[int]:
    """Per phase: rank 0's bytes under FSDP minus one GPU's, whatever the units choose, while the phase's unit computes
    (its start, where FSDP copies parameters out, can hold more: `RankTerms.start_extra`, `rank_moments`, `on_rank`).

    FSDP replaces the full parameters, gradients and optimizer state by this rank's shards and adds
    gathered parameters and communication buffers (`rank_terms`); activations are the
    same on every rank (each runs its own batch), except the optimizer step's temporaries, which
    are per parameter and so sharded. Zero everywhere for one GPU: no FSDP. `terms`: the
    `rank_terms` of this profile and mesh, when the caller has them already.
    """
    if mesh.shards == 1:
        return [0] * len(profile.timeline.phases)
    static = profile.timeline.static
    offsets = []
    for phase, term in zip(profile.timeline.phases, terms if terms is not None else rank_terms(profile, mesh)):
        activations = phase.peak_bytes - (static.parameters + static.optimizer + phase.grad_bytes)
        sharded_activations = int(activations * term.step_share) if phase.kind == "step" else activations
        rank = term.parameters + term.gradients + term.optimizer + term.gathered + term.buffers + sharded_activations
        offsets.append(rank - phase.peak_bytes)
    return offsets


def rank_moments(profile: "Profile", mesh: Mesh) -> tuple[list[int], list[int]]:
    """Per phase, `rank_offsets` and `RankTerms.start_extra` (0 everywhere on one GPU), from one `rank_terms`."""
    if mesh.shards == 1:
        return rank_offsets(profile, mesh), [0] * len(profile.timeline.phases)
    terms = rank_terms(profile, mesh)
    return rank_offsets(profile, mesh, terms), [term.start_extra for term in terms]


def phase_offsets(profile: "Profile", mesh: Mesh) -> tuple[dict[Phase, int], dict[Phase, int]]:
    """`rank_moments` by phase, for a simulated step's timeline (`on_rank`)."""
    phases = [sample.phase for sample in profile.timeline.phases]
    offsets, extras = rank_moments(profile, mesh)
    return dict(zip(phases, offsets)), dict(zip(phases, extras))


def on_rank(peak_bytes: int, start_bytes: int, offset: int, start_extra: int) -> int:
    """A phase's bytes on one rank: the higher of its peak with FSDP's terms, and its start (before the activations
    rise) with what FSDP holds there beyond them."""
    return max(peak_bytes + offset, start_bytes + offset + start_extra)


def fsdp_group(unit: Unit) -> Unit:
    """The FSDP group a unit runs in: its module (`block` for the call site `block@2`), else itself."""
    return ModuleUnit(unit.module) if isinstance(unit, CallSite) else unit
