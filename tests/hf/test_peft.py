"""peft LoRA on a full-precision base: units found through the PeftModel wrapper, the prediction
equal to real steps in the common loop, and the adapters' own methods (`save_pretrained`,
`merge_and_unload`) still working on a planned model and after `remove_plan`.
"""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import autoplan  # noqa: E402
from tests.halfway import halfway_plan  # noqa: E402
from autoplan.planned.forwards import planned_choices  # noqa: E402

SIZES = dict(vocab_size=256, num_hidden_layers=3, num_attention_heads=4)


def lora_model(family: str, dropout: float = 0.0):
    torch.manual_seed(0)
    if family == "gpt2":
        base = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_positions=256, n_layer=3, n_head=4, vocab_size=256))
    else:
        config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_key_value_heads=2, max_position_embeddings=256, **SIZES)
        base = transformers.Qwen2ForCausalLM(config)
    return peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=dropout))


def batch():
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def cpu_halfway_plan(model, inputs, **options):
    return halfway_plan(model, example_inputs=inputs, device="cpu", reserve=0, **options)


@pytest.mark.parametrize("family,dropout", [("qwen2", 0.0), ("gpt2", 0.1)])
def test_lora_on_a_full_precision_base_predicts_real_steps(family, dropout):
    """The issue's 8.4% over-prediction was the KV cache: peft's forward passes use_cache on through
    **kwargs, so the wrapped model's signature decides that training runs without it."""
    model, inputs = lora_model(family, dropout), batch()
    plan = cpu_halfway_plan(model, inputs)
    assert [u.name for u in plan.decisions.units][0].startswith("base_model.model.")  # the blocks, found through the wrapper
    assert len(plan.decisions.units) == 3
    assert any(u.choice.mode != "keep" for u in plan.decisions.units)
    result = autoplan.verify(model, plan, example_inputs=inputs)
    assert result.measured_peak_bytes == plan.prediction.peak_bytes


def test_adapters_save_and_merge_after_apply_and_remove_plan(tmp_path):
    model, inputs = lora_model("qwen2"), batch()
    reference = lora_model("qwen2")
    reference.load_state_dict(model.state_dict())
    plan = cpu_halfway_plan(model, inputs)
    autoplan.apply(model, plan)
    assert planned_choices(model)

    model.save_pretrained(tmp_path / "planned")
    saved = peft.PeftModel.from_pretrained(lora_model("qwen2").get_base_model(), tmp_path / "planned")
    saved_adapters = {k: v for k, v in saved.state_dict().items() if "lora_" in k}
    assert saved_adapters and all(torch.equal(v, reference.state_dict()[k]) for k, v in saved_adapters.items())

    autoplan.remove_plan(model)
    assert not planned_choices(model)
    with torch.no_grad():
        for name, param in model.named_parameters():  # non-zero adapters, so merging changes the weights
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
                dict(reference.named_parameters())[name].copy_(param)
    merged, merged_reference = model.merge_and_unload(), reference.merge_and_unload()
    assert type(merged) is transformers.Qwen2ForCausalLM
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, merged_reference(**inputs).logits)


@pytest.mark.slow  # the whole pipeline
def test_merging_a_planned_model_keeps_the_plan_and_trains_as_the_merged_original():
    model, inputs = lora_model("qwen2"), batch()
    reference = lora_model("qwen2")
    plan = cpu_halfway_plan(model, inputs, precision="fp32")
    autoplan.apply(model, plan)
    merged, merged_reference = model.merge_and_unload(), reference.merge_and_unload()
    kept = planned_choices(merged)  # the base's own block names now, the same choices
    assert list(kept) == [name.removeprefix("base_model.model.") for name in planned_choices(model)]
    assert list(kept.values()) == list(planned_choices(model).values()) and any(c.mode != "keep" for c in kept.values())
    for m in (merged, merged_reference):
        m.train().requires_grad_(True)  # merged weights come back frozen, as the base was under LoRA
        m(**inputs).loss.backward()
    grads = dict(merged_reference.named_parameters())
    for name, param in merged.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, msg=name)
