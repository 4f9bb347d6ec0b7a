"""The command line's options: those of `autoplan.plan`, made from its schema (`inputs.options.PlanOptions`),
and the command line's own (the loop it plans for, its outputs, verify's run), as one `CommandLine` value.

`with_flags(command, ...)` gives a command every flag: TARGET, then the budget, the plan's options the
command takes, and its own, in that order (`autoplan plan --help`, and docs/command-line.md's table:
`options_table`). Typer hands them to the command as one `CommandLine`, with the plan's options already
in `autoplan.plan`'s words (enum members as their names, `--units` split, `--world-size` as a number or
"auto"). No torch here: a mistyped option is answered before torch is loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from typer.core import TyperCommand

from autoplan.cli.exits import CliError, ExitCode
from autoplan.inputs.options import BUDGET_FLAG, Flag, flagged
from autoplan.inputs.settings import check_world_size

TARGET = typer.Argument(..., help="path/to/file.py:factory, package.module:factory, or hf:CONFIG (a preset such as gpt2, "
                        "llama-3-8b, or a path to config.json). A factory returns (model, example_inputs) and may take "
                        "batch_size and seq_len.")
VERIFY_TARGET = typer.Argument(..., help="As for `autoplan plan`; hf: models are built with random weights.")

# the training loop planned for (docs/loops.md): the same flags for `plan` and `verify`, made into one TrainingLoop
DROP_OUTPUTS = Flag(("--drop-outputs",), "The loop drops the model's outputs before backward (loss = model(**batch).loss). "
                    "Default: they stay alive through backward (outputs = model(**batch); outputs.loss.backward()).",
                    "plan for a loop that drops the model's outputs once the loss is computed (the Trainer's); default: kept "
                    "through backward ([loops.md](loops.md))", bool)
ACCUMULATION_STEPS = Flag(("--accumulation-steps",), "Micro-batches per optimizer step (gradient accumulation); the batch is "
                          "one micro-batch.", "micro-batches per optimizer step (the batch is one micro-batch); default 1", int,
                          metavar="N", minimum=1)
OPTIMIZER_IMPL = Flag(("--optimizer-impl",), "The optimizer's implementation: auto (torch's default for the device), foreach, "
                      "fused, for-loop.", "`foreach`, `fused` or `for-loop`: the optimizer implementation whose temporaries are "
                      "counted; default torch's for the device", ("auto", "foreach", "fused", "for-loop"))
ZERO_GRAD_BEFORE_BACKWARD = Flag(("--zero-grad-before-backward",), "zero_grad runs between the forward and backward "
                                 "(Lightning's automatic optimization), not after optimizer.step().", "the loop zeroes the "
                                 "gradients between the forward and backward, as Lightning does: the last step's gradients are "
                                 "alive through the forward ([loops.md](loops.md))", bool)
FETCHES_WHOLE_STEP = Flag(("--fetches-whole-step",), "Every micro-batch of an optimizer step is on the device before its "
                          "first forward (the Trainer's get_batch_samples).", "every micro-batch of an optimizer step is on "
                          "the device before its first forward, as the transformers Trainer fetches them", bool)
BATCHES_AHEAD = Flag(("--batches-ahead",), "Batches fetched ahead of the one training (nanoGPT's prefetch: 1).", "batches on "
                     "the device ahead of the one training (nanoGPT fetches the next one during the step: 1); default 0", int,
                     metavar="N", minimum=0)
KEPT_ON_DEVICE = Flag(("--kept-on-device",), "Memory the loop keeps on the device beside the model: frozen encoders, an EMA "
                      "copy, latents (e.g. 1.2GB).", "memory the loop keeps on the device beside the model and its batch "
                      "(frozen encoders, an EMA copy, latents and noise), e.g. `1.2GB`; in Python "
                      "`TrainingLoop().keeping(vae, text_encoder, ema)` counts it", metavar="SIZE", unset=True)
OUTER_AUTOCAST = Flag(("--outer-autocast",), "The loop runs the forward and the loss under its own torch.autocast in this "
                      "precision (bf16 or fp16); every unit then runs in it.", "`bf16` or `fp16`: the loop's own `with "
                      "torch.autocast(...)` around the forward and the loss (the PyTorch AMP recipe); every unit runs in it",
                      ("bf16", "fp16"), unset=True)
LOOP = {"drop_outputs": (DROP_OUTPUTS, False), "accumulation_steps": (ACCUMULATION_STEPS, 1), "optimizer_impl": (OPTIMIZER_IMPL, "auto"),
        "zero_grad_before_backward": (ZERO_GRAD_BEFORE_BACKWARD, False), "fetches_whole_step": (FETCHES_WHOLE_STEP, False),
        "batches_ahead": (BATCHES_AHEAD, 0), "kept_on_device": (KEPT_ON_DEVICE, None), "outer_autocast": (OUTER_AUTOCAST, None)}

# what the commands write and say
JSON = Flag(("--json",), "Write the plan and advice as JSON to this file (- for stdout; the report then goes to stderr).",
            "write the plan and the advice (schema below); `-` writes it to stdout, and the report (and whatever the target "
            "itself prints) to stderr. The folder must exist: autoplan makes none (a typo in it is exit 2 before planning)", Path,
            verify_help="Write the plan and the measurement as JSON to this file (- for stdout; the table then goes to stderr).",
            metavar="FILE")
PLOT = Flag(("--plot",), "Write memory over the training step, before and after the plan, to this .png/.svg/.pdf (needs "
            "matplotlib).", "write memory over the training step, no plan vs planned, with the budget, to `.png`/`.svg`/`.pdf`; "
            "needs `pip install -e \".[plot]\"` (matplotlib)", Path, verify=False, metavar="FILE")
LADDER = Flag(("--ladder",), "Also plan the toolbox ladder of a Hugging Face model: baseline, + bf16, + checkpointing, + SDPA, "
              "+ 4-bit QLoRA, + 8-bit optimizer, each with its predicted peak and step time, and the first that fits (three more "
              "plans; needs the qlora extra).", "also plan the toolbox ladder of a Hugging Face model: baseline (fp32, eager "
              "attention) → + bf16 → + checkpointing (autoplan's plan) → + fused attention (SDPA) → + 4-bit QLoRA → + 8-bit "
              "optimizer, each with its predicted peak and step time, the first that fits marked, and the transformers/peft/"
              "bitsandbytes lines that apply it (three more plans, with the plan's own options; needs `pip install -e \".[qlora]\"`, "
              "exit 7 without it; a model that is not a transformers one, or is already peft or quantized: exit 2, before planning)",
              bool, verify=False)
VERBOSE = Flag(("--verbose", "-v"), "Name what the selective units save op by op (aten ops by submodule), not only by kind "
               "(matmuls, attention, norms, ...).", "name what the selective units save op by op (aten ops by submodule), not only "
               "by kind (matmuls, attention, norms, ...); `plan.report(verbose=True)` in Python", bool)
DEBUG = Flag(("--debug",), "Show tracebacks and torch's own output.", "tracebacks with errors, and torch's own logs and output "
             "(silenced otherwise)", bool)
STEPS = Flag(("--steps",), "Real training steps to run (the first warms up).", "real training steps to run (the first warms up); "
             "default 3", int, metavar="N", minimum=2)
ON = Flag(("--on",), "Where to run: cuda or cpu. Default: cuda if there is a GPU.", "where to run: `cuda` or `cpu` (default: cuda "
          "if there is a GPU)")
OUTPUTS = {"json_path": (JSON, None), "plot": (PLOT, None), "ladder": (LADDER, False), "verbose": (VERBOSE, False),
           "debug": (DEBUG, False)}
RUN = {"steps": (STEPS, 3), "on": (ON, None)}


@dataclass(frozen=True)
class CommandLine:
    """What a command was given, TARGET aside, as typed (enum members by their names)."""

    budget: str  # read once, by the command (`inputs.budget.read_budget`)
    given: dict[str, Any]  # every other flag by its parameter name: the plan's options, the loop's, the command's own
    plan_names: tuple[str, ...]  # which of them are autoplan.plan's options

    def __getattr__(self, name: str) -> Any:  # `cli.json_path`, `cli.batch_size`: a flag by name
        given = self.__dict__.get("given", {})
        if name in given:
            return given[name]
        raise AttributeError(name)

    def options(self) -> dict[str, Any]:
        """autoplan.plan's keywords: the options given, in its words (--world-size as a number or "auto", only where
        given; --units split; the loop made of --drop-outputs, --accumulation-steps, --optimizer-impl); the batch size and
        sequence length go to the factory instead."""
        from autoplan.inputs.loop import TrainingLoop

        options = {name: self.given[name] for name in self.plan_names
                   if name not in ("batch_size", "seq_len", "world_size", "tensor_parallel")}
        if self.given.get("world_size") is not None:
            options["world_size"] = parse_world_size(self.given["world_size"])
        if self.given.get("tensor_parallel") is not None:
            options["tensor_parallel"] = parse_tensor_parallel(self.given["tensor_parallel"])
        options["units"] = split_units(options.get("units"))
        kept = 0 if self.kept_on_device is None else read_kept_bytes(self.kept_on_device)
        options["loop"] = TrainingLoop(keep_outputs=not self.drop_outputs, accumulation_steps=self.accumulation_steps,
                                       optimizer_impl=self.optimizer_impl, zero_grad_before_backward=self.zero_grad_before_backward,
                                       fetches_whole_step=self.fetches_whole_step, batches_ahead=self.batches_ahead,
                                       kept_on_device_bytes=kept, outer_autocast=self.outer_autocast)
        return options


def read_kept_bytes(text: str) -> int:
    """--kept-on-device's size in bytes (0 is nothing), or exit 2 saying what it takes."""
    from autoplan.vocabulary.sizes import read_size

    def fail(reason: str) -> CliError:
        return CliError(ExitCode.USAGE, f"--kept-on-device takes a size such as 1.2GB or 800MiB: {reason}")

    # a percentage has no memory to be taken of here: Size.bytes says so
    return read_size(text, allow_zero=True, what="size", fail=fail).bytes(None, allow_zero=True, what="size", fail=fail)


