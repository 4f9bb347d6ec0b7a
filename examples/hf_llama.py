"""Plan a Hugging Face Llama (built from a config, random weights) for an H100, rewrite it, train it.

    pip install -e ".[hf]" && python examples/hf_llama.py

Nothing is downloaded: the model comes from a LlamaConfig. autoplan builds the training batch
from the config (batch_size × seq_len tokens, labels = the tokens, so the model computes its own
loss), plans on fake tensors for the h100-80gb profile at a budget halfway between "everything
checkpointed" and "no plan", then rewrites the model in place and trains a few steps here.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from autoplan.inputs.hf_models import example_inputs_for

BATCH, SEQ = 4, 256


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
    )
    model = LlamaForCausalLM(config)
    start = time.perf_counter()
    no_plan = autoplan.plan(model, "100%", batch_size=BATCH, seq_len=SEQ, device="h100-80gb", reserve=0)
    budget = (no_plan.prediction.minimum_peak_bytes + no_plan.prediction.baseline_peak_bytes) // 2
    plan = autoplan.plan(model, budget, batch_size=BATCH, seq_len=SEQ, device="h100-80gb", reserve=0)
    print(plan.report())
    print(f"planned twice in {time.perf_counter() - start:.1f} s (traced by {plan.model.trace_method})\n")

    autoplan.apply(model, plan)  # the same LlamaForCausalLM: save_pretrained/generate still work
    batch = example_inputs_for(model, BATCH, SEQ)  # the batch the plan was made for
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for step in range(3):
        loss = model(**batch, use_cache=False).loss  # training reads no KV cache back
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    model.eval()
    tokens = model.generate(batch["input_ids"][:1, :8], max_new_tokens=8, do_sample=False)
    print("generate after the rewrite:", tokens[0, 8:].tolist())


if __name__ == "__main__":
    main()
