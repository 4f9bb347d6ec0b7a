"""Thirteen transformers families no test names, planned and counted by a loop written by hand.

Each family is built small from its config (3 layers, hidden 128, vocabulary 2,000, random weights: nothing is
downloaded), batch 4×256 with labels, AdamW, outputs kept through backward, and fine-tuned three ways: in full with
autoplan's default options, in full with `precision="fp32"`, and with peft LoRA on every linear layer (default
options). Each is planned at the budget halfway between its floor and no plan, then trained as
`benchmarks/independent.py` trains its rows: by `autoplan.verify`, and by a hand-written loop
(`out = model(**batch); out.loss.backward(); opt.step(); opt.zero_grad()`) counted by the CPU allocator's own
reports (`autoplan/verify/allocator.py`), never by the simulation's tracker; the losses are compared with the same
loop on the model without a plan.

    python benchmarks/families.py                 # every family (about 4 minutes on 2 cores)
    python benchmarks/families.py Gemma2 Phi3     # some
    python benchmarks/families.py --quantized GPTNeoX   # their 4-bit NF4 and 8-bit bases with LoRA instead

With `--quantized` each family is saved once and loaded again per run with bitsandbytes' quantization (as
`benchmarks/independent.py` loads its bases), `prepare_model_for_kbit_training`, then LoRA on every linear layer.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.independent import NF4, lora, quantized_lora, row  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402

SMALL = dict(vocab_size=2000, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             max_position_embeddings=512)
# family: (model class, config class, what its config needs beyond SMALL)
FAMILIES = {
    "Gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(num_key_value_heads=2, head_dim=32)),
    "Gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(num_key_value_heads=2, head_dim=32)),
    "Phi3": ("Phi3ForCausalLM", "Phi3Config", dict(num_key_value_heads=2, pad_token_id=0)),
    "GPTNeoX": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {}),
    "OPT": ("OPTForCausalLM", "OPTConfig", dict(ffn_dim=256, word_embed_proj_dim=128)),
    "Falcon": ("FalconForCausalLM", "FalconConfig", {}),
    "StableLm": ("StableLmForCausalLM", "StableLmConfig", dict(num_key_value_heads=2)),
    "Starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", dict(num_key_value_heads=2)),
    "Olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(num_key_value_heads=2)),
    "Qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(num_key_value_heads=2, head_dim=32)),
    "Granite": ("GraniteForCausalLM", "GraniteConfig", dict(num_key_value_heads=2)),
    "Cohere": ("CohereForCausalLM", "CohereConfig", dict(num_key_value_heads=2)),
    "GPT2": ("GPT2LMHeadModel", "GPT2Config", dict(n_embd=128, n_layer=3, n_head=4, n_positions=512)),
}


def builders(name: str):
    """The family's full model and its peft LoRA twin, each made anew per call."""
    import transformers

    model_class, config_class, extra = FAMILIES[name]

    def full():
        return getattr(transformers, model_class)(getattr(transformers, config_class)(**{**SMALL, **extra}))

    return full, lambda: lora(full())


def quantized_builders(name: str, folder: str):
    """The family saved to `folder`, and its 4-bit NF4 and 8-bit bases with LoRA, loaded anew per call."""
    import torch

    full, _ = builders(name)
    torch.manual_seed(0)
    full().save_pretrained(folder)
    return (("4-bit NF4 base + LoRA, default options", lambda: quantized_lora(folder, **NF4), {}),
            ("8-bit base + LoRA, default options", lambda: quantized_lora(folder, load_in_8bit=True), {}),
            ("8-bit base + LoRA, precision=fp32", lambda: quantized_lora(folder, load_in_8bit=True), dict(precision="fp32")))


def main() -> None:
    import tempfile

    warnings.filterwarnings("ignore")
    quantized = "--quantized" in sys.argv
    names = [name for name in sys.argv[1:] if name != "--quantized"] or list(FAMILIES)
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; these are known: {', '.join(FAMILIES)}")
    print(f"CPU, this machine: {describe_machine()}; the CPU allocator's count (autoplan/verify/allocator.py), 512 B "
          "blocks, peak of steps 2-4\n")
    print("| model | predicted | autoplan.verify | loop by hand | predicted − measured | no plan, by hand | "
          "largest loss difference to no plan |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        if quantized:
            runs = quantized_builders(name, tempfile.mkdtemp())
        else:
            full, lora = builders(name)
            runs = (("full, default options", full, {}), ("full, precision=fp32", full, dict(precision="fp32")),
                    ("LoRA all linears, default options", lora, {}))
        for label, build, options in runs:
            print(row(f"{name} {label}", build, options), flush=True)


if __name__ == "__main__":
    main()
