"""Eight training loops of real frameworks, as cases a benchmark can plan and count: the loop each library runs.

`build(name)` makes one case: a tiny model with random weights from a config (nothing is downloaded), one
micro-batch as that model receives it, the `TrainingLoop` fields that describe the framework's loop, and
`run(model, steps, counter)`, which trains `model` by the framework's own loop on the CPU:

- `trainer`: transformers' `Trainer`, a Qwen2, 2 micro-batches of 4 × 64 tokens per optimizer step;
- `sft_qlora`: trl's `SFTTrainer` on a 4-bit NF4 Llama with LoRA (bitsandbytes), its SFTConfig's packing and bf16;
- `accelerate`: a loop by hand under `accelerate.Accelerator(gradient_accumulation_steps=2)`, a GPT-2;
- `nanogpt`: nanoGPT's train.py loop (the next batch fetched between forward and backward) on its GPT;
- `lightning`: `lightning.Trainer` on a LightningModule that wraps a Llama;
- `diffusers`: the step of diffusers' train_text_to_image.py: a UNet trained on a frozen VAE's latents and a
  frozen CLIP text encoder's states, with an EMA copy of the UNet;
- `sft_qwen2_8bit`: trl's `SFTTrainer` on a 4-bit NF4 Qwen2 with LoRA, bitsandbytes' 8-bit AdamW, 2 micro-batches;
- `trainer_qwen2vl`: transformers' `Trainer` on a Qwen2-VL, its image-text collator's batches (images of two sizes).

`run` calls `counter.mark(f"step {i}")` as optimizer step i (from 1) begins and `counter.mark("end")` once the
last one has ended, and returns each optimizer step's loss. Everything is seeded: two runs on models built
alike give the same losses. What the loop holds from before `run` is called (the model, and `Case.resident`)
is what a counting of the run must be told about; the data sets are host memory and stay out of it.

This module holds what every case shares (the sizes, `Case`, `build`, the seeded rows); the cases are in
`trainers.py` (the two Trainers), `hand_loops.py` (accelerate, nanoGPT), `lightning_diffusers.py` and
`trainer_variants.py` (the 8-bit-optimizer SFTTrainer, the vision-language Trainer);
`measure.py` plans a case at its halfway budget and counts its run, for `benchmarks/framework_loops.py`
(which prints the table) and `tests/end_to_end/test_framework_loops.py` (which asserts on it).

    case = build("nanogpt")
    plan = autoplan.plan(case.model, "4GB", example_inputs=case.example_inputs, loop=case.loop, loss_fn=case.loss_fn)
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import torch
from torch import nn

from autoplan import TrainingLoop

CASES = ("trainer", "sft_qlora", "accelerate", "nanogpt", "lightning", "diffusers", "sft_qwen2_8bit", "trainer_qwen2vl")
# The libraries each case imports beyond torch: a run without one of them skips that case.
LIBRARIES = {
    "trainer": ("transformers", "accelerate"),  # the Trainer needs accelerate
    "sft_qlora": ("transformers", "accelerate", "trl", "peft", "bitsandbytes", "datasets"),
    "accelerate": ("transformers", "accelerate"),
    "nanogpt": (),
    "lightning": ("transformers", "lightning"),
    "diffusers": ("transformers", "diffusers"),
    "sft_qwen2_8bit": ("transformers", "accelerate", "trl", "peft", "bitsandbytes", "datasets"),
    "trainer_qwen2vl": ("transformers", "accelerate"),
}
STEPS = 4  # optimizer steps a benchmark runs; the data sets hold batches for this many
ACCUMULATION = 2  # micro-batches per optimizer step, where the case accumulates
BATCH, SEQ, VOCAB, WIDTH = 4, 64, 1000, 64
LEARNING_RATE = 1e-3
# TrainingLoop's fields before the framework loops were planned for: a benchmark can plan with these alone, to compare
BASE_FIELDS = ("keep_outputs", "accumulation_steps", "zero_grad_set_to_none", "optimizer_impl", "grad_scaler",
               "loss_in_model")


class Marker(Protocol):
    """What `run` marks the steps on: `autoplan.verify.allocator.AllocatorCount`, or anything with `mark`."""

    def mark(self, label: str) -> None: ...


@dataclass(frozen=True)
class TrainerInputs:
    """What `autoplan.hf.optimize_for_trainer` and the Trainer are given besides the model."""

    args: Any  # transformers.TrainingArguments, or trl's SFTConfig
    train_dataset: Any
    data_collator: Callable[[list], dict[str, torch.Tensor]] | None  # None: the trainer's own
    processing_class: Any = None  # SFTTrainer's tokenizer

    def trainer(self, model: nn.Module, args: Any, callbacks: list) -> Any:
        """transformers' Trainer, or trl's SFTTrainer for an SFTConfig, as a person makes it."""
        if type(args).__name__ == "SFTConfig":
            from trl import SFTTrainer

            return SFTTrainer(model=model, args=args, train_dataset=self.train_dataset,
                              processing_class=self.processing_class, callbacks=callbacks)
        from transformers import Trainer

        return Trainer(model=model, args=args, train_dataset=self.train_dataset, data_collator=self.data_collator,
                       callbacks=callbacks)


@dataclass(frozen=True)
class Case:
    """One framework's loop on one tiny model: what to plan, and how the framework trains it."""

    name: str
    model: nn.Module  # what is planned and trained: the Lightning module's `model`, the diffusers UNet
    example_inputs: Any  # one micro-batch as the model receives it: a dict of keyword arguments, or a tuple
    loop_fields: dict[str, Any]  # the loop, TrainingLoop's fields by name (`loop_with` can leave some out: --base)
    run: Callable[..., list[float]]  # run(model, steps, counter) -> each optimizer step's loss
    loss_fn: Callable[[Any], torch.Tensor] | None = None  # where the model does not compute its loss
    resident: tuple[Any, ...] = ()  # what the loop holds on the device from before `run`, besides the model
    trainer: TrainerInputs | None = None  # the Trainer's case: planned by optimize_for_trainer with these
    notes: tuple[str, ...] = field(default=())  # what the loop does that its fields do not say

    @property
    def loop(self) -> TrainingLoop:
        return self.loop_with()

    def loop_with(self, names: Iterable[str] | None = None) -> TrainingLoop:
        """The loop from the fields of `loop_fields` that `names` names (None: all of them)."""
        return TrainingLoop(**{name: value for name, value in self.loop_fields.items() if names is None or name in names})


