"""Fine-tuning memory: frozen parameters have no gradient or optimizer state, tied weights count once.

The static memory of a simulated training step is compared with the bytes of the model's own tensors, each storage
rounded to the allocator's 512-byte granule: AdamW keeps two fp32 tensors and a step count per
trainable parameter.
"""

from __future__ import annotations

import pytest

import autoplan
from autoplan.vocabulary.tensors import rounded_bytes, unique_storage_bytes
from tests.models import make_lora

STEP_BYTES = rounded_bytes(4)  # AdamW's per-parameter step counter, a float32 scalar


def _adamw_bytes(params) -> int:
    return sum(2 * rounded_bytes(p.numel() * p.element_size()) + STEP_BYTES for p in params)


def _static(model, example_inputs=None, batch_size=None, seq_len=None):
    """The static bytes of one simulated training step (the profile stage's ground truth)."""
    from autoplan.inputs.batch import training_batch
    from autoplan.inputs.devices import get_device
    from autoplan.profile.simulation import run_timeline
    from autoplan.trace.tracer import trace

    traced = trace(model, training_batch(model, example_inputs, batch_size, seq_len))
    keep = {unit: autoplan.Choice("keep", "fp32") for unit in traced.units}
    return run_timeline(traced, keep, device=get_device("cpu"), optimizer="adamw").static


def test_lora_counts_gradients_and_optimizer_state_for_the_adapters_only() -> None:
    model, inputs = make_lora()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert 0 < len(trainable) < len(list(model.parameters()))
    breakdown = _static(model, example_inputs=inputs)
    assert breakdown.parameters == unique_storage_bytes(list(model.parameters()) + list(model.buffers()))
    assert breakdown.gradients == unique_storage_bytes(trainable)
    assert breakdown.optimizer == _adamw_bytes(trainable)


def test_freezing_a_hf_models_embeddings_removes_their_gradient_and_optimizer_bytes() -> None:
    pytest.importorskip("transformers")
    from tests.families import BY_NAME

    family = BY_NAME["Llama"]
    full = _static(family.build(), batch_size=2, seq_len=16)
    model = family.build()
    embedding = model.model.embed_tokens.weight
    embedding.requires_grad_(False)
    frozen = _static(model, batch_size=2, seq_len=16)
    assert full.gradients - frozen.gradients == rounded_bytes(embedding.nbytes)
    assert full.optimizer - frozen.optimizer == _adamw_bytes([embedding])
    assert full.parameters == frozen.parameters


def test_gpt2s_tied_lm_head_is_counted_once() -> None:
    pytest.importorskip("transformers")
    from tests.families import BY_NAME

    model = BY_NAME["GPT-2"].build()
    assert model.lm_head.weight is model.transformer.wte.weight
    tensors = list(model.parameters()) + list(model.buffers())
    breakdown = _static(model, batch_size=2, seq_len=16)
    assert breakdown.parameters == unique_storage_bytes(tensors)
    with_duplicates = sum(rounded_bytes(p.nbytes) for _, p in model.named_parameters(remove_duplicate=False))
    once = sum(rounded_bytes(p.nbytes) for p in model.parameters())
    assert with_duplicates - once == rounded_bytes(model.lm_head.weight.nbytes)
    assert breakdown.gradients == unique_storage_bytes([p for p in model.parameters() if p.requires_grad])
    assert breakdown.optimizer == _adamw_bytes(model.parameters())
