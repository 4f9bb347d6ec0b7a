"""The plan space holds every block, at every level: autoplan is never worse than checkpointing by hand.

For every structure of the zoo (`tests/structures.py`, and random module trees from
`tests/generated.py`), measured on the CPU by the allocator's count `autoplan.verify` uses (`verify/allocator.py`):
- autoplan's floor (`plan.prediction.minimum_peak_bytes`) is at most the peak of checkpointing every block
  by hand (`tests/handmade.py`);
- planned at a budget of exactly that peak (no reserve), the plan fits when measured and
  recomputes no more FLOPs than the by-hand plan (FlopCounterMode);
- the planned model trains like the original (fp32: loss, gradients, buffers).
Mixture-of-experts models plan, rewrite and train; a module called several times is one unit
per call with one set of parameters; nested blocks offer more than one level.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

import autoplan
from autoplan.planned.forwards import apply_choices, planned_choices
from autoplan.trace.tracer import trace
from autoplan.trace.discovery import unit_levels
from tests.generated import module_trees, structure_of
from autoplan.instruments.fake import ROUTING_NOTE
from autoplan.units import CallSite, ModuleUnit, Unit
from tests.handmade import Comparison, assert_same_step, checkpoint_by_hand, compare_with_plan, measured_step
from tests.structures import STRUCTURES, Structure, by_name


def assert_never_worse_than_by_hand(row: Comparison) -> None:
    assert row.floor_bytes <= row.by_hand.peak_bytes, f"{row.structure}: floor {row.floor_bytes} > by hand {row.by_hand.peak_bytes}"
    assert row.feasible, f"{row.structure}: no plan at the by-hand peak {row.by_hand.peak_bytes}"
    assert row.planned.peak_bytes <= row.by_hand.peak_bytes, f"{row.structure}: measured {row.planned.peak_bytes}"
    assert row.planned.flops <= row.by_hand.flops, f"{row.structure}: recomputes more than by hand"


def assert_trains_the_same(structure: Structure, plan: autoplan.Plan) -> None:
    model, inputs = structure.build()
    assert_same_step(model, plan, inputs)


def check_structure(structure: Structure) -> None:
    """The guarantee and training equivalence; where there are several levels, the plan names its own."""
    row = compare_with_plan(structure)
    assert_never_worse_than_by_hand(row)
    assert_trains_the_same(structure, row.plan)
    levels = unit_levels(structure.build()[0])
    if len(levels) > 1:  # every level was planned, and the plan says which one it kept
        assert any(f"the best of {len(levels)} levels" in note for note in row.plan.notes)


PLAIN = [s for s in STRUCTURES if not s.needs_transformers]
MOE = [s for s in STRUCTURES if "moe" in s.tags]
HF = [s for s in STRUCTURES if s.needs_transformers]


@pytest.mark.parametrize("structure", PLAIN, ids=lambda s: s.name)
def test_never_worse_than_checkpointing_every_block_by_hand_and_trains_the_same(structure):
    check_structure(structure)


@pytest.mark.parametrize("structure", HF, ids=lambda s: s.name)
def test_transformers_models_never_worse_than_by_hand(structure):
    pytest.importorskip("transformers")
    assert_never_worse_than_by_hand(compare_with_plan(structure))


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(module_trees())
def test_generated_trees_never_worse_than_by_hand_and_train_the_same(spec):
    check_structure(structure_of(spec))


def test_layers_selective_checkpointing_refuses_are_offered_keep_and_full_and_the_plan_says_so():
    """nn.RNN's tanh cell writes in place into a matmul output the policy saves: torch's selective
    checkpointing refuses it in the real run ("has been mutated"); planning it failed whole before."""
    row = compare_with_plan(by_name("stacked nn.RNN (no selective checkpointing)"))
    assert row.feasible and row.planned.peak_bytes == row.plan.prediction.peak_bytes
    assert {d.choice.mode for d in row.plan.decisions.units} <= {"keep", "full"}
    refused = [note for note in row.plan.notes if note.startswith("selective checkpointing is not offered for ")]
    assert len(refused) == 1 and "has been mutated" in refused[0], row.plan.notes
    assert all(unit.name in refused[0] for unit in row.plan.decisions.units[:-1])  # every RNN layer; not the head


def test_every_sibling_is_a_unit_whatever_holds_it():
    model, _ = by_name("ModuleList of residual Sequential blocks").build()
    assert tuple(u.name for u in unit_levels(model)[0].units) == tuple(f"blocks.{i}" for i in range(8))
    model, _ = by_name("blocks in a ModuleDict, called by key").build()
    assert tuple(u.name for u in unit_levels(model)[0].units) == tuple(f"layers.l{i}" for i in range(6))


def test_stages_of_blocks_offer_both_levels():
    model, _ = by_name("stages of blocks (stages[i].blocks[j])").build()
    levels = [tuple(u.name for u in level.units) for level in unit_levels(model)]
    assert levels[0] == ("stages.0", "stages.1", "stages.2")
    assert levels[1] == tuple(f"stages.{i}.blocks.{j}" for i, depth in enumerate((2, 3, 2)) for j in range(depth))


def test_a_shared_block_is_one_unit_per_call_with_one_set_of_parameters():
    structure = by_name("one block applied N times (shared weights)")
    model, inputs = structure.build()
    traced = trace(model, inputs, unit_names=(ModuleUnit("embed"), ModuleUnit("block"), ModuleUnit("head")))
    assert traced.unit_names == ("embed", *(f"block@{k}" for k in range(6)), "head")
    choices: dict[Unit, autoplan.Choice] = {CallSite("block", k): autoplan.Choice("full" if k % 2 else "keep", "fp32") for k in range(6)}
    planned = apply_choices(copy.deepcopy(model), choices)
    assert planned_choices(planned) == {unit.name: choice for unit, choice in choices.items()}
    assert sum(p.numel() for p in planned.parameters()) == sum(p.numel() for p in model.parameters())
    for net in (model, planned):
        net(*inputs).sum().backward()
    for (name, a), b in zip(model.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    autoplan.remove_plan(planned)
    assert planned_choices(planned) == {}


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("structure", MOE, ids=lambda s: s.name)
def test_mixture_of_experts_plans_rewrites_and_trains(structure):
    pytest.importorskip("transformers")
    model, inputs = structure.build()
    by_hand = measured_step(checkpoint_by_hand(copy.deepcopy(model), structure), inputs)
    plan = autoplan.plan(model, budget=by_hand.peak_bytes, example_inputs=inputs, device="cpu", precision="fp32", reserve=0)
    assert plan.outcome.feasible and ROUTING_NOTE in plan.notes
    assert measured_step(autoplan.apply(copy.deepcopy(model), plan), inputs).peak_bytes <= by_hand.peak_bytes
    assert_trains_the_same(structure, plan)
