"""Plan a QLoRA fine-tune: a 4-bit NF4 base (bitsandbytes) with peft LoRA adapters, as people load it.

    pip install -e ".[qlora]"
    python examples/qlora.py                                          # plan, check on real steps, train
    autoplan plan examples/qlora.py:build --budget 40MB --device cpu   # the same model from the shell
    autoplan plan examples/qlora.py:build --budget 24GB --device rtx-4090 --seq-len 2048

The base is a small Llama built from a config with random weights, saved to a temporary folder and
loaded back through transformers' BitsAndBytesConfig, so nothing is downloaded; bitsandbytes runs
its 4-bit matmuls on the CPU too, so the plan is checked against real training steps here.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from autoplan.vocabulary.formatting import format_bytes  # noqa: E402


def build(batch_size: int = 4, seq_len: int = 256):
    """A 4-bit NF4 Llama (double quantization, bf16 compute) with LoRA on every linear layer, and one batch."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=max(seq_len, 256))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, device_map="cpu")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # autoplan decides the checkpointing
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"))
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def main() -> None:
    model, batch = build()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"trainable (LoRA) parameters: {trainable:,}")
    wide = autoplan.plan(model, "1GB", example_inputs=batch, device="cpu", reserve=0)
    # the midpoint between no plan and everything checkpointed: a real trade-off
    budget = (wide.prediction.minimum_peak_bytes + wide.prediction.baseline_peak_bytes) // 2
    plan = autoplan.plan(model, budget, example_inputs=batch, device="cpu", reserve=0)
    print(plan.report())
    result = autoplan.verify(model, plan, example_inputs=batch)  # real steps of the common loop, outputs kept
    print(f"predicted peak {format_bytes(plan.prediction.peak_bytes)}, measured on real steps "
          f"{format_bytes(result.measured_peak_bytes)} ({result.measured_peak_bytes:,} vs {plan.prediction.peak_bytes:,} bytes)")

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(3):
        outputs = model(**batch)
        outputs.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {outputs.loss.item():.4f}")


if __name__ == "__main__":
    main()
