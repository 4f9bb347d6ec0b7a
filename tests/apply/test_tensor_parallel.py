"""Tensor parallelism applied: torch's own DTensor step on gloo ranks against the plan of one rank's slice.

`examples/tp_train.py` on four ranks (FSDP 2 × tensor parallel 2, a plain-PyTorch Llama) and `tests/tp_worker.py`
on two (a transformers Qwen2, split by its own `tp_plan`, q/k/v biases included) plan, apply and train; each rank's
peak is counted by the CPU allocator's reports (`autoplan/verify/fsdp.py`), which share nothing with the simulation
of the rank's slice (`autoplan/inputs/tensor_parallel.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import autoplan
from autoplan.errors import DistributedSetupError, OptionError
from examples.llama import Llama, LlamaConfig, example_batch
from tests.two_ranks import ROOT, assert_counted_to_the_byte, distributed, run_on_two_ranks, torchrun

CONFIG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)


def _tiny():
    torch.manual_seed(0)
    return Llama(CONFIG), example_batch(CONFIG, 2, 32)


@distributed
@pytest.mark.slow  # four processes on the CPU
def test_the_example_trains_a_2x2_mesh_within_its_per_rank_prediction(tmp_path: Path) -> None:
    result = torchrun(ROOT / "examples" / "tp_train.py", 4, "--out", str(tmp_path), timeout_s=600)  # exit 0: the example's own checks passed
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert {rank["mesh"] for rank in ranks} == {"2 fsdp × 2 tp"}
    for rank in ranks:
        predicted, measured, floor = rank["predicted_peak_bytes"], rank["measured_peak_bytes"], rank["measured_floor_bytes"]
        assert max(floor, 0.99 * predicted) <= min(measured, predicted), rank  # gloo's unheard frees: two_ranks.py
    assert "equal" in result.stdout and "DIFFERENT" not in result.stdout


@distributed
@pytest.mark.slow
def test_a_transformers_model_split_by_its_own_tp_plan_is_counted_as_planned(tmp_path: Path) -> None:
    ranks = run_on_two_ranks("tp_worker.py", tmp_path)
    plan = ranks[0]["plan"]
    assert plan["tensor_parallel"] == 2 and plan["world_size"] == 2
    assert ["model.layers.0.self_attn.q_proj", "colwise"] in plan["tensor_parallel_layout"]
    assert ["model.layers.1.mlp.down_proj", "rowwise"] in plan["tensor_parallel_layout"]
    assert_counted_to_the_byte(ranks)  # a free made in one of gloo's threads reaches the count late, never early
    assert ranks[0]["losses"] == ranks[1]["losses"]  # one group: the same batch, the same sums


@distributed
def test_the_sequence_split_over_two_ranks_is_counted_as_planned(tmp_path: Path) -> None:
    """torch's SequenceParallel on the norms, PrepareModuleInput gathering the attention's, MLP's and head's inputs and
    splitting the first layer's, RowwiseParallel reduce-scattering: each rank's count is its slice's simulation."""
    ranks = run_on_two_ranks("tp_worker.py", tmp_path, "qwen2-sp")
    plan = ranks[0]["plan"]
    assert plan["sequence_parallel"] is True and plan["tensor_parallel"] == 2
    assert {unit["mode"] for unit in plan["units"]} - {"keep"}  # halfway: some layer recomputes its gathers too
    assert_counted_to_the_byte(ranks)
    assert ranks[0]["losses"] == ranks[1]["losses"]


@distributed
@pytest.mark.slow  # four processes on the CPU
def test_the_example_with_the_sequence_split_trains_a_2x2_mesh_within_its_prediction(tmp_path: Path) -> None:
    result = torchrun(ROOT / "examples" / "tp_train.py", 4, "--sequence-parallel", "--out", str(tmp_path), timeout_s=600)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert {rank["mesh"] for rank in ranks} == {"2 fsdp × 2 tp (sequence parallel)"}
    for rank in ranks:
        predicted, measured, floor = rank["predicted_peak_bytes"], rank["measured_peak_bytes"], rank["measured_floor_bytes"]
        assert max(floor, 0.99 * predicted) <= min(measured, predicted), rank
    assert "equal" in result.stdout and "DIFFERENT" not in result.stdout


@distributed
@pytest.mark.slow
def test_a_recomputed_layer_whose_row_wise_output_is_used_late_holds_what_was_planned(tmp_path: Path) -> None:
    """GPT-NeoX adds its attention output after the MLP has run; a recomputation stopped once the last saved tensor is
    made again (torch's default) never waits that row-wise all-reduce, and its output stayed held: two hidden-sized
    tensors a layer, 5.8% over the plan. The planned units recompute whole (planned.wrappers.recomputing_whole)."""
    ranks = run_on_two_ranks("tp_worker.py", tmp_path, "gptneox-full")
    plan = ranks[0]["plan"]
    assert {unit["mode"] for unit in plan["units"]} == {"full"}
    assert_counted_to_the_byte(ranks)


def test_only_units_split_by_tensor_parallelism_recompute_whole() -> None:
    """The rank's twin marks its split layers; a whole model's layers keep torch's early stop (same plans as before)."""
    from autoplan.inputs.tensor_parallel import rank_model, resolve_layout
    from autoplan.planned.wrappers import PlannedForward
    from autoplan.plan import Choice

    model, _ = _tiny()
    twin = rank_model(model, resolve_layout(model, 2, None), 2)
    full = Choice("full", "fp32")
    assert PlannedForward(twin.layers[0], full).recompute_whole
    assert not PlannedForward(model.layers[0], full).recompute_whole
    assert not PlannedForward(twin.norm, full).recompute_whole


def test_applying_a_tensor_parallel_plan_needs_its_process_group() -> None:
    model, batch = _tiny()
    plan = autoplan.plan(model, "1GB", example_inputs=batch, device="cpu", reserve=0, profile="roofline", tensor_parallel=2)
    with pytest.raises(DistributedSetupError, match="world_size=2"):
        autoplan.apply(model, plan)


def test_optimize_asks_for_the_process_group_before_planning() -> None:
    model, batch = _tiny()
    with pytest.raises(DistributedSetupError, match="torchrun"):
        autoplan.optimize(model, "1GB", example_inputs=batch, device="cpu", tensor_parallel=2)
    with pytest.raises(OptionError, match="multiple of 2"):
        autoplan.optimize(model, "1GB", example_inputs=batch, device="cpu", world_size=3, tensor_parallel=2)