def with_flags(command: str, own: dict[str, tuple[Flag, Any]]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A command taking TARGET and a `CommandLine` becomes one with every flag: the budget, the plan's options it
    takes, the loop's, then `own` (name -> (flag, default)); typer reads them from its signature."""
    plan_flags = [(name, flag, _plan_default(name, flag)) for name, flag in flagged() if command == "plan" or flag.verify]
    every = [("budget", BUDGET_FLAG, ...), *plan_flags, *((name, *given) for name, given in LOOP.items()),
             *((name, *given) for name, given in own.items())]

    def decorate(function: Callable[..., None]) -> Callable[..., None]:
        target = next(iter(inspect.signature(function).parameters.values()))
        parameters = [target.replace(annotation=str)] + [_parameter(name, flag, default, command) for name, flag, default in every]

        @functools.wraps(function)
        def run(**given: Any) -> None:
            function(given.pop(target.name), _command_line(given, [name for name, _, _ in plan_flags]))

        run.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]  # typer reads it
        run.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
        run.flags = {name: flag for name, flag, _ in every}  # type: ignore[attr-defined]  # the docs' table reads them
        return run

    return decorate


def _plan_default(name: str, flag: Flag) -> Any:
    return None if flag.unset else next(f.default for f in dataclasses.fields(_schema()) if f.name == name)


