"""The checkpoint axis: its modes, what the fixed selective rule saves, and how ties are broken across axes."""

from __future__ import annotations

import pytest
import torch

from autoplan.axes.checkpoint import CHECKPOINT, MODES, OccurrencePolicy, can_save, checkpointed, op_name
from autoplan.errors import OptionError
from autoplan.plan import Choice


def test_modes_in_the_order_of_rewriting():
    assert MODES == ("keep", "selective", "full")
    assert [CHECKPOINT.rewriting(mode) for mode in MODES] == [0, 1, 2]
    assert [checkpointed(mode) for mode in MODES] == [False, True, True]
    with pytest.raises(OptionError, match=r"unknown checkpoint mode 'none'; expected one of \('keep', 'selective', 'full'\)"):
        Choice("none")


def test_a_choice_rewrites_as_much_as_its_axes_together():
    assert Choice("keep", "fp32").rewriting == 0
    assert Choice("full", "bf16", placement="host").rewriting == 2 + 1 + 3


def test_the_fixed_rule_saves_matmuls_and_names_ops_by_overload_packet():
    policy = OccurrencePolicy(None)

    class Context:
        op_output = None

    mm, relu = torch.ops.aten.mm.default, torch.ops.aten.relu.default
    assert policy(Context(), mm).name == "MUST_SAVE" and policy(Context(), relu).name == "PREFER_RECOMPUTE"
    assert policy.counts == {"aten.mm": 1, "aten.relu": 1}
    assert op_name(mm) == "aten.mm" and op_name(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default) == "aten.sdpa"
    assert can_save(mm) and not can_save(torch.ops.aten.relu_.default)


def test_a_rank_twins_collectives_are_named_as_the_ops_dtensor_dispatches():
    """A plan of a tensor-parallel slice that saves a reduce-scatter's output names it as torch's functional collective,
    the op torch's selective checkpointing sees in the real DTensor step (named "autoplan.reduce_scattered", the real
    step recomputed it: a Qwen2 under sequence parallelism counted 64 KiB under its plan)."""
    import torch.distributed._functional_collectives  # noqa: F401 - registers the _c10d_functional ops

    from autoplan.instruments.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

    real = torch.ops._c10d_functional
    for twin, op in ((ALL_REDUCE, real.all_reduce), (ALL_GATHER, real.all_gather_into_tensor), (REDUCE_SCATTER, real.reduce_scatter_tensor)):
        assert op_name(twin) == op_name(op.default) == str(op.default.overloadpacket)
        assert can_save(twin) and can_save(op.default)
    policy = OccurrencePolicy(("_c10d_functional.reduce_scatter_tensor#0",))
    assert policy(None, REDUCE_SCATTER).name == "MUST_SAVE" and policy(None, REDUCE_SCATTER).name == "PREFER_RECOMPUTE"
