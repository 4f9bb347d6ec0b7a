"""A plan carries the model and batch it was made for (`Plan.fingerprint`, `autoplan/vocabulary/fingerprint.py`).

Issue 27 item 4: `Net(d=64)`'s plan applied to `Net(d=256)` has the same unit names, so it used to be
applied silently with bytes and times for other shapes. apply and verify now refuse another model
with one error naming the parameter that differs; verify refuses another batch (its peak is for the
plan's batch), apply does not (the model is the same); check=False and plans without a fingerprint
skip the check.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import autoplan  # noqa: E402
from autoplan.cli.exits import ExitCode, exit_code_for  # noqa: E402
from autoplan.errors import PlanMismatchError  # noqa: E402
from tests.models import ResidualMLP  # noqa: E402


def _net(width: int = 32, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return ResidualMLP(width=width, hidden=2 * width).to(dtype)


def _batch(rows: int = 8, width: int = 32, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor]:
    return (torch.randn(rows, width, dtype=dtype),)


@pytest.fixture(scope="module")
def narrow_plan():
    # every unit checkpointed, so a wrongly applied plan would be visible in planned_choices
    return autoplan.plan(_net(), "1GB", example_inputs=_batch(), device="cpu", precision="fp32", checkpoint={"*": "full"})


def test_the_plan_names_the_model_and_batch_it_was_made_for(narrow_plan):
    fingerprint = json.loads(narrow_plan.to_json())["fingerprint"]
    assert fingerprint["parameters"]["blocks.0.fc1.weight"] == "64×32 float32"
    assert fingerprint["parameters"].keys() == dict(_net().named_parameters()).keys()
    assert fingerprint["batch"] == {"argument 0": "8×32 float32"}


def test_apply_refuses_a_wider_model_naming_the_parameter(narrow_plan):
    wide = _net(width=64)
    with pytest.raises(PlanMismatchError, match=re.escape("blocks.0.ln.weight is 64 float32 here, 32 float32 in the plan")) as error:
        autoplan.apply(wide, narrow_plan)
    assert "more parameters differ" in str(error.value) and "check=False" in str(error.value)
    assert autoplan.planned_choices(wide) == {}  # refused before anything changed
    assert exit_code_for(error.value) == ExitCode.USAGE


def test_apply_refuses_another_dtype(narrow_plan):
    with pytest.raises(PlanMismatchError, match=re.escape("is 32 float64 here, 32 float32 in the plan")):
        autoplan.apply(_net(dtype=torch.float64), narrow_plan)


def test_check_false_and_a_plan_without_fingerprint_apply_anyway(narrow_plan):
    wide = _net(width=64)
    assert autoplan.apply(wide, narrow_plan, check=False) is wide
    assert autoplan.planned_choices(wide) == narrow_plan.decisions.choices()
    by_hand = dataclasses.replace(narrow_plan, model=dataclasses.replace(narrow_plan.model, fingerprint=None))  # older JSON, or built by hand
    assert by_hand.to_dict()["fingerprint"] is None
    other = _net(width=64)
    autoplan.apply(other, by_hand)
    assert autoplan.planned_choices(other) == narrow_plan.decisions.choices()


def test_apply_takes_the_same_model_whatever_the_batch(narrow_plan):
    model = _net()
    autoplan.apply(model, narrow_plan)
    model(*_batch(rows=3)).sum().backward()  # another batch size trains: apply checked the model only
    assert autoplan.planned_choices(model) == narrow_plan.decisions.choices()


def test_verify_refuses_another_batch_saying_what_the_peak_is_for(narrow_plan):
    with pytest.raises(PlanMismatchError, match=re.escape("the plan's peak is for a batch of argument 0 8×32 float32")) as error:
        autoplan.verify(_net(), narrow_plan, example_inputs=_batch(rows=16))
    assert "argument 0 is 16×32 float32 here, 8×32 float32 in the plan" in str(error.value)
    result = autoplan.verify(_net(), narrow_plan, example_inputs=_batch(rows=16), check=False)
    assert result.measured_peak_bytes > 0


def test_verify_refuses_another_model(narrow_plan):
    wide = _net(width=64)
    with pytest.raises(PlanMismatchError, match="blocks.0.ln.weight"):
        autoplan.verify(wide, narrow_plan, example_inputs=_batch(width=64))
    assert autoplan.planned_choices(wide) == {}


@pytest.mark.slow  # the whole pipeline
def test_verify_and_optimize_take_the_model_and_batch_planned():
    model = _net()
    plan = autoplan.plan(model, "1GB", example_inputs=_batch(), device="cpu", precision="fp32")
    assert autoplan.verify(model, plan, example_inputs=_batch()).held
    assert autoplan.optimize(_net(), "1GB", example_inputs=_batch(), device="cpu", precision="fp32") is not None
