"""Sequence parallelism as planned: the layout found, the twin's collectives, the option's checks, and what a rank holds.

Its real step (torch's SequenceParallel and PrepareModuleInput on gloo ranks, counted by the CPU allocator) is
tests/apply/test_tensor_parallel.py's.
"""

from __future__ import annotations

import pytest
import torch

import autoplan
from autoplan.errors import OptionError
from autoplan.inputs.sequence_parallel import gather_sequence, resolve_sequence_layout, scatter_sequence
from autoplan.inputs.tensor_parallel import RowwiseShard, rank_model, resolve_layout
from examples.llama import Llama, LlamaConfig, example_batch
from tests.fsdp_model import tiny_qwen2

CONFIG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
OPTIONS = dict(device="cpu", reserve=0, profile="roofline", precision="fp32")


def _tiny(seq: int = 64):
    torch.manual_seed(0)
    return Llama(CONFIG), example_batch(CONFIG, 2, seq)


def test_torchtitan_and_transformers_llama_names_give_the_layout() -> None:
    model, _ = _tiny()
    layout = resolve_sequence_layout(model, resolve_layout(model, 2, None))
    assert layout.first_block == "layers.0" and layout.head == "output"
    assert layout.gathered == (("layers.0.attention", None), ("layers.0.feed_forward", None),
                               ("layers.1.attention", None), ("layers.1.feed_forward", None))
    assert layout.norms[-1] == "norm" and "layers.1.ffn_norm" in layout.norms
    qwen = tiny_qwen2()
    layout = resolve_sequence_layout(qwen, resolve_layout(qwen, 2, None))
    assert ("model.layers.0.self_attn", "hidden_states") in layout.gathered  # transformers passes it by keyword
    assert ("model.layers.0.mlp", None) in layout.gathered and layout.head == "lm_head" and layout.norms[-1] == "model.norm"


def test_models_it_is_not_laid_out_for_are_refused_with_what_it_needs() -> None:
    import transformers

    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    gemma = transformers.AutoModelForCausalLM.from_config(transformers.Gemma2Config(num_key_value_heads=2, head_dim=16, **shape))
    with pytest.raises(OptionError, match="pre_feedforward_layernorm.*leave sequence_parallel off"):
        resolve_sequence_layout(gemma, resolve_layout(gemma, 2, None))  # a norm SequenceParallel would not hold
    neox = transformers.AutoModelForCausalLM.from_config(transformers.GPTNeoXConfig(**shape))
    with pytest.raises(OptionError, match="neither torchtitan's Llama layout"):
        resolve_sequence_layout(neox, resolve_layout(neox, 2, None))
    model, _ = _tiny()
    with pytest.raises(OptionError, match="output is split but lies outside"):
        resolve_sequence_layout(model, (*resolve_layout(model, 2, None), ("output", "colwise")))


def test_the_twin_gathers_and_scatters_as_torch_stacks_them() -> None:
    x = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    whole = gather_sequence(x, 2)  # every rank's part: the twin's rank repeats its own
    assert whole.shape == (2, 8, 3) and torch.equal(whole[:, :4], x) and torch.equal(whole[:, 4:], x)
    one = gather_sequence(x[:1], 2)
    assert one.shape == (1, 8, 3) and one._base is not None  # batch of one: a view of the stacked gather, as torch's
    part = scatter_sequence(whole, 2)
    assert part.shape == (2, 4, 3) and torch.equal(part, x)  # rank 0's part (the sum over ranks is the collective's)


def test_a_rank_holds_less_with_the_sequence_split_and_says_so() -> None:
    model, batch = _tiny()
    alone = autoplan.plan(model, "1GB", example_inputs=batch, tensor_parallel=2, checkpoint={"layers.*": "keep"}, **OPTIONS)
    split = autoplan.plan(model, "1GB", example_inputs=batch, tensor_parallel=2, sequence_parallel=True,
                          checkpoint={"layers.*": "keep"}, **OPTIONS)
    assert split.prediction.peak_bytes < alone.prediction.peak_bytes
    # the block's input, both norms' outputs and the sum after attention: four [2, 64, 64] fp32 activations a layer,
    # each halved, at least; the gathered inputs the split linears save stay whole
    assert split.prediction.breakdown.activations <= alone.prediction.breakdown.activations - CONFIG.n_layers * 4 * 2 * 32 * 64 * 4
    assert split.request.mesh.sequence_parallel and split.to_dict()["sequence_parallel"] is True
    assert alone.to_dict()["sequence_parallel"] is False
    assert "(sequence parallel)" in split.request.mesh.split_words
    twin = rank_model(model, resolve_layout(model, 2, None), 2, resolve_sequence_layout(model, resolve_layout(model, 2, None)))
    assert isinstance(twin.layers[0].attention.wo, RowwiseShard) and twin.layers[0].attention.wo.sequence_parallel
    assert not model.layers[0].attention.wo.__dict__.get("sequence_parallel")  # the model itself is untouched


def test_a_transformers_llama_family_model_plans_with_the_sequence_split() -> None:
    model = tiny_qwen2()
    ids = torch.randint(0, model.config.vocab_size, (4, 256), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}  # long enough that activations, not the optimizer step, set the peak
    alone = autoplan.plan(model, "1GB", example_inputs=batch, tensor_parallel=2, **OPTIONS)
    split = autoplan.plan(model, "1GB", example_inputs=batch, tensor_parallel=2, sequence_parallel=True, **OPTIONS)
    assert split.outcome.feasible and split.prediction.peak_bytes < alone.prediction.peak_bytes
    assert split.prediction.breakdown.activations < alone.prediction.breakdown.activations


def test_the_option_is_checked_before_any_tracing() -> None:
    model, batch = _tiny()
    with pytest.raises(OptionError, match="give tensor_parallel=N"):
        autoplan.Planner(model, example_inputs=batch, sequence_parallel=True, **OPTIONS)
    with pytest.raises(OptionError, match="takes True or False"):
        autoplan.Planner(model, example_inputs=batch, tensor_parallel=2, sequence_parallel="yes", **OPTIONS)
    odd_model, odd_batch = _tiny(seq=63)
    with pytest.raises(OptionError, match=r"sequence \(63\) does not divide by 2"):
        autoplan.plan(odd_model, "1GB", example_inputs=odd_batch, tensor_parallel=2, sequence_parallel=True, **OPTIONS)
