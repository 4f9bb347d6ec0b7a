"""FSDP2's per-rank terms (`memory.sharded.rank_terms`): what reshard_after_forward=False keeps gathered, phase by phase."""

from __future__ import annotations

from autoplan.inputs.devices import get_device
from autoplan.memory.sharded import FSDP, GroupBytes, rank_terms
from autoplan.mesh import Mesh
from autoplan.profile.profiler import profile
from autoplan.trace.tracer import trace
from tests.fsdp_model import rank_batch, tiny_llama


def test_units_kept_gathered_hold_every_unit_from_its_forward_until_its_backward_ends() -> None:
    model, config = tiny_llama()
    measured = profile(trace(model, (rank_batch(config, 0), {})), get_device("cpu"))
    ranks = Mesh.fsdp(2).along(FSDP)
    unit = {u.name: GroupBytes.of(u.param_layout, ranks).unsharded for u in measured.units}
    reduced = {u.name: GroupBytes.of(u.param_layout, ranks).reduce_input for u in measured.units}
    root = GroupBytes.of(measured.rest_param_layout, ranks).unsharded
    resharded, kept = rank_terms(measured, Mesh.fsdp(2)), rank_terms(measured, Mesh.fsdp(2, reshard_after_forward=False))
    run, finished, last_finished = [], set(), ""
    for phase, again, held in zip(measured.timeline.phases, resharded, kept):
        if phase.kind == "fwd" and phase.unit in unit and phase.unit not in run:
            run.append(phase.unit)
        if phase.kind == "fwd":  # every unit run so far, not only the running one
            assert held.gathered == root + sum(unit[name] for name in run)
        elif phase.kind == "bwd":
            assert held.gathered == root + sum(size for name, size in unit.items() if name not in finished)
            if phase.unit is not None:
                assert held.gathered >= again.gathered  # never fewer than resharding's running and prefetched units
                # the reduce-scatter input of the unit before it (none in the first), as resharding; but a kept unit is
                # not gathered again for its backward: no all-gather output at its start
                assert held.buffers == (reduced[last_finished] if finished else 0) == again.buffers
                assert held.start_extra == 0
                finished.add(phase.unit)  # from the next phase on: its backward has ended and resharded it
                last_finished = phase.unit
                continue
        assert (held.parameters, held.optimizer, held.buffers) == (again.parameters, again.optimizer, again.buffers)
    assert len(run) == len(unit) == 4 and max(t.gathered for t in kept) == root + sum(unit.values()) > max(t.gathered for t in resharded)
    # resharding gathers the first block again for its backward, with nothing prefetched beside it: its all-gather output
    first = measured.timeline.phases.index(next(p for p in measured.timeline.phases if p.kind == "bwd" and p.unit == "layers.0"))
    assert resharded[first].start_extra == GroupBytes.of(measured.units[0].param_layout, ranks).flat > 0


def test_a_phase_start_holds_the_all_gather_output_being_copied_out_and_counts_where_the_rise_is_smaller() -> None:
    """FSDP2 copies a group's parameters out of its flat all-gather output at the start of the group's forward (the
    previous group's output still alive) and of its backward (before it prefetches the next): those moments hold the
    buffers the phase's terms do not, beside the activations of the phase's start, not of its peak."""
    from autoplan.memory.model import copy_out_bytes, points
    from autoplan.memory.sharded import on_rank

    model, config = tiny_llama()
    measured = profile(trace(model, (rank_batch(config, 0), {})), get_device("cpu"))
    mesh = Mesh.fsdp(2)
    flat = [GroupBytes.of(u.param_layout, 2).flat for u in measured.units]
    terms, phases = rank_terms(measured, mesh), measured.timeline.phases
    forward = [i for i, p in enumerate(phases) if p.kind == "fwd" and p.unit in {u.name for u in measured.units}]
    assert [terms[i].buffers for i in forward] == flat  # while a block computes: its own output
    assert [terms[i].start_extra for i in forward[1:]] == flat[:-1]  # at its start: the previous block's too
    last_backward = next(i for i, p in enumerate(phases) if p.kind == "bwd" and p.unit == "layers.0")
    point = points(measured, mesh)[last_backward]
    assert point.start is not None and point.start[:3] == (0, "bwd", flat[0])
    unit = measured.units[0]
    keep, full = (next(c for c in unit.options if c.mode == mode and c.precision == "fp32") for mode in ("keep", "full"))
    # recomputing the block raises its backward's activations further above the start than keeping it does
    assert copy_out_bytes(measured, point, keep) >= copy_out_bytes(measured, point, full)
    assert copy_out_bytes(measured, point, keep) == max(0, flat[0] - point.start[3])
    assert on_rank(100, 90, 5, 20) == 115 and on_rank(100, 90, 5, 5) == 105  # the start moment, else the peak


def test_a_unit_kept_gathered_alone_adds_its_parameters_only_where_resharding_would_have_freed_them() -> None:
    """torchtitan's default: the last block keeps what it gathered (its backward comes next); the rest reshard."""
    model, config = tiny_llama()
    measured = profile(trace(model, (rank_batch(config, 0), {})), get_device("cpu"))
    last = GroupBytes.of(measured.units[-1].param_layout, 2).unsharded
    resharded = rank_terms(measured, Mesh.fsdp(2))
    kept_last = rank_terms(measured, Mesh.fsdp(2, reshard_after_forward=(("layers.3", False),)))
    differences = [kept.gathered - again.gathered for kept, again in zip(kept_last, resharded)]
    assert set(differences) == {0, last}  # held after its forward (the head's phases), never twice
    first_held = differences.index(last)
    assert measured.timeline.phases[first_held - 1].phase.unit == "layers.3"  # from the end of its forward on


def test_a_mixed_precision_policy_keeps_and_reduces_in_fp32_what_it_gathers_in_bf16() -> None:
    """`GroupBytes.of` on a layout profiled in bf16 (what the policy computes with), for shards kept in fp32."""
    from autoplan.profile.layout import ParamShape

    layout = (ParamShape(rows=1000, row_numel=256, itemsize=2), ParamShape(rows=3, row_numel=1, itemsize=2))
    plain, mixed = GroupBytes.of(layout, 4), GroupBytes.of(layout, 4, kept_per_computed=2)
    assert (mixed.full, mixed.unsharded, mixed.flat) == (plain.full, plain.unsharded, plain.flat)  # bf16, as gathered
    assert mixed.sharded == 250 * 256 * 4 + 512 and mixed.grad_shard == 256_512  # fp32, in 512 B blocks: (250 × 256 + 1) × 4 rounded up
    assert mixed.reduce_input == -(-(4 * (250 * 256 + 1) * 4) // 512) * 512 and plain.reduce_input == plain.flat


def test_the_report_names_which_units_hold_gathered_parameters() -> None:
    assert Mesh.fsdp(2).gathered_words == "root, running and prefetched unit"
    assert Mesh.fsdp(2, reshard_after_forward=False).gathered_words == "root and every unit between its forward and backward"
    kept_last = Mesh.fsdp(2, reshard_after_forward=(("layers.31", False), ("layers.*", True)))
    assert kept_last.gathered_words == "root, running and prefetched unit, and layers.31 from its forward to its backward"
