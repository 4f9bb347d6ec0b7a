"""The two Trainer cases of `tests/framework_loops/`: transformers' `Trainer` and trl's `SFTTrainer` (QLoRA).

Both train through `TrainerInputs.trainer` and `run_trainer`, which marks the steps by a TrainerCallback;
both are planned by `autoplan.hf.optimize_for_trainer`, which reads the Trainer's loop from its arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from tests.framework_loops import (
    ACCUMULATION,
    BATCH,
    LEARNING_RATE,
    SEQ,
    STEPS,
    VOCAB,
    WIDTH,
    Case,
    Marker,
    TrainerInputs,
    output_dir,
    seeded,
    stack_rows,
    token_rows,
)


def trainer_case() -> Case:
    from transformers import Qwen2Config, Qwen2ForCausalLM, TrainingArguments, default_data_collator

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = seeded(lambda: Qwen2ForCausalLM(config))
    rows = token_rows(STEPS * ACCUMULATION * BATCH)
    args = TrainingArguments(output_dir=output_dir(), per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=LEARNING_RATE,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    inputs = TrainerInputs(args, rows, default_data_collator)
    loop_fields = dict(
        keep_outputs=False,  # compute_loss returns outputs["loss"]: the logits die with compute_loss
        accumulation_steps=ACCUMULATION,
        optimizer_impl="fused",  # optim="adamw_torch_fused", transformers 5's default
        loss_in_model=True,
        fetches_whole_step=True,  # get_batch_samples fetches every micro-batch of the step before its first forward
        batches_ahead=1,  # and accelerate's DataLoaderShard, which the Trainer iterates, holds the next one
    )
    return Case("trainer", model, stack_rows(rows[:BATCH]), loop_fields, lambda m, steps, counter, args=None:
                run_trainer(m, steps, counter, inputs, args), trainer=inputs)


def run_trainer(model: nn.Module, steps: int, counter: Marker, inputs: TrainerInputs, args: Any = None) -> list[float]:
    """The Trainer's train(); `args`: the TrainingArguments optimize_for_trainer returned, if it changed any."""
    from transformers import TrainerCallback

    class Marks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            counter.mark(f"step {state.global_step + 1}")

        def on_train_end(self, args, state, control, **kwargs):
            counter.mark("end")

    args = dataclasses.replace(args or inputs.args, max_steps=steps)
    trainer = inputs.trainer(model, args, [Marks()])
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def sft_qlora_case() -> Case:
    """trl's SFTTrainer on examples/sft_qlora.py's 4-bit NF4 Llama with LoRA (2 layers), its SFTConfig (packing, bf16).

    Packed rows of the real sentences are shorter than max_length; the planned batch is full bins (sft_batch)."""
    from datasets import Dataset

    from autoplan.inputs.hf_trl import sft_batch
    from examples import sft_qlora

    texts = sft_qlora.sentences() * 4  # enough packed rows for STEPS steps of two
    tokenizer = sft_qlora.word_tokenizer(texts)
    model = sft_qlora.qlora_llama(len(tokenizer), layers=2, width=WIDTH)
    args = sft_qlora.sft_config(output_dir(), STEPS, gradient_checkpointing=False)
    inputs = TrainerInputs(args, Dataset.from_dict({"text": texts}), None, processing_class=tokenizer)
    loop_fields = dict(
        keep_outputs=False,  # SFTTrainer's compute_loss reads its metrics from the outputs, then drops them
        optimizer_impl="fused",  # optim="adamw_torch_fused"
        grad_scaler=False,  # bf16: no scaler
        loss_in_model=True,
        fetches_whole_step=True,
        batches_ahead=1,  # accelerate's DataLoaderShard holds the next batch
    )
    return Case("sft_qlora", model, sft_batch(model, args, sft_qlora.BATCH, sft_qlora.MAX_LENGTH), loop_fields,
                lambda m, steps, counter, args=None: run_trainer(m, steps, counter, inputs, args), trainer=inputs)
