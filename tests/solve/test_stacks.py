"""solve/stacks.py: a deep stack's solved choices ordered side by side, least kept first, and the search that tries
that order before the solved one.

The ordering is checked on hand-made profiles (which units form a stack, what order comes out, what is left as
solved); the search on a 24-layer Llama under FSDP, against the same plan searched in the solved order.
"""

from __future__ import annotations

from collections import Counter
from types import MappingProxyType, SimpleNamespace
from unittest import mock

import pytest
import torch

import autoplan
from autoplan.plan import Choice
from autoplan.profile.profiler import UnitCost, UnitProfile
from autoplan.solve import stacks
from autoplan.solve.stacks import MIN_LAYERS, identical_stacks, side_by_side
from autoplan.units import Unit
from examples.llama import Llama, LlamaConfig, example_batch

KEEP, SELECTIVE, FULL = Choice("keep", "fp32"), Choice("selective", "fp32"), Choice("full", "fp32")


def _cost(held: int) -> UnitCost:
    return UnitCost(fwd_peak_bytes=64, held_bytes=held, bwd_peak_bytes=64, fwd_time_s=1.0, bwd_time_s=2.0, fwd_flops=1, bwd_flops=2)


def _unit(name: str, keep_held: int = 300) -> UnitProfile:
    options = MappingProxyType({KEEP: _cost(keep_held), SELECTIVE: _cost(200), FULL: _cost(100)})
    return UnitProfile(Unit.from_name(name), options, KEEP)


def _profile(depth: int, odd: int | None = None):
    layers = [_unit(f"model.layers.{k}", keep_held=301 if k == odd else 300) for k in range(depth)]
    return SimpleNamespace(units=(_unit("model.embed"), *layers, _unit("lm_head")))


def _layers(depth: int) -> list[str]:
    return [f"model.layers.{k}" for k in range(depth)]


def test_a_deep_stack_s_choices_come_out_least_kept_first() -> None:
    depth = MIN_LAYERS + 6
    solved = {name: (KEEP, FULL, SELECTIVE)[k % 3] for k, name in enumerate(_layers(depth))} | {"model.embed": KEEP, "lm_head": FULL}
    ordered = side_by_side(_profile(depth), solved)
    assert [ordered[name] for name in _layers(depth)] == [FULL] * 10 + [SELECTIVE] * 10 + [KEEP] * 10
    assert Counter(ordered.values()) == Counter(solved.values())  # the same choices, only moved
    assert ordered["model.embed"] == KEEP and ordered["lm_head"] == FULL  # outside the stack: as solved


def test_a_shallow_or_broken_stack_stays_as_solved() -> None:
    shallow = {name: (KEEP, FULL)[k % 2] for k, name in enumerate(_layers(MIN_LAYERS - 1))}
    assert side_by_side(_profile(MIN_LAYERS - 1), shallow) == shallow
    # one layer measured otherwise splits the stack in two, each too short
    broken = {name: (KEEP, FULL)[k % 2] for k, name in enumerate(_layers(MIN_LAYERS + 4))}
    assert identical_stacks(_profile(MIN_LAYERS + 4, odd=MIN_LAYERS // 2)) == []
    assert side_by_side(_profile(MIN_LAYERS + 4, odd=MIN_LAYERS // 2), broken) == broken


def test_a_stack_with_a_choice_it_was_not_measured_in_stays_as_solved() -> None:
    solved = {name: (KEEP, FULL)[k % 2] for k, name in enumerate(_layers(MIN_LAYERS))}
    solved["model.layers.3"] = Choice("keep", "bf16")  # not among the hand-made options
    assert side_by_side(_profile(MIN_LAYERS), solved) == solved


@pytest.mark.slow  # two searches of a 24-layer model
def test_the_search_tries_the_stack_side_by_side_and_it_keeps_no_more() -> None:
    """FSDP over 2 ranks on the CPU (the step is simulated per rank, so a few layers deep where a run allows), at a
    budget halfway between the lowest peak and no plan: the plan's layers come out one run per choice, with the
    same choices as the solved order, a peak no higher and the same step time."""
    config = LlamaConfig(vocab_size=256, dim=64, n_layers=MIN_LAYERS, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=64)
    torch.manual_seed(0)
    model, batch = Llama(config), example_batch(config, 2, 64)
    options = dict(example_inputs=batch, device="cpu", reserve=0, world_size=2, tensor_parallel=1, profile="roofline", precision="fp32")
    roomy = autoplan.plan(model, "1GB", **options)
    budget = (roomy.prediction.minimum_peak_bytes + roomy.prediction.peak_bytes) // 2
    ordered = autoplan.plan(model, f"{budget}B", **options)
    with mock.patch.object(stacks, "side_by_side", lambda profile, choices: dict(choices)):
        solved = autoplan.plan(model, f"{budget}B", **options)
    modes = _layer_modes(ordered)
    assert ordered.outcome.feasible and solved.outcome.feasible
    assert len(set(modes)) > 1, "a budget that mixes choices"
    assert _runs(modes) == len(set(modes)) < _runs(_layer_modes(solved)), "one run per choice, where the solve had more"
    assert Counter(modes) == Counter(_layer_modes(solved))
    assert ordered.prediction.peak_bytes <= solved.prediction.peak_bytes
    assert ordered.prediction.step_time_s == pytest.approx(solved.prediction.step_time_s, rel=1e-9)


def _layer_modes(plan) -> list[str]:
    return [unit.choice.mode for unit in plan.decisions.units if unit.name.startswith("layers.")]


def _runs(modes: list[str]) -> int:
    return 1 + sum(before != after for before, after in zip(modes, modes[1:]))
