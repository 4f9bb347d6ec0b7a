"""Models no test names, planned and measured in the common loop (outputs alive through backward).

For each: the peak of checkpointing every layer by hand (transformers' own checkpointing), autoplan's
floor, and a Planner's plan at the budget halfway between the floor and no plan, trained for real
by `autoplan.verify` on the CPU; then 4-bit LoRA bases (bitsandbytes nf4, double quantization, peft
LoRA after `prepare_model_for_kbit_training`) with AdamW and bitsandbytes' AdamW8bit. Random
weights from small configs, each config's own use_cache default (True): nothing is downloaded.

    python benchmarks/unnamed_models.py            # every row (about 2 minutes on 2 cores)
"""

from __future__ import annotations

import copy
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402
from tests.handmade import enable_transformers_checkpointing, measured_step  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=128)


def tokens() -> dict:
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def families() -> list:
    import peft
    import transformers as t

    def lora(model, config):
        return peft.get_peft_model(model, config)

    return [
        ("Phi-3, GQA", lambda: t.Phi3ForCausalLM(t.Phi3Config(**SMALL, num_hidden_layers=4, num_key_value_heads=2, pad_token_id=0))),
        ("OLMo", lambda: t.OlmoForCausalLM(t.OlmoConfig(**SMALL, num_hidden_layers=3, pad_token_id=0))),
        ("SmolLM3", lambda: t.SmolLM3ForCausalLM(t.SmolLM3Config(**SMALL, num_hidden_layers=4, num_key_value_heads=2, pad_token_id=0))),
        ("StableLM", lambda: t.StableLmForCausalLM(t.StableLmConfig(**SMALL, num_hidden_layers=3, num_key_value_heads=2))),
        ("Gemma-2 + LoRA all-linear, dropout 0.1", lambda: lora(
            t.Gemma2ForCausalLM(t.Gemma2Config(**SMALL, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, sliding_window=16)),
            peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.1))),
        ("Mistral, sliding window + DoRA", lambda: lora(
            t.MistralForCausalLM(t.MistralConfig(**SMALL, num_hidden_layers=3, num_key_value_heads=2, sliding_window=16)),
            peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"], use_dora=True))),
        ("Granite + IA3", lambda: lora(
            t.GraniteForCausalLM(t.GraniteConfig(**SMALL, num_hidden_layers=3, num_key_value_heads=4)),
            peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]))),
    ]


def by_hand(model: torch.nn.Module) -> torch.nn.Module:
    copied = copy.deepcopy(model)
    inner = copied.get_base_model() if hasattr(copied, "get_base_model") else copied
    enable_transformers_checkpointing(inner)
    if inner is not copied:
        inner.enable_input_require_grads()
    return copied


def family_row(name: str, build) -> str:
    torch.manual_seed(0)
    model, batch = build(), tokens()
    model.train()
    hand = measured_step(by_hand(model), batch).peak_bytes
    planner = autoplan.Planner(model, example_inputs=batch, device="cpu", precision="fp32", reserve=0)
    wide = planner.plan("100%")
    floor, none = wide.prediction.minimum_peak_bytes, wide.prediction.peak_bytes
    plan = planner.plan((floor + none) // 2)
    measured = autoplan.verify(copy.deepcopy(model), plan, example_inputs=batch).measured_peak_bytes
    return (f"| {name} | {hand:,} | {floor:,} | {floor / hand:.4f}× | {plan.prediction.peak_bytes:,} | {measured:,} | "
            f"{plan.prediction.peak_bytes - measured:+,} |")


def qlora_rows() -> list[str]:
    import peft
    import transformers as t

    quantized = t.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                     bnb_4bit_compute_dtype=torch.bfloat16)
    rows = []
    for name, config_class, model_class, extra in (
        ("Qwen3", t.Qwen3Config, t.Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=16)),
        ("OLMo", t.OlmoConfig, t.OlmoForCausalLM, dict(pad_token_id=0)),
    ):
        folder = tempfile.mkdtemp()
        torch.manual_seed(0)
        model_class(config_class(**SMALL, num_hidden_layers=3, **extra)).save_pretrained(folder)
        for optimizer in ("adamw", "adamw8bit"):
            base = t.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantized, device_map="cpu")
            base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
            model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.05))
            batch = tokens()
            planner = autoplan.Planner(model, example_inputs=batch, device="cpu", reserve=0, optimizer=optimizer)
            wide = planner.plan("100%")
            plan = planner.plan((wide.prediction.minimum_peak_bytes + wide.prediction.peak_bytes) // 2)
            measured = autoplan.verify(model, plan, example_inputs=batch).measured_peak_bytes
            rows.append(f"| {name} 4-bit nf4 + LoRA all-linear, {optimizer} | {wide.prediction.minimum_peak_bytes:,} | "
                        f"{plan.prediction.peak_bytes:,} | {measured:,} | {plan.prediction.peak_bytes - measured:+,} |")
    return rows


def main() -> None:
    warnings.simplefilter("ignore")
    print(f"machine: {describe_machine(libraries=('transformers', 'peft', 'bitsandbytes'))}; CPU, fp32, AdamW, "
          "batch 2×32, outputs alive through backward\n")
    print("| model | by hand (B) | floor (B) | floor / by hand | halfway: predicted (B) | measured (B) | predicted − measured |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, build in families():
        print(family_row(name, build), flush=True)
    print("\n| 4-bit base | floor (B) | halfway: predicted (B) | measured (B) | predicted − measured |")
    print("|---|---:|---:|---:|---:|")
    for row in qlora_rows():
        print(row, flush=True)


if __name__ == "__main__":
    main()
