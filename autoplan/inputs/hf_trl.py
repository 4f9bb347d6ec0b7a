"""trl's SFTTrainer as autoplan plans it: the batch its collator makes from an `SFTConfig`, and the forward it calls.

`SFTConfig` subclasses transformers' `TrainingArguments`; what it adds changes the step's memory in
three ways, each planned the way trl 1.16 runs it:

- **Layout of a batch.** With `packing=True` and the default "bfd" (or "bfd_split") strategy, or with
  `padding_free=True`, trl's collator flattens the per-device batch into ONE row: `batch × max_length`
  tokens at most (each packed example holds up to `max_length` tokens), `position_ids` restarting at
  every document, no `attention_mask`. Attention then sees one long row, with a block-diagonal mask
  built from the position ids. Otherwise (no packing, or the "wrapped" strategy) a batch is
  `batch × max_length` with an attention mask: sequences are truncated to `max_length`, so that is
  the longest a padded batch gets.
- **The forward.** SFTTrainer patches the model with trl's fused LM head and calls
  `model(**batch, use_cache=False, fused_lm_head=True)`: the LM head projects in tiles and never holds
  the `(batch, seq_len, vocab)` logits the model's own loss would.
- **Quantized bases.** For a 4-bit or 8-bit base with peft adapters SFTTrainer casts the trainable
  parameters to bf16 (the QLoRA paper's recipe), so their gradients and AdamW state are bf16 too.

trl is imported only here, and only when an `SFTConfig` is handed in (which needs trl installed).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from autoplan.inputs.hf_models import HFModel

FLATTENING_PACKING_STRATEGIES = ("bfd", "bfd_split")  # trl turns padding_free on for these


def is_sft_config(args: Any) -> bool:
    """Whether `args` is trl's SFTConfig (told apart by the fields it adds to TrainingArguments)."""
    return all(hasattr(args, name) for name in ("packing", "padding_free", "max_length", "packing_strategy"))


def flattens_batch(args: Any) -> bool:
    """Whether SFTTrainer's collator flattens a batch into one row (padding-free), as trl decides it."""
    return bool(args.padding_free or (args.packing and args.packing_strategy in FLATTENING_PACKING_STRATEGIES))


def sft_batch(model: HFModel, args: Any, batch_size: int, seq_len: int) -> dict[str, Any]:
    """One batch of `batch_size` examples of `seq_len` tokens, made by trl's own collator as SFTTrainer makes it.

    Each example is one document of `seq_len` random tokens (with packing: one full bin of `max_length`);
    the keys are the forward call's: the collator's output, `use_cache=False` and `fused_lm_head=True`.
    """
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    generator = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(batch_size):
        tokens = torch.randint(0, config.vocab_size, (seq_len,), generator=generator).tolist()
        examples.append({"input_ids": tokens, "seq_lengths": [seq_len]} if args.packing else {"input_ids": tokens})
    collate = DataCollatorForLanguageModeling(pad_token_id=config.pad_token_id or 0, padding_free=flattens_batch(args),
                                              pad_to_multiple_of=args.pad_to_multiple_of)
    return {**collate(examples), "use_cache": False, "fused_lm_head": True}


@contextlib.contextmanager
def fused_lm_head(model: HFModel) -> Iterator[None]:
    """The model patched with trl's fused LM head, as SFTTrainer patches it, while planning; then as it was.

    SFTTrainer patches the model again when it is built, so the patch is not left behind here.
    """
    from trl.trainer.utils import add_fused_lm_head

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    missing = object()
    before = base.__dict__.get("forward", missing)
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))
    try:
        yield
    finally:
        if before is missing:
            del base.forward
        else:
            base.forward = before


def casts_adapters_to_bf16(model: torch.nn.Module) -> bool:
    """Whether SFTTrainer will cast this model's trainable parameters to bf16 (a quantized base, as trl tests it)."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def cast_adapters_to_bf16(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Cast the trainable parameters to bf16 as SFTTrainer does for a quantized base; each cast one with its old data.

    trl leaves DoRA's magnitude vectors in fp32 (bf16 cannot represent their small updates); so does this.
    """
    cast = []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and "lora_magnitude_vector" not in name and parameter.dtype != torch.bfloat16:
            cast.append((parameter, parameter.data))
            parameter.data = parameter.data.to(torch.bfloat16)
    return cast
