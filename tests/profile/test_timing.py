"""Measured unit times (`profile.timing`), on its own: `measure_times` replaces a profile's roofline
times by timed runs (the median after warm-up, identical blocks timed once), times the whole base
and no-plan steps, and leaves the model as it found it; a model on the meta device is refused."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import autoplan.profile.timing as timing
from autoplan.errors import OptionError
from autoplan.inputs.devices import get_device
from autoplan.planned.forwards import planned_choices
from autoplan.profile.timing import measure_times
from autoplan.profile.profiler import profile
from autoplan.trace.tracer import trace
from tests.models import make_residual_mlp


@pytest.fixture(scope="module")
def residual_mlp():
    """A fresh traced and profiled residual MLP (4 identical blocks and a head) for each test module:
    measure_times runs its model, so it is not a session fixture shared with others."""
    model, inputs = make_residual_mlp()
    traced = trace(model, inputs)
    return traced, profile(traced, get_device("cpu"), precisions=("fp32",), menu_size=0)


class _ScriptedTimer:
    """Stands in for the clock: each timer's i-th reading is READINGS[i] (fwd and bwd alternate in a unit's runs)."""

    READINGS = (9.0, 9.0, 5.0, 50.0, 1.0, 10.0, 3.0, 30.0)

    def __init__(self, device: torch.device) -> None:
        self.count = 0

    def __call__(self, function):
        result = function()
        seconds = self.READINGS[self.count]
        self.count += 1
        return seconds, result


def test_times_are_the_median_of_the_runs_after_warm_up(residual_mlp, monkeypatch) -> None:
    traced, roofline = residual_mlp
    monkeypatch.setattr(timing, "Timer", _ScriptedTimer)
    measured = measure_times(roofline, traced, warmup=1, runs=3)
    # a unit's runs read (fwd, bwd) pairs: warm-up (9, 9), then (5, 50), (1, 10), (3, 30)
    for unit in measured.units:
        assert {(cost.fwd_time_s, cost.bwd_time_s) for cost in unit.options.values()} == {(3.0, 30.0)}, unit.name
    # a step's runs read one number each: warm-up 9, then 9, 5, 50
    assert measured.base_step_time_s == measured.reference_step_time_s == 9.0
    assert measured.time_source == "measured (CPU wall clock)"


def test_measured_times_keep_the_bytes_and_time_identical_blocks_once(residual_mlp) -> None:
    traced, roofline = residual_mlp
    said: list[str] = []
    measured = measure_times(roofline, traced, warmup=0, runs=1, progress=said.append)
    assert [u.name for u in measured.units] == [u.name for u in roofline.units]
    for before, after in zip(roofline.units, measured.units):
        assert before.options.keys() == after.options.keys()
        for choice, cost in after.options.items():
            assert cost.fwd_time_s > 0 and cost.bwd_time_s > 0, (after.name, choice)
            # only the times change: bytes and FLOPs stay the fake-tensor measurement's
            old = before.options[choice]
            assert dataclasses.replace(cost, fwd_time_s=old.fwd_time_s, bwd_time_s=old.bwd_time_s) == old
    blocks = [u for u in measured.units if u.name.startswith("blocks.")]
    # identical blocks share one timing, as they shared one profile (the first differs: its input needs no grad)
    shared = len({id(u.options) for u in roofline.units if u.name.startswith("blocks.")})
    assert len(blocks) == 4 and len({id(u.options) for u in blocks}) == shared < 4
    timed = [line for line in said if line.startswith("timing unit")]
    assert len(timed) == len({id(u.options) for u in roofline.units}) < len(roofline.units)
    assert measured.base_step_time_s > 0 and measured.reference_step_time_s > 0


def test_the_model_is_left_as_it_was_found(residual_mlp) -> None:
    traced, roofline = residual_mlp
    model = traced.model
    model.eval()
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    measure_times(roofline, traced, warmup=0, runs=1)
    assert planned_choices(model) == {} and "forward" not in model.__dict__
    assert not model.training
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert torch.equal(torch.get_rng_state(), rng)
    model.train()


def test_a_meta_model_has_nothing_to_time(residual_mlp) -> None:
    traced, roofline = residual_mlp
    meta = dataclasses.replace(traced, model=copy.deepcopy(traced.model).to("meta"))
    with pytest.raises(OptionError, match="meta device.*profile='roofline'"):
        measure_times(roofline, meta)
