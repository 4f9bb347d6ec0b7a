"""inputs.options: the one schema of plan()'s options, and what is made from it (keywords, help, the request record)."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc

import pytest

import autoplan
from autoplan.errors import OptionTypeError
from autoplan.inputs.loop import TrainingLoop
from autoplan.inputs.options import PlanKeywords, PlanOptions, api_table, flagged

OPTIONS = [option.name for option in dataclasses.fields(PlanOptions)]


def test_the_editor_s_keywords_are_the_schema_s():
    written = {name: getattr(kind, "__forward_arg__", kind) for name, kind in PlanKeywords.__annotations__.items()}
    assert written == {option.name: option.type for option in dataclasses.fields(PlanOptions)}  # the same names, types, order
    assert list(written) == OPTIONS


@pytest.mark.parametrize("function", [autoplan.plan, autoplan.optimize, autoplan.Planner])
def test_help_shows_every_option_with_its_default(function):
    parameters = inspect.signature(function).parameters
    assert [name for name in parameters if name in OPTIONS] == OPTIONS
    assert all(parameters[option.name].default == option.default for option in dataclasses.fields(PlanOptions))
    text = pydoc.render_doc(function)
    assert all(f"{name}=" in text for name in OPTIONS)  # in the signature and in the docstring's list
    assert "Options (docs/api.md)" in text


def test_a_misspelled_option_is_named_as_written_with_the_closest():
    with pytest.raises(OptionTypeError, match=r"plan\(\) got an unexpected keyword argument 'fuse_los'; did you mean 'fuse_loss'\?"):
        PlanOptions.given({"fuse_los": True}, "plan")


def test_the_record_holds_what_is_not_at_its_default_in_the_schema_s_order():
    options = PlanOptions(device="cpu", compile=True, precision="fp32", loop=TrainingLoop(), time_limit_s=3.0, units=["a.*"])
    assert options.arguments("cpu") == (("device", "cpu"), ("precision", "fp32"), ("units", ["a.*"]),
                                        ("compile", True))  # the common loop and the time limit are not recorded
    assert PlanOptions().arguments("h100-80gb") == (("device", "h100-80gb"),)
    assert PlanOptions(loss_fn=lambda out: out).arguments(None) == (("loss_fn", None),)  # an object only the caller has


def test_the_command_line_s_flags_name_options_of_the_schema():
    names = [name for name, _ in flagged()]
    assert set(names) <= set(OPTIONS) and "example_inputs" not in names and "loss_fn" not in names
    assert all(flag.help and flag.doc for _, flag in flagged())


def test_the_api_table_has_a_row_per_option_after_the_budget():
    rows = [line.split(" | ")[0].strip("| `") for line in api_table().splitlines()[2:]]
    assert rows == ["budget", *OPTIONS]
