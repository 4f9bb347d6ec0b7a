"""Train a small Hugging Face Llama with transformers' `Trainer`, planned by autoplan.

    pip install -e ".[hf]" && python examples/hf_trainer.py

Nothing is downloaded: the model comes from a LlamaConfig with random weights and the data are
random tokens. The `TrainingArguments` are what a person would write (activation checkpointing
on, to fit); `autoplan.hf.optimize_for_trainer` plans the Trainer's own training step for them (it
drops the logits before backward, steps the Trainer's optimizer, accumulates as the arguments
say), rewrites the model in place, and returns the arguments with what the plan needs changed:
here `activation_checkpointing=False` (`gradient_checkpointing` before transformers 5.x), because
the plan checkpoints per layer itself. The callback prints the plan when training starts (and, on
a GPU, the measured peak after the first steps).

The budget is in megabytes only because the model is tiny: halfway between everything
checkpointed and no plan, so that the plan has a real trade-off to make. It plans for this
machine's CPU (the `cpu` device profile) and trains here.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from autoplan.hf import AutoplanCallback, TrainerPlan, optimize_for_trainer  # noqa: E402

BATCH, SEQ, STEPS = 8, 64, 3
# transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name warns)
CHECKPOINTING = "activation_checkpointing" if hasattr(TrainingArguments, "activation_checkpointing") else "gradient_checkpointing"


def synthetic_dataset(examples: int, seq_len: int, vocab_size: int) -> list[dict[str, torch.Tensor]]:
    """Random token sequences as a causal-LM dataset: the labels are the tokens (the model shifts them)."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(examples):
        tokens = torch.randint(0, vocab_size, (seq_len,), generator=generator)
        rows.append({"input_ids": tokens, "attention_mask": torch.ones(seq_len, dtype=torch.long), "labels": tokens})
    return rows


def small_llama(layers: int = 4, width: int = 128) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=1024, hidden_size=width, intermediate_size=2 * width + width // 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def halfway_budget(model: LlamaForCausalLM, batch_size: int, seq_len: int) -> int:
    """A budget between "everything checkpointed" and "no plan" for this model and batch, in bytes."""
    probe = autoplan.plan(model, "100%", batch_size=batch_size, seq_len=seq_len, device="cpu", reserve=0)
    return (probe.prediction.minimum_peak_bytes + probe.prediction.baseline_peak_bytes) // 2


@dataclass(frozen=True)
class ExampleRun:
    """What the example did: the plan and argument changes, and the loss of every step."""

    setup: TrainerPlan
    losses: tuple[float, ...]


def main(steps: int = STEPS, output_dir: str | None = None, write=print) -> ExampleRun:
    torch.manual_seed(0)
    model = small_llama()
    dataset = synthetic_dataset(BATCH * steps, SEQ, model.config.vocab_size)
    with tempfile.TemporaryDirectory() as scratch:
        args = TrainingArguments(
            output_dir=output_dir or scratch, per_device_train_batch_size=BATCH, max_steps=steps,
            learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
            **{CHECKPOINTING: True},  # what people turn on to fit; the plan replaces it, layer by layer
        )
        budget = halfway_budget(model, BATCH, SEQ)
        setup = optimize_for_trainer(model, args, budget, device="cpu", reserve=0, train_dataset=dataset)
        write(f"autoplan changed {len(setup.changes)} training argument(s):")
        for change in setup.changes:
            write(f"  {change}")
        trainer = Trainer(model=model, args=setup.training_args, train_dataset=dataset,
                          callbacks=[AutoplanCallback(setup.plan, write=write)])
        trainer.train()
    losses = tuple(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    write("planned layers: " + ", ".join(f"{name} {choice}" for name, choice in autoplan.planned_choices(model).items()))
    return ExampleRun(setup=setup, losses=losses)


if __name__ == "__main__":
    main()
