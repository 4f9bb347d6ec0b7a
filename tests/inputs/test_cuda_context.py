"""The CUDA context a plan reserves (inputs.cuda_context): measured per architecture, or the person's own."""

from __future__ import annotations

import pytest

import autoplan
from autoplan.errors import OptionError
from autoplan.inputs.budget import DEFAULT_FRAGMENTATION
from autoplan.inputs.cuda_context import ESTIMATE_BYTES, MEASURED, context_words, default_context
from tests.models import make_residual_mlp


def test_hopper_takes_the_h100_measurement_in_training_and_other_cards_the_estimate():
    h100 = next(m for m in MEASURED if m.default)
    assert default_context((9, 0)) == (h100.in_training_bytes, default_context((9, 0))[1])
    assert h100.in_training_bytes > h100.at_init_bytes > ESTIMATE_BYTES  # cuBLAS, cuDNN and attention add to the context
    assert context_words(default_context((9, 0))[1]) == "measured on an H100"
    assert default_context((8, 0))[0] == default_context((7, 0))[0] == ESTIMATE_BYTES
    assert context_words(default_context((8, 6))[1]) == "estimated"


def test_a_context_of_ones_own_replaces_the_cards_in_the_reserve_and_the_report():
    model, inputs = make_residual_mlp()
    given = autoplan.plan(model, "2GB", example_inputs=inputs, device="a100-80gb", cuda_context="1GB")
    assert given.request.context_bytes == 10**9 and given.request.context_source == "given: cuda_context='1GB'"
    assert given.request.budget_bytes - given.request.usable_bytes == 10**9 + int(DEFAULT_FRAGMENTATION * (2 * 10**9 - 10**9))
    report = given.report()
    assert "CUDA context (yours)" in report and "fragmentation allowance" in report
    card = autoplan.plan(model, "2GB", example_inputs=inputs, device="a100-80gb")
    assert card.request.context_bytes == ESTIMATE_BYTES and "CUDA context (estimated)" in card.report()
    assert given.to_dict()["context_bytes"] == 10**9


def test_a_context_for_a_cpu_or_no_size_is_refused_before_planning():
    model, inputs = make_residual_mlp()
    with pytest.raises(OptionError, match="GPU"):
        autoplan.Planner(model, example_inputs=inputs, device="cpu", cuda_context="1GB")
    with pytest.raises(ValueError, match="CUDA context"):
        autoplan.Planner(model, example_inputs=inputs, device="h100", cuda_context="lots")