def build(name: str) -> Case:
    """The case `name` (one of CASES), its model built afresh with seeded random weights."""
    from tests.framework_loops.hand_loops import accelerate_case, nanogpt_case
    from tests.framework_loops.lightning_diffusers import diffusers_case, lightning_case
    from tests.framework_loops.trainer_variants import sft_qwen2_8bit_case, trainer_qwen2vl_case
    from tests.framework_loops.trainers import sft_qlora_case, trainer_case

    builders = {"trainer": trainer_case, "sft_qlora": sft_qlora_case, "accelerate": accelerate_case,
                "nanogpt": nanogpt_case, "lightning": lightning_case, "diffusers": diffusers_case,
                "sft_qwen2_8bit": sft_qwen2_8bit_case, "trainer_qwen2vl": trainer_qwen2vl_case}
    if name not in builders:
        raise ValueError(f"no case {name!r}; the cases are {list(builders)}")
    return builders[name]()


def token_rows(examples: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`examples` rows of SEQ random tokens, labels the same tokens (the model shifts them)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(examples):
        tokens = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        rows.append({"input_ids": tokens, "labels": tokens.clone()})
    return rows


def stack_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def output_dir() -> str:
    """A Trainer's output_dir, removed when the process exits (each case made one under /tmp and left it there)."""
    path = tempfile.mkdtemp(prefix="framework_loops_")
    atexit.register(shutil.rmtree, path, True)
    return path


def seeded(build_model: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return build_model()
