"""The precision axis: one file per precision, found by the axis; every stage asks it, and a device runs what it rates."""

from __future__ import annotations

import pkgutil

import pytest
import torch

from autoplan.axes import ChoiceAxis, precisions
from autoplan.axes.checkpoint import CHECKPOINT
from autoplan.axes.placement import PLACEMENT
from autoplan.axes.precision import (PRECISION, check_setting, choices_for, dtype_of, flops_for, kind, kinds, low_dtypes,
                                     low_precision, names, settings)
from autoplan.errors import OptionError
from autoplan.inputs.devices import get_device
from autoplan.plan import Choice


def test_every_file_of_precisions_is_a_precision_in_order():
    files = {module.name.replace("_", "-") for module in pkgutil.iter_modules(precisions.__path__)}
    assert set(names()) == files  # a new precision is a new file there, and nothing else
    assert names() == ("fp32", "bf16", "fp16", "float8", "float8-rowwise")
    assert settings() == ("auto", "auto-float8", "fp32", "bf16", "fp16", "float8", "float8-rowwise")
    assert [k.order for k in kinds()] == sorted(k.order for k in kinds())


def test_each_precision_is_torch_s_dtype():
    assert [dtype_of(name) for name in names()] == [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                                    torch.float8_e4m3fn]
    assert low_dtypes()[:2] == (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("axis", [CHECKPOINT, PRECISION, PLACEMENT])
def test_every_axis_offers_the_one_small_interface(axis: ChoiceAxis):
    assert axis.field in {field.name for field in Choice.__dataclass_fields__.values()}
    values = axis.values()
    assert axis.rewriting(values[0]) == 0  # the first value is the unit as written
    assert all(axis.check(value) == value for value in values)
    with pytest.raises(OptionError, match="expected one of"):
        axis.check("no-such-value")
    assert all(axis.words(value) for value in values)


def test_auto_picks_bf16_where_the_card_has_it_and_fp16_where_it_has_not():
    assert low_precision(get_device("h100-80gb")).name == "bf16"
    assert low_precision(get_device("t4")).name == "fp16"
    assert choices_for("auto", get_device("t4")) == ("fp32", "fp16")
    assert choices_for("bf16", get_device("h100-80gb")) == ("bf16",)


def test_one_check_of_a_precision_against_a_device():
    with pytest.raises(OptionError, match=r"precision 'bf16' \(--precision bf16\): t4 has no bf16; use 'fp16' \(with a GradScaler\)"):
        check_setting("bf16", get_device("t4"))
    with pytest.raises(OptionError, match="precision must be 'auto', 'auto-float8', 'fp32', 'bf16', 'fp16', 'float8' or "
                                          "'float8-rowwise'; got 'int8'"):
        check_setting("int8", get_device("t4"))
    assert check_setting("fp16", get_device("t4")) == "fp16"


def test_each_precision_is_priced_at_its_rate_on_the_device():
    h100, t4 = get_device("h100-80gb"), get_device("t4")
    assert flops_for(h100, torch.bfloat16) == h100.peak_flops["bf16"]
    assert flops_for(h100, torch.float32, allow_tf32=True) == h100.peak_flops["tf32"]
    assert flops_for(t4, torch.bfloat16) == t4.peak_flops["fp32"]  # a precision the card lacks runs at the fp32 rate
    assert flops_for(t4, torch.int64) == t4.peak_flops["fp32"]
    assert kind("fp16").grad_scaler and not kind("bf16").grad_scaler
    assert kind("fp16").words == "fp16 autocast with torch.amp.GradScaler"


def test_a_unit_runs_in_its_precision():
    layer = torch.nn.Linear(4, 4)
    with kind("bf16").running(layer, "cpu"):
        assert layer(torch.ones(2, 4)).dtype == torch.bfloat16
        with kind("fp32").running(layer, "cpu"):  # an fp32 unit turns the autocast around it off
            assert layer(torch.ones(2, 4)).dtype == torch.float32


def test_a_new_precision_is_its_file_alone(monkeypatch):
    """What a precision file defines is all the rest asks: a kind the registry finds is a Choice, a setting, a rate."""
    from autoplan.axes import precision
    from autoplan.axes.precisions import Autocast

    float8 = Autocast(name="fp8", dtype_name="float8_e4m3fn", order=3, auto_preference=None, grad_scaler=False,
                      words="fp8 (stand-in)", missing=lambda device: "" if (device.compute_capability or (0, 0)) >= (8, 9)
                      else f"{device.name} has no fp8")
    found = precision.kinds()
    monkeypatch.setattr(precision, "kinds", lambda: (*found, float8))
    assert precision.names()[-1] == "fp8" and "fp8" in precision.settings()
    assert Choice("keep", "fp8").precision == "fp8" and Choice("keep", "fp8").rewriting == 1
    assert check_setting("fp8", get_device("h100-80gb")) == "fp8"
    with pytest.raises(OptionError, match="a100-80gb has no fp8"):
        check_setting("fp8", get_device("a100-80gb"))
    assert low_precision(get_device("h100-80gb")).name == "bf16"  # "auto" picks what it did: fp8 is asked for by name
