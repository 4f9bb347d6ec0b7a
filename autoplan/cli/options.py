"""The command line's option types and the options `plan` and `verify` share (names, defaults, help)."""

from __future__ import annotations

from enum import Enum

import typer


class Precision(str, Enum):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Optimizer(str, Enum):
    adamw = "adamw"
    adam = "adam"
    sgd = "sgd"
    sgd_momentum = "sgd-momentum"
    # bitsandbytes' (runtime.quantized_optim; docs/optimizers.md says what each keeps)
    adamw8bit = "adamw8bit"
    adam8bit = "adam8bit"
    paged_adamw = "paged-adamw"
    paged_adamw8bit = "paged-adamw8bit"
    paged_adamw32bit = "paged-adamw32bit"
    lion8bit = "lion8bit"


class OptimizerImpl(str, Enum):
    auto = "auto"
    foreach = "foreach"
    fused = "fused"
    for_loop = "for-loop"


# the training loop planned for (docs/loops.md): the same options for `plan` and `verify`
TARGET = typer.Argument(..., help="path/to/file.py:factory, package.module:factory, or hf:CONFIG (a preset such as gpt2, "
                        "llama-3-8b, or a path to config.json). A factory returns (model, example_inputs) and may take "
                        "batch_size and seq_len.")
UNITS = typer.Option(None, "--units", help='Name patterns of the blocks to plan, e.g. "layers.*" (repeat or comma-separate). '
                     "Default: the blocks the model repeats.")
MOE_CAPACITY = typer.Option(None, "--moe-capacity", help="Mixture-of-experts layers whose routing decides shapes: profile "
                            "each expert with CAPACITY × tokens × top_k / experts tokens (1.0: balanced routing). Default: the "
                            "worst case, every expert gets every token.")
DROP_OUTPUTS = typer.Option(False, "--drop-outputs", help="The loop drops the model's outputs before backward "
                            "(loss = model(**batch).loss). Default: they stay alive through backward "
                            "(outputs = model(**batch); outputs.loss.backward()).")
ACCUMULATION_STEPS = typer.Option(1, "--accumulation-steps", min=1, help="Micro-batches per optimizer step "
                                  "(gradient accumulation); the batch is one micro-batch.")
FUSE_LOSS = typer.Option(True, "--fuse-loss/--loss-as-written", help="Fuse the cross-entropy of the output head's "
                         "logits with that Linear (gradients in chunks, during the forward; no FLOP added), or keep the "
                         "loss as the model writes it.")
OFFLOAD = typer.Option(None, "--offload/--no-offload", help="Let units keep what they save in pinned host memory, "
                       "copied over the host link (default: on for a GPU target, off for the CPU).")
HOST_BUDGET = typer.Option(None, "--host-budget", help='Pinned host memory offloading may use, e.g. "64GB" or "40%" of '
                           "this machine's RAM. Default: half of it.")
COMPILE = typer.Option(False, "--compile", help="Plan for the model you will run under torch.compile: recomputing ops "
                       "without FLOPs (elementwise, norms) is priced as free, as Inductor fuses them, so units save "
                       "matmul/attention outputs and recompute the rest. Peaks stay the eager model's; the loss is "
                       "kept as written. Compile after applying the plan.")
OPTIMIZER_IMPL = typer.Option(OptimizerImpl.auto, "--optimizer-impl", help="The optimizer's implementation: "
                              "auto (torch's default for the device), foreach, fused, for-loop.")

VERBOSE = typer.Option(False, "--verbose", "-v", help="Name what the selective units save op by op (aten ops by "
                       "submodule), not only by kind (matmuls, attention, norms, ...).")
LADDER = typer.Option(False, "--ladder", help="Also plan the toolbox ladder of a Hugging Face model: baseline, + bf16, "
                      "+ checkpointing, + SDPA, + 4-bit QLoRA, + 8-bit optimizer, each with its predicted peak and step "
                      "time, and the first that fits (three more plans; needs the qlora extra).")
