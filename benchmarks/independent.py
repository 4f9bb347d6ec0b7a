"""The fine-tunes people run most, measured by a count that shares nothing with the plan.

A tiny Llama (4 layers, hidden 256, vocabulary 2,000, batch 4×256, AdamW, outputs kept through
backward), fine-tuned as people do: peft LoRA on every linear layer over an fp32 base (default
options, fp32, fp32 with the loss head as written), a 4-bit NF4 base and an 8-bit base with LoRA
(bitsandbytes, `prepare_model_for_kbit_training`), and a full fine-tune with bitsandbytes' AdamW8bit.
Each is planned at the budget halfway between its floor and no plan, then trained twice: by
`autoplan.verify`, and by a loop written by hand (`out = model(**batch); out.loss.backward();
opt.step(); opt.zero_grad()`), both counted by the CPU allocator's own reports
(`autoplan/verify/allocator.py`), never by the simulation's tracker. The losses of the hand-written
loop are compared with the same loop on the model without a plan. Random weights from a config:
nothing is downloaded.

    python benchmarks/independent.py            # every row (about 10 minutes on 2 cores)
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from autoplan.verify.allocator import AllocatorCount  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402

CONFIG = dict(vocab_size=2000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
              max_position_embeddings=512)
NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)


def batch() -> dict:
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 256), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def lora(model):
    """peft LoRA (r 8, alpha 16) on every linear layer, as people fine-tune."""
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))


def quantized_lora(folder: str, **quantization):
    """The model saved in `folder` loaded with bitsandbytes' `quantization`, prepared for k-bit training, with LoRA."""
    import peft
    import transformers as t

    base = t.AutoModelForCausalLM.from_pretrained(folder, quantization_config=t.BitsAndBytesConfig(**quantization), device_map="cpu")
    return lora(peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False))


def rows(folder: str) -> list[tuple[str, object, dict]]:
    import transformers as t

    def quantized(**config):
        return quantized_lora(folder, **config)

    def fp32():
        return t.AutoModelForCausalLM.from_pretrained(folder)

    return [
        ("peft LoRA all linears, fp32 base, default options", lambda: lora(fp32()), {}),
        ("same, precision=fp32", lambda: lora(fp32()), dict(precision="fp32")),
        ("same, precision=fp32, fuse_loss=False", lambda: lora(fp32()), dict(precision="fp32", fuse_loss=False)),
        ("4-bit NF4 base + LoRA", lambda: quantized(**NF4), {}),
        ("8-bit base + LoRA, default options", lambda: quantized(load_in_8bit=True), {}),
        ("8-bit base + LoRA, precision=fp32", lambda: quantized(load_in_8bit=True), dict(precision="fp32")),
        ("full fine-tune, AdamW8bit", fp32, dict(optimizer="adamw8bit")),
    ]


def hand_written_loop(model, optimizer_name: str, steps: int = 4) -> tuple[int, list[float]]:
    """The peak of steps 2.. and every loss of `for step: out = model(**batch); out.loss.backward(); ...`."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer_name == "adamw8bit":
        import bitsandbytes as bnb
        optimizer = bnb.optim.AdamW8bit(params)
    else:
        optimizer = torch.optim.AdamW(params)
    model.train()
    data, losses = batch(), []
    with AllocatorCount(resident=(model, data, optimizer)) as count:
        for step in range(steps):
            if step == 1:
                count.mark("steady")
            out = model(**data)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(out.loss))
    return max(stretch.peak_bytes for stretch in count.stretches()[1:]), losses


def row(name: str, build, options: dict) -> str:
    def fresh():
        # loaded again, as a person would, never copy.deepcopy'd: bitsandbytes' Params4bit.__deepcopy__ keeps the
        # original's layers alive in the copy (1,536,000 B here), which the plan of the original does not hold
        torch.manual_seed(0)
        return build()

    planner = autoplan.Planner(fresh(), example_inputs=batch(), device="cpu", reserve=0, **options)
    wide = planner.plan("100%")
    plan = planner.plan((wide.prediction.minimum_peak_bytes + wide.prediction.peak_bytes) // 2)
    verified = autoplan.verify(fresh(), plan, example_inputs=batch())
    optimizer = plan.request.optimizer
    unplanned_peak, unplanned_losses = hand_written_loop(fresh(), optimizer)
    planned = autoplan.apply(fresh(), plan)
    measured, losses = hand_written_loop(planned, optimizer)
    predicted = plan.prediction.peak_bytes
    drift = max(abs(a - b) for a, b in zip(losses, unplanned_losses))
    return (f"| {name} | {predicted:,} | {verified.measured_peak_bytes:,} | {measured:,} | "
            f"{(predicted - measured) / measured:+.2%} | {unplanned_peak:,} | {drift:.1e} |")


def main() -> None:
    import transformers as t

    warnings.filterwarnings("ignore")
    folder = tempfile.mkdtemp()
    torch.manual_seed(0)
    t.LlamaForCausalLM(t.LlamaConfig(**CONFIG)).save_pretrained(folder)
    print(f"CPU, this machine: {describe_machine()}; the CPU allocator's count (autoplan/verify/allocator.py), 512 B "
          "blocks, peak of steps 2-4\n")
    print("| model | predicted | autoplan.verify | loop by hand | predicted − measured | no plan, by hand | "
          "largest loss difference to no plan |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, build, options in rows(folder):
        print(row(name, build, options), flush=True)


if __name__ == "__main__":
    main()