def _schema() -> type:
    from autoplan.inputs.options import PlanOptions

    return PlanOptions


def _parameter(name: str, flag: Flag, default: Any, command: str) -> inspect.Parameter:
    """One flag as typer reads a parameter: its type (a choice of names is an Enum) and its typer.Option."""
    kind: Any = flag.kind
    if isinstance(kind, tuple):
        kind = _choices(name, kind)
        default = None if default is None else kind(default)
    elif kind is list:
        kind = list[str]
    help_text = flag.verify_help if command == "verify" and flag.verify_help else flag.help
    option = typer.Option(default, *flag.names, help=help_text, min=flag.minimum)
    annotation = Optional[kind] if default is None else kind
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option, annotation=annotation)


def _choices(name: str, names: tuple[str, ...]) -> Any:
    """The names an option takes, as the Enum typer lists and checks them by."""
    return Enum(name, {choice.replace("-", "_"): choice for choice in names}, type=str)


def _command_line(given: dict[str, Any], plan_names: list[str]) -> CommandLine:
    values = {name: value.value if isinstance(value, Enum) else value for name, value in given.items()}
    return CommandLine(values.pop("budget"), values, tuple(plan_names))


def parse_world_size(text: str) -> int | str:
    """--world-size N or auto: the plan's FSDP world size; a usage error (exit 2) before torch is imported."""
    if text == "auto":
        return text
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise CliError(ExitCode.USAGE, f"--world-size must be a whole number of GPUs, at least 1, or auto; got {text!r}")
    return check_world_size(int(text), option="--world-size")


def parse_tensor_parallel(text: str) -> int | str:
    """--tensor-parallel N or auto; a usage error (exit 2) before torch is imported."""
    if text == "auto":
        return text
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise CliError(ExitCode.USAGE, f"--tensor-parallel must be a whole number of ranks, at least 1, or auto; got {text!r}")
    return int(text)


def split_units(values: Optional[list[str]]) -> Optional[list[str]]:
    """--units as patterns: repeated, or comma-separated in one."""
    if not values:
        return None
    return [pattern.strip() for value in values for pattern in value.split(",") if pattern.strip()]


def options_table(command: Callable[..., None]) -> str:
    """docs/command-line.md's table of a command's flags, in the order `--help` lists them."""
    rows = [f"| {_names(flag)} | {flag.doc} |" for flag in typing.cast(dict[str, Flag], getattr(command, "flags")).values()]
    return "| option | meaning |\n|---|---|\n" + "\n".join(rows) + "\n"


def _names(flag: Flag) -> str:
    """A flag's names as the docs write them: "`--world-size N`", "`--offload` / `--no-offload`", "`--verbose`, `-v`"."""
    first = " / ".join(f"`{name}{' ' + flag.metavar if flag.metavar else ''}`" for name in flag.names[0].split("/"))
    return ", ".join([first, *(f"`{name}`" for name in flag.names[1:])])


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
