"""The command line's option types and the options `plan` and `verify` share (names, defaults, help)."""

from __future__ import annotations

from enum import Enum

from typing import Any

import typer
from typer.core import TyperCommand


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


class OptionsGivenOnce(TyperCommand):
    """A command whose options may each be given once, save those meant to repeat (--units).

    click keeps the last of a repeated option and says nothing, so `--budget 1GB --budget 2GB` would
    plan for 2GB while the person may have read the first; a usage error (exit 2) says which.
    """

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:  # type: ignore[override]  # typer's own click
        repeated = repeated_option(self.params, args)
        if repeated is not None:
            names, given = repeated
            raise typer.BadParameter(f"given more than once ({', '.join(given)}); give it once", ctx=ctx, param_hint=names)
        return super().parse_args(ctx, args)


def repeated_option(params: list[Any], args: list[str]) -> tuple[str, list[str]] | None:
    """The first of a command's options (click parameters) that `args` give twice, as (its names, what each time
    gave), or None. Duck-typed: typer carries its own copy of click, so isinstance against `click.Option` fails."""
    options = {name: param for param in params if getattr(param, "param_type_name", "") == "option"
               for name in (*param.opts, *param.secondary_opts)}
    seen: dict[str, list[str]] = {}
    tokens = iter(args)
    for token in tokens:
        if token == "--":
            break
        name, attached = _option_name(token, options)
        if name is None:
            continue
        param = options[name]
        value = token if param.is_flag else attached if attached is not None else next(tokens, "")
        if param.multiple or param.count:
            continue
        given = seen.setdefault(param.name or name, [])
        given.append(value)
        if len(given) > 1:
            return " / ".join((*param.opts, *param.secondary_opts)), given
    return None


def _option_name(token: str, options: dict[str, Any]) -> tuple[str | None, str | None]:
    """Which option a command-line word names, and the value attached to it (--budget=1GB, -b1GB), if any."""
    if token.startswith("--"):
        name, equals, value = token.partition("=")
        return (name, value if equals else None) if name in options else (None, None)
    if token.startswith("-") and token[:2] in options:
        return token[:2], token[2:] or None
    return None, None
