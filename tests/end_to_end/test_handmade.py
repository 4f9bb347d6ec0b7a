"""The by-hand baseline the plan-space guarantee is measured against (`tests/handmade.py`).

The baseline must measure what `autoplan.verify` measures, and checkpointing by hand must do what
it says (lower the peak, recompute FLOPs, train the same), or the guarantee tests prove nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autoplan
from tests.handmade import checkpoint_by_hand, measured_step
from tests.structures import by_name


@pytest.mark.slow  # the whole pipeline
def test_measured_step_counts_what_verify_counts():
    structure = by_name("blocks in a ModuleDict, called by key")
    model, inputs = structure.build()
    plan = autoplan.plan(model, budget="100%", example_inputs=inputs, device="cpu", precision="fp32", reserve=0)
    verified = autoplan.verify(model, plan, example_inputs=inputs, optimizer="adamw")
    assert measured_step(model, inputs).peak_bytes == verified.measured_peak_bytes


def test_checkpointing_by_hand_lowers_the_peak_recomputes_and_trains_the_same():
    structure = by_name("ModuleList of residual Sequential blocks")
    model, inputs = structure.build()
    by_hand = checkpoint_by_hand(copy.deepcopy(model), structure)
    plain, checkpointed = measured_step(model, inputs), measured_step(by_hand, inputs)
    assert checkpointed.peak_bytes < plain.peak_bytes
    assert checkpointed.flops > plain.flops
    for net in (model, by_hand):
        net(*inputs).sum().backward()
    for (name, a), b in zip(model.named_parameters(), by_hand.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_every_call_of_a_shared_block_is_checkpointed():
    structure = by_name("one block applied N times (shared weights)")
    model, inputs = structure.build()

    def recomputed(repeats: int) -> int:
        model.repeats = repeats
        plain = measured_step(model, inputs)
        return measured_step(checkpoint_by_hand(copy.deepcopy(model), structure), inputs).flops - plain.flops

    once = recomputed(1)
    assert once > 0 and recomputed(3) == 3 * once
