"""Tensor parallelism as planned: the layout found or given, one rank's slice of the model, and the plan made for it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autoplan
from autoplan.errors import OptionError, ProfileError
from autoplan.inputs.tensor_parallel import ColwiseShard, RowwiseShard, rank_model, resolve_layout
from examples.llama import Llama, LlamaConfig, example_batch
from tests.fsdp_model import qwen2_batch, tiny_qwen2

CONFIG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
OPTIONS = dict(device="cpu", reserve=0, profile="roofline", precision="fp32")


def _tiny():
    torch.manual_seed(0)
    return Llama(CONFIG), example_batch(CONFIG, 2, 32)


def test_torchtitan_names_give_the_llama_layout() -> None:
    model, _ = _tiny()
    layout = dict(resolve_layout(model, 2, None))
    assert len(layout) == 7 * CONFIG.n_layers + 1
    assert layout["layers.0.attention.wq"] == layout["layers.1.feed_forward.w3"] == "colwise"
    assert layout["layers.0.attention.wo"] == layout["layers.1.feed_forward.w2"] == "rowwise"
    assert layout["output"] == "colwise_gather_output"  # the head split by the vocabulary, its logits gathered (torchtitan's)
    assert "tok_embeddings" not in layout  # whole on every rank


def test_a_transformers_model_brings_its_own_tp_plan() -> None:
    layout = dict(resolve_layout(tiny_qwen2(), 2, None))
    assert layout["model.layers.0.self_attn.k_proj"] == "colwise" and layout["model.layers.1.mlp.down_proj"] == "rowwise"
    assert layout["lm_head"] == "colwise_gather_output" and "model.embed_tokens" not in layout  # its embedding style is not planned


def test_a_split_head_gathers_its_logits_whole_and_a_tied_one_stays_whole() -> None:
    from autoplan.inputs.tensor_parallel import GatheredColwiseShard

    model, (tokens, targets) = _tiny()
    twin = rank_model(model, resolve_layout(model, 2, None), 2)
    assert isinstance(twin.output, GatheredColwiseShard) and twin.output.weight.shape == (CONFIG.vocab_size // 2, CONFIG.dim)
    hidden = torch.randn(2, 32, CONFIG.dim, requires_grad=True)
    logits = twin.output(hidden)
    assert logits.shape == (2, 32, CONFIG.vocab_size)  # every rank's part, whole: the loss is the whole one
    logits.sum().backward()
    assert hidden.grad.shape == hidden.shape and twin.output.weight.grad.shape == twin.output.weight.shape
    tied, _ = Llama(dataclasses.replace(CONFIG, tie_embeddings=True)), None
    assert "output" not in dict(resolve_layout(tied, 2, None))  # its weight is the embedding's, which stays whole
    with pytest.raises(OptionError, match="tied to another module"):
        resolve_layout(tied, 2, (("output", "colwise_gather_output"),))


def test_a_rank_holds_its_slices_and_shares_the_rest() -> None:
    model = tiny_qwen2()
    layout = resolve_layout(model, 2, None)
    twin = rank_model(model, layout, 2)
    whole, part = model.model.layers[0].self_attn, twin.model.layers[0].self_attn
    assert isinstance(part.q_proj, ColwiseShard) and isinstance(part.o_proj, RowwiseShard)
    assert part.q_proj.weight.shape == (whole.q_proj.out_features // 2, whole.q_proj.in_features)
    assert torch.equal(part.q_proj.weight, whole.q_proj.weight[: whole.q_proj.out_features // 2])
    assert torch.equal(part.q_proj.bias, whole.q_proj.bias[: whole.q_proj.out_features // 2])  # a column's bias is split
    assert part.o_proj.weight.shape == (whole.o_proj.out_features, whole.o_proj.in_features // 2)
    assert twin.model.embed_tokens.weight is model.model.embed_tokens.weight  # not copied
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # the model itself is untouched
    loss = twin(**qwen2_batch(0)).loss
    loss.backward()  # the slice runs: heads follow from the weights' shapes
    assert part.q_proj.weight.grad.shape == part.q_proj.weight.shape and model.model.layers[0].self_attn.q_proj.weight.grad is None


def test_the_plan_is_per_rank_and_names_its_mesh() -> None:
    model, batch = _tiny()
    one = autoplan.plan(model, "1GB", example_inputs=batch, **OPTIONS)
    split = autoplan.plan(model, "1GB", example_inputs=batch, tensor_parallel=2, **OPTIONS)
    both = autoplan.plan(model, "1GB", example_inputs=batch, world_size=4, tensor_parallel=2, **OPTIONS)
    assert split.request.world_size == 2 and str(split.request.mesh) == "2 tp"
    assert both.request.world_size == 4 and str(both.request.mesh) == "2 fsdp × 2 tp"
    assert both.prediction.peak_bytes < split.prediction.peak_bytes < one.prediction.peak_bytes
    data = split.to_dict()
    assert data["tensor_parallel"] == 2 and ["layers.1.attention.wo", "rowwise"] in data["tensor_parallel_layout"]
    assert "2 × cpu (per rank, tensor parallel)" in split.report()
    assert one.to_dict()["tensor_parallel"] == 1 and one.to_dict()["tensor_parallel_layout"] == []


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel=3), "do not divide by 3"),
    (dict(tensor_parallel=0), "at least 1"),
    (dict(tensor_parallel="two"), "at least 1"),
    (dict(tensor_parallel=2, world_size=3), "multiple of 2"),
    (dict(tensor_parallel_plan={"layers.*.attention.wq": "colwise"}), "give tensor_parallel=N"),
    (dict(tensor_parallel=2, tensor_parallel_plan={"*attention_norm": "colwise"}), "not nn.Linear"),
    (dict(tensor_parallel=2, tensor_parallel_plan={"*.nothing": "rowwise"}), "names no linear"),
    (dict(tensor_parallel=2, tensor_parallel_plan={"*.wq": "sequence"}), "'colwise', 'rowwise' or 'colwise_gather_output'"),
])
def test_a_layout_that_cannot_be_split_is_refused_before_planning(options, message) -> None:
    model, batch = _tiny()
    with pytest.raises(OptionError, match=message):
        autoplan.Planner(model, example_inputs=batch, **OPTIONS, **options)


def test_a_layout_given_by_patterns_splits_only_those() -> None:
    model, batch = _tiny()
    given = {"*.w1": "colwise", "*.w3": "colwise", "*.w2": "rowwise"}
    plan = autoplan.plan(model, "1GB", example_inputs=batch, tensor_parallel=2, tensor_parallel_plan=given, **OPTIONS)
    assert {name for name, _ in plan.request.mesh.tp_layout} == {f"layers.{i}.feed_forward.w{k}" for i in (0, 1) for k in (1, 2, 3)}
    assert dict(plan.request.mesh.tp_layout)["layers.1.feed_forward.w2"] == "rowwise"


def test_a_layout_the_forward_cannot_run_says_how_to_split() -> None:
    model, batch = _tiny()
    with pytest.raises(ProfileError, match=r"(?s)examples/llama.py.*tensor_parallel=2.*split alike"):  # w3 left whole: w1 * w3 mismatch
        autoplan.plan(model, "1GB", example_inputs=batch, tensor_parallel=2, tensor_parallel_plan={"*.w1": "colwise", "*.w2": "rowwise"},
                      **OPTIONS)
