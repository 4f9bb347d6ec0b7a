"""QLoRA supervised fine-tuning with trl's `SFTTrainer`, planned by autoplan.

    pip install -e ".[qlora]" trl datasets && python examples/sft_qlora.py

Nothing is downloaded: the base is a small Llama built from a LlamaConfig with random weights, saved
to a temporary folder and loaded back 4-bit (NF4, double quantization, bf16 compute) through
transformers' BitsAndBytesConfig, with peft LoRA on every linear layer; the tokenizer is a word-level
one built here with `tokenizers`, and the data are a few dozen short sentences.

The `SFTConfig` is what a person would write: `packing=True` (trl's default "bfd" strategy flattens
each batch into one row of up to batch × max_length tokens) and trl's defaults of
`gradient_checkpointing=True` and `bf16=True`. `autoplan.hf.optimize_for_trainer` plans the step
SFTTrainer really runs with it (that flattened row, trl's fused LM head, the adapters cast to bf16
as SFTTrainer casts them on a quantized base, bf16 autocast, AdamW), rewrites the model in place and
turns the trainer's own checkpointing off: the plan checkpoints the layers it chose. The budget,
in megabytes because the model is tiny, is halfway between "every layer checkpointed" and "none
checkpointed" for this machine's CPU (the `cpu` device profile). The plan is checked on real steps of the
planned batch, then SFTTrainer trains the rewritten model on the CPU.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from autoplan.hf import AutoplanCallback, TrainerPlan, optimize_for_trainer  # noqa: E402
from autoplan.vocabulary.formatting import format_bytes  # noqa: E402

STEPS, BATCH, MAX_LENGTH = 3, 2, 64
SUBJECTS = ("the quick fox", "a lazy dog", "my old cat", "the red bird", "our small boat", "that tall tree")
ACTIONS = ("jumps over", "sleeps under", "looks at", "runs past", "waits by", "sings to")
PLACES = ("the fence", "a river", "the moon", "an old house", "the green hill", "a quiet road")


def sentences() -> list[str]:
    """A few dozen short sentences: every subject with every action, at a place that cycles."""
    return [f"{subject} {action} {PLACES[(i + j) % len(PLACES)]} ."
            for i, subject in enumerate(SUBJECTS) for j, action in enumerate(ACTIONS)]


def word_tokenizer(texts: list[str]):
    """A word-level tokenizer over the words of `texts`, made here (no download), with pad/eos/unk tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({word for text in texts for word in text.split()})
    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2} | {word: index + 3 for index, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")


def qlora_llama(vocab_size: int, *, compute_dtype: torch.dtype = torch.bfloat16, layers: int = 4, width: int = 128):
    """A Llama with random weights loaded back 4-bit NF4 (double quantization), LoRA on every linear layer."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = quantized_llama(vocab_size, compute_dtype=compute_dtype, layers=layers, width=width)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # autoplan decides the checkpointing
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))


def quantized_llama(vocab_size: int, *, compute_dtype: torch.dtype = torch.bfloat16, layers: int = 4, width: int = 128):
    """A Llama with random weights loaded back 4-bit NF4 (double quantization), no adapters."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width + width // 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=BATCH * MAX_LENGTH, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=compute_dtype)
        return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, device_map="cpu")


def sft_config(output_dir: str, steps: int, **changes):
    """The SFTConfig a person would write; gradient_checkpointing=True and bf16=True are trl's defaults."""
    from trl import SFTConfig

    values = dict(output_dir=output_dir, max_length=MAX_LENGTH, packing=True, per_device_train_batch_size=BATCH,
                  max_steps=steps, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                  disable_tqdm=True, seed=0)
    return SFTConfig(**(values | changes))


@dataclass(frozen=True)
class ExampleRun:
    """What the example did: the plan and argument changes, the check on real steps, the loss of every step."""

    setup: TrainerPlan
    verification: autoplan.Verification
    losses: tuple[float, ...]


def main(steps: int = STEPS, output_dir: str | None = None, write=print) -> ExampleRun:
    from datasets import Dataset
    from trl import SFTTrainer

    texts = sentences()
    tokenizer = word_tokenizer(texts)
    model = qlora_llama(len(tokenizer))
    dataset = Dataset.from_dict({"text": texts})
    with tempfile.TemporaryDirectory() as scratch:
        args = sft_config(output_dir or scratch, steps)
        probe = optimize_for_trainer(model, args, "1GB", device="cpu", reserve=0, apply=False)
        # halfway between every layer checkpointed and none (in bf16, as planned): a real trade-off
        budget = (probe.plan.prediction.minimum_peak_bytes + probe.plan.prediction.peak_bytes) // 2
        setup = optimize_for_trainer(model, args, budget, device="cpu", reserve=0)
        write(f"autoplan changed {len(setup.changes)} training argument(s):")
        for change in setup.changes:
            write(f"  {change}")
        for note in setup.notes:
            write(f"  note: {note}")
        trainer = SFTTrainer(model=model, args=setup.training_args, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=[AutoplanCallback(setup.plan, write=write)])
        # SFTTrainer has now patched its fused LM head in, so the planned batch runs as the trainer runs it
        verification = autoplan.verify(model, setup.plan, example_inputs=setup.example_inputs)
        write(f"planned batch {tuple(setup.example_inputs['input_ids'].shape)}: predicted peak "
              f"{format_bytes(verification.predicted_peak_bytes)}, measured on real steps "
              f"{format_bytes(verification.measured_peak_bytes)} ({verification.measured_peak_bytes:,} vs "
              f"{verification.predicted_peak_bytes:,} bytes)")
        trainer.train()
    losses = tuple(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    write("losses: " + ", ".join(f"{loss:.4f}" for loss in losses))
    return ExampleRun(setup=setup, verification=verification, losses=losses)


if __name__ == "__main__":
    main()
