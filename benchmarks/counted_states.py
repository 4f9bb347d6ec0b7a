"""The counted states (autoplan/profile/states.py) against a real training step's, on models no test names.

Where parameters, gradients and optimizer state alone are over the budget, `autoplan.plan` answers from
counting them on a fake twin (one optimizer step, no forward). Here the same models train for real on the
CPU in a loop written by hand (`loss = model(**batch).loss; loss.backward(); optimizer.step(); zero_grad()`),
and what c10's CPU allocator holds just before the second `optimizer.step()`, less the batch, is the real
step's parameters, gradients and optimizer state (`autoplan/verify/allocator.py`, never the simulation's
tracker). Families and fine-tunes the tests do not name: OPT, GPT-NeoX, Phi, Falcon; full fine-tunes with
AdamW, SGD with momentum and bitsandbytes' AdamW8bit, and peft LoRA. Random weights from configs.

    python benchmarks/counted_states.py      # about a minute on 2 cores
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoplan.inputs.devices import get_device  # noqa: E402
from autoplan.inputs.loop import TrainingLoop  # noqa: E402
from autoplan.profile.states import count_states  # noqa: E402
from autoplan.training.step_parts import make_optimizer  # noqa: E402
from autoplan.verify.allocator import AllocatorCount  # noqa: E402
from autoplan.vocabulary.tensors import unique_storage_bytes  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402

SMALL = dict(vocab_size=1000, hidden_size=128, num_attention_heads=4)


def _model(family: str):
    import transformers

    torch.manual_seed(0)
    configs = {
        "OPT": (transformers.OPTConfig, transformers.OPTForCausalLM, dict(SMALL, num_hidden_layers=3, ffn_dim=256, word_embed_proj_dim=128)),
        "GPT-NeoX": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, dict(SMALL, num_hidden_layers=3, intermediate_size=256)),
        "Phi": (transformers.PhiConfig, transformers.PhiForCausalLM, dict(SMALL, num_hidden_layers=3, intermediate_size=256)),
        "Falcon": (transformers.FalconConfig, transformers.FalconForCausalLM, dict(SMALL, num_hidden_layers=3)),
    }
    config_class, model_class, values = configs[family]
    return model_class(config_class(**values))


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))


ROWS = [
    ("OPT, AdamW", lambda: _model("OPT"), "adamw"),
    ("GPT-NeoX, SGD with momentum", lambda: _model("GPT-NeoX"), "sgd-momentum"),
    ("Phi, AdamW8bit (bitsandbytes)", lambda: _model("Phi"), "adamw8bit"),
    ("Falcon + peft LoRA, AdamW", lambda: _lora(_model("Falcon")), "adamw"),
]


def real_states(model, optimizer_name: str) -> int:
    """What the CPU allocator holds just before the second optimizer.step(), less the batch."""
    ids = torch.randint(0, SMALL["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "labels": ids.clone()}
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    optimizer = make_optimizer(optimizer_name, params, implementation="for-loop", device_kind="cpu")
    model.train()
    with AllocatorCount(resident=(model, data, optimizer)) as count:
        for step in range(2):
            loss = model(**data).loss
            loss.backward()
            del loss
            if step == 1:
                count.mark("before the second step")
            optimizer.step()
            optimizer.zero_grad()
    return count.stretches()[-1].start_bytes - unique_storage_bytes(data.values())


def main() -> None:
    print(describe_machine())
    print("| model and optimizer | counted | real step (CPU allocator) | difference |")
    print("|---|---:|---:|---:|")
    for name, build, optimizer in ROWS:
        counted = count_states(build(), device=get_device("cpu"), optimizer=optimizer, loop=TrainingLoop()).total
        real = real_states(build(), optimizer)
        print(f"| {name} | {counted:,} | {real:,} | {counted - real:+,} |", flush=True)


if __name__ == "__main__":
    main()
