"""world_size="auto" searches the tensor-parallel degree too (tensor_parallel left out, or "auto"): the degree on the
fewest GPUs in all, FSDP alone where it is as few; tensor_parallel=1 searches FSDP alone."""

from __future__ import annotations

import pytest
import torch

import autoplan
from examples.llama import Llama, LlamaConfig, example_batch

# 4 query heads and 2 key/value heads of width 32: split 2 ways each rank has whole heads, 4 or 8 ways its kv heads
# would be half a head (its slice does not run, and the search says so)
CONFIG = LlamaConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=256)
OPTIONS = dict(device="cpu", reserve=0, profile="roofline", precision="fp32")


@pytest.fixture(scope="module")
def planner():
    torch.manual_seed(0)
    model = Llama(CONFIG)
    return model, autoplan.Planner(model, example_inputs=example_batch(CONFIG, 4, 256), world_size="auto", **OPTIONS)  # the default


@pytest.mark.slow  # three degrees profiled
def test_tensor_parallelism_is_chosen_where_it_needs_fewer_gpus(planner) -> None:
    model, searched = planner
    plan = searched.plan("14MB")  # activations over the budget whatever FSDP shards: splitting the blocks' matmuls helps
    assert plan.outcome.feasible and plan.request.mesh.tensor_parallel == 2
    assert str(plan.request.mesh) == "5 fsdp × 2 tp" and plan.request.world_size == 10  # the head split too
    note = next(note for note in plan.notes if "per tensor-parallel degree" in note)
    assert "FSDP alone: does not fit" in note and "tensor parallel 2: 10 (5 FSDP × 2 tensor parallel)" in note
    assert "tensor parallel 4: its slice does not run" in note  # half a kv head per rank
    fsdp_alone = autoplan.plan(model, "14MB", example_inputs=example_batch(CONFIG, 4, 256), world_size="auto", tensor_parallel=1, **OPTIONS)
    assert not fsdp_alone.outcome.feasible and fsdp_alone.request.mesh.tensor_parallel == 1  # told: FSDP alone
    assert not any("per tensor-parallel degree" in note for note in fsdp_alone.notes)


@pytest.mark.slow
def test_fsdp_alone_stays_the_answer_where_no_degree_could_need_fewer(planner) -> None:
    _, searched = planner
    plan = searched.plan("40MB")  # one device fits: no split can need fewer
    assert plan.outcome.feasible and plan.request.world_size == 1 and plan.request.mesh.tensor_parallel == 1
    assert not any("per tensor-parallel degree" in note for note in plan.notes)


def test_the_degree_is_searched_only_beside_fsdps_ranks() -> None:
    from autoplan.errors import OptionError

    torch.manual_seed(0)
    with pytest.raises(OptionError, match='world_size="auto" too'):
        autoplan.Planner(Llama(CONFIG), example_inputs=example_batch(CONFIG, 4, 256), world_size=8, tensor_parallel="auto", **OPTIONS)


def test_the_degree_is_searched_by_default_only_under_world_size_auto() -> None:
    from autoplan.inputs.options import PlanOptions
    from autoplan.inputs.settings import requested_degree

    def degree(**options):
        return requested_degree(PlanOptions.given(options, "plan"))

    assert degree(world_size="auto") == "auto" and degree(world_size="auto", tensor_parallel=1) == 1
    assert degree() == 1 and degree(world_size=8) == 1 and degree(world_size=8, tensor_parallel=2) == 2
    assert degree(world_size="auto", tensor_parallel="4") == 4  # the command line's digits


def test_a_model_with_nothing_to_split_searches_fsdp_alone() -> None:
    from autoplan.inputs.tensor_parallel import degrees_to_plan

    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    assert degrees_to_plan(mlp, "auto", None) == ((1, ()),)
    assert [degree for degree, _ in degrees_to_plan(Llama(CONFIG), "auto", None)] == [1, 2, 4, 8]
