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
                # a kept unit is not gathered again for its backward: no all-gather output, only the reduce-scatter
                # input of the unit before it (none in the first)
                assert held.buffers == (reduced[last_finished] if finished else 0) <= again.buffers
                assert held.buffers < again.buffers or finished  # the first: resharding gathers it, keeping does not
                finished.add(phase.unit)  # from the next phase on: its backward has ended and resharded it
                last_finished = phase.unit
                continue
        assert (held.parameters, held.optimizer, held.buffers) == (again.parameters, again.optimizer, again.buffers)
    assert len(run) == len(unit) == 4 and max(t.gathered for t in kept) == root + sum(unit.values()) > max(t.gathered for t in resharded)


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
