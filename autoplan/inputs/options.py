"""Every option of `autoplan.plan`, written once: `PlanOptions`, the schema the rest is made from.

Each field is an option with its default and its documentation; a field the command line takes also
names its flag (`Flag`). From this one table come: the keywords of `plan`, `optimize` and `Planner`
(`PlanKeywords` types them for an editor, `with_options` shows them to `help()` and checks their
names), the flags of `autoplan plan` and `autoplan verify` (`cli.flags`), the record of the arguments
that shaped a plan (`PlanOptions.arguments`, `plan.request.arguments`), and the option tables of
docs/api.md and docs/command-line.md (`api_table`; tests/test_docs.py holds the docs to them). What
the options are checked into is `inputs.settings`.

No torch at import: the command line reads this before torch is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypedDict, TypeVar

from autoplan.axes.precision import settings as precision_settings
from autoplan.errors import OptionTypeError
from autoplan.inputs.loop import TrainingLoop, changed_fields
from autoplan.inputs.option_docs import (BUDGET_CLI_DOC, BUDGET_DOC, COMPILE_CLI_DOC, DEVICE_DOC, FUSE_LOSS_DOC, MOE_DOC, OFFLOAD_DOC,
                                          UNITS_DOC)

if TYPE_CHECKING:  # annotations only
    import torch

    from autoplan.inputs.devices import Device

DEFAULT_MENU_SIZE = 6  # menu points per unit and precision (keep and full not counted); 0: the three modes only
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adamw8bit", "adam8bit", "paged-adamw", "paged-adamw8bit",
              "paged-adamw32bit", "lion8bit")  # by name (training.step_parts counts each); 8-bit and paged: bitsandbytes'


@dataclass(frozen=True)
class Flag:
    """How the command line takes an option: `cli.flags` makes the typer option of it."""

    names: tuple[str, ...]  # "--time-limit"; a switch with its negation as "--fuse-loss/--loss-as-written"
    help: str  # `autoplan plan --help`
    doc: str  # docs/command-line.md
    kind: Any = str  # the value's type on the command line: str, int, float, bool, or a tuple of the names it takes
    verify: bool = True  # `autoplan verify` takes it too
    verify_help: str = ""  # where verify says it otherwise
    metavar: str = ""  # what the docs show after the flag ("N", "SIZE")
    unset: bool = False  # on the command line its default is None, "not given", not the option's
    minimum: int | None = None  # the least number it takes on the command line


BUDGET_FLAG = Flag(("--budget", "-b"), 'Memory for the training step: "24GB", "24 GiB", "80%" of the device.', BUDGET_CLI_DOC,
                   verify_help='Memory for the training step: "24GB", "80%" of the device.')  # required: no default


def _option(default: Any, doc: str, flag: Flag | None = None, recorded: bool = True) -> Any:
    return field(default=default, metadata={"doc": doc, "flag": flag, "recorded": recorded})


@dataclass(frozen=True)
class PlanOptions:
    """Every option of `autoplan.plan` but the budget, as given."""

    example_inputs: Any = _option(None, "one batch: a tuple of positional args, a dict of kwargs, or `(args, kwargs)`. Required, except "
                                  "for Hugging Face models ([hugging-face.md](hugging-face.md)).", recorded=False)
    batch_size: int | None = _option(None, "Hugging Face models only, instead of `example_inputs`: the batch size of the batch autoplan "
                                     "builds from the config.", Flag(
        ("--batch-size",), "Batch size, passed to the factory (hf: default 1).", "passed to the factory (an error if it does not "
        "take it); `hf:` default 1", int, metavar="N", minimum=1))
    seq_len: int | None = _option(None, "Hugging Face models only, instead of `example_inputs`: the sequence length of that batch.", Flag(
        ("--seq-len",), "Sequence length, passed to the factory (hf: default 1024, capped at the model's maximum).",
        "passed to the factory (an error if it does not take it); `hf:` default 1024 (capped at the model's maximum)", int,
        metavar="N", minimum=1))
    device: str | Device | torch.device | None = _option(None, DEVICE_DOC, Flag(
        ("--device", "-d"), "Device profile to plan for (see `autoplan devices`). Default: this machine's GPU, else the cpu profile.",
        "device profile (`autoplan devices`); default this machine's GPU, else the `cpu` profile. A card of your own: "
        "`custom:memory=48GiB,fp32_tflops=91.6,bf16_tflops=362,bandwidth=864GB/s,capability=8.9` (required: `memory`, `fp32_tflops`, "
        "`bandwidth`; optional: `bf16_tflops` (none: an fp16 card), `fp16_tflops`, `tf32_tflops`, `float8_tflops` (none: no float8), "
        "`capability` (default 8.0 with bf16, "
        "else 7.0), `host_bandwidth` (the host link per direction, which prices offload; default 32GB/s), `interconnect` (the link "
        "to its peers per direction, which prices tensor parallelism's collectives; default the host link), `network` (between "
        "nodes, per GPU per direction: a tensor-parallel degree above 8; default 12.5GB/s), `name`, `description`), "
        "or a `.json` file holding the same keys", verify=False))
    optimizer: str | torch.optim.Optimizer = _option("adamw", "`\"adamw\"` (default), `\"adam\"`, `\"sgd\"`, `\"sgd-momentum\"`, or an "
                                                     "optimizer instance (its class and defaults are used); bitsandbytes' by name "
                                                     "([optimizers.md](optimizers.md)). On CUDA targets the optimizer is simulated with "
                                                     "torch's default foreach implementation, whose temporaries are counted.", Flag(
        ("--optimizer",), "Optimizer whose state is counted; the 8-bit and paged ones are bitsandbytes' (pip install -e \".[qlora]\").",
        "`adamw` (default), `adam`, `sgd`, `sgd-momentum`: whose state is counted; bitsandbytes' `adamw8bit`, `adam8bit`, "
        "`paged-adamw`, `paged-adamw8bit`, `paged-adamw32bit`, `lion8bit`", OPTIMIZERS,
        verify_help="Optimizer to count and to train with; the 8-bit and paged ones are bitsandbytes' (pip install -e \".[qlora]\")."))
    precision: str = _option("auto", "`\"auto\"`: per unit, fp32 or the device's low precision (bf16; fp16 on T4/V100, and "
                             "`plan.target.needs_grad_scaler` tells you to use `torch.amp.GradScaler`). `\"fp32\"`, `\"bf16\"`, `\"fp16\"` "
                             "force every unit and run the rest of the model under autocast too (`autoplan/axes/precision.py`). "
                             "`\"auto-float8\"`: per unit, fp32, bf16 or float8 (torchao's float8 linears in a bf16 unit; CPU and "
                             "cards with float8: H100, H200, L40S, RTX 4090, L4); `\"float8\"`, `\"float8-rowwise\"` force every "
                             "unit's linears to float8 (one scale a tensor or a row), the rest as written ([float8.md](float8.md)).", Flag(
        ("--precision",), "auto: per unit fp32 or the device's bf16/fp16; auto-float8: float8 too; or force one for every unit.",
        "`auto` (per unit, fp32 or the device's bf16/fp16), `auto-float8` (the same, or torchao's float8 linears), `fp32`, `bf16`, "
        "`fp16`, `float8`, `float8-rowwise` (every unit's linears float8, one scale a tensor or a row)", precision_settings()))
    units: list[str] | None = _option(None, UNITS_DOC, Flag(
        ("--units",), 'Name patterns of the blocks to plan, e.g. "layers.*" (repeat or comma-separate). Default: the blocks the model '
        "repeats.", "name patterns of the blocks to plan, repeated or comma-separated (`--units \"layers.*\"`); a pattern that names a "
        "`ModuleList` or `ModuleDict` plans the blocks it holds", list))
    keep_fp32: list[str] | None = _option(None, "pins: unit patterns that stay fp32.")
    checkpoint: list[str] | Mapping[str, str] | None = _option(None, "pins: unit patterns that must be checkpointed (`full`), or "
                                                               "`{pattern: mode}`: `\"keep\"`, `\"selective\"`, `\"full\"`, or a named "
                                                               "policy people run, to price that setup against the plan: "
                                                               "`\"torchtitan-op\"` (torchtitan's op-level selective checkpointing: "
                                                               "every other matmul and the attention kernels kept; docs/api.md).")
    reserve: str | int | None = _option(None, "bytes held back from the budget. Default: the CUDA context (`cuda_context`) + 5% of the "
                                        "rest for allocator fragmentation. On one GPU the plan also "
                                        "predicts the caching allocator's reserved memory and the least limit it runs the step in "
                                        "(`plan.prediction.least_limit_bytes`); that must fit the budget less the reserve's context part "
                                        "([how](how-it-works.md#reserved-memory-the-caching-allocator-replayed)). `reserve=0` plans the peak "
                                        "right up to the budget, the allocator's included; a reserve as large as the budget is a `ValueError`.", Flag(
        ("--reserve",), 'Bytes held back from the budget, e.g. "1GB" or 0. Default: CUDA context + 5% fragmentation.',
        "bytes held back from the budget (`1GB`, `0`); default CUDA context + 5%", metavar="SIZE"))
    cuda_context: str | int | None = _option(None, "the CUDA context of your setup: device memory held outside PyTorch's caching "
                                             "allocator (nvidia-smi's used memory less `torch.cuda.memory_reserved()` once a step ran). "
                                             "Default: the figure measured on the card's architecture (Hopper: 764 MiB, lazy loading), else a "
                                             "512 MiB estimate; the report says which (`autoplan.inputs.cuda_context`).", Flag(
        ("--cuda-context",), 'The CUDA context of your setup, e.g. "1.3GB" (nvidia-smi used less torch\'s reserved): replaces the '
        "card's measured or estimated one.", "the CUDA context of your setup (`1.3GB`): replaces the card's measured or estimated one",
        metavar="SIZE"))
    loss_fn: Callable[[Any], torch.Tensor] | None = _option(None, "`output -> scalar` for profiling. Default: the output's `.loss` (or "
                                                            "`[\"loss\"]`) when not None, else the sum of its floating-point outputs.")
    time_limit_s: float = _option(10.0, "seconds the ILP solver may take per solve (default 10; must be positive). Out of time, the plan is "
                                  "still one that fits, with a note that a faster one may exist; out of time before it can tell whether "
                                  "anything fits, `autoplan.errors.SolverTimeoutError`. Never reported as \"does not fit\".", Flag(
        ("--time-limit",), "Seconds the solver may take per solve.", "seconds the ILP solver may take per solve (default 10); out of "
        "time, the plan still fits and a note says a faster one may exist", float, verify=False, metavar="S"), recorded=False)
    profile: str = _option("auto", "where unit times come from: `\"roofline\"` (FLOPs and bytes over the device's datasheet rates), "
                           "`\"measure\"` (real runs where the model is: CUDA events, or the CPU clock; see "
                           "[below](#verify-a-plan-on-real-hardware)), `\"auto\"` (default: measure when the model is on the CUDA device "
                           "planned for, else roofline).")
    progress: Callable[[str], None] | None = _option(None, "called with a short message as each stage starts.", recorded=False)
    on_profile: Callable[[Any], None] | None = _option(None, "called with the `Profile` of the level the plan chose, once per plan (a "
                                                       "Planner calls it at every `plan()`; `autoplan.report.advice` needs it; the CLI uses "
                                                       "this); not for a plan decided by counting (`count_first`), which has none.", recorded=False)
    world_size: int | str = _option(1, "GPUs to shard over with FSDP2 (parameters, gradients and optimizer state 1/N each; the plan's "
                                    "`request.mesh`, `autoplan/mesh.py`): every constraint and every byte of the plan is then per rank. "
                                    "`\"auto\"`: the fewest GPUs whose lowest per-rank peak fits, with the curve in "
                                    "`plan.prediction.world_size_curve`. 1 (default): one GPU, no FSDP. [parallel.md](parallel.md)", Flag(
        ("--world-size",), "Plan per GPU for FSDP sharding over N GPUs (parameters, gradients, optimizer state 1/N each), or auto: "
        "the fewest GPUs that fit, with the per-GPU peak against N.", "plan per GPU for FSDP over N GPUs (at most 65,536), or `auto`: "
        "the fewest that fit, with the curve (see [parallel.md](parallel.md)); on the `cpu` profile the report says ranks, not GPUs",
        verify=False, metavar="N", unset=True))
    reshard_after_forward: bool | Mapping[str, bool] = _option(
        True, "with `world_size` ≠ 1, FSDP2's `fully_shard(reshard_after_forward=...)` for the units: True (default) frees a unit's "
        "gathered parameters after its forward and gathers them again for its backward; False keeps them from forward to backward "
        "(no gather in backward: less traffic, more memory), and the plan counts them so; `{unit pattern: bool}` per unit, the first "
        "pattern a unit matches deciding, the rest True (torchtitan's default keeps its last block: `{\"layers.31\": False}`). A "
        "module called more than once per forward is planned with True only. [parallel.md](parallel.md)", Flag(
        ("--reshard-after-forward/--no-reshard-after-forward",), "With --world-size: FSDP frees each unit's gathered parameters after "
        "forward (default), or keeps them until its backward (more memory, no gather in backward).", "with `--world-size`: FSDP frees "
        "each unit's gathered parameters after its forward (default) or keeps them until its backward, and the plan counts that",
        bool, verify=False))
    fsdp_mixed_precision: str | None = _option(None, "with `world_size` = N > 1 (or `\"auto\"`, searched from 2 ranks), FSDP2's `MixedPrecisionPolicy(param_dtype=..., "
                                               "reduce_dtype=torch.float32)`, as torchtitan runs it: `\"bf16\"` or `\"fp16\"`. Every unit "
                                               "then computes with its parameters gathered in that dtype (activations in it too), while "
                                               "shards, gradients' reduce and the optimizer state stay fp32; the per-unit precision is "
                                               "then no autocast. The model's floating parameters must be fp32. None (default): "
                                               "parameters gathered as stored, precision per unit by autocast. [parallel.md](parallel.md)", Flag(
        ("--fsdp-mixed-precision",), "With --world-size N (or auto, from 2): FSDP2's MixedPrecisionPolicy, parameters gathered and computed in bf16 "
        "or fp16, reduced and kept in fp32.", "with `--world-size N` (or `auto`, searched from 2): FSDP2's MixedPrecisionPolicy, parameters gathered and "
        "computed in `bf16` or `fp16`, reduced and kept in fp32", ("bf16", "fp16"), verify=False, metavar="DTYPE"))
    tensor_parallel: int | str | None = _option(None, "ranks each planned linear is split over by tensor parallelism (torch's "
                                                "`parallelize_module`, `ColwiseParallel`/`RowwiseParallel`, as torchtitan applies it): the "
                                                "plan is then for one rank's slice of the model, every byte per rank. `world_size` counts "
                                                "every GPU (FSDP's ranks × these); left at 1, it is this. `\"auto\"` (with "
                                                "`world_size=\"auto\"`): FSDP alone, 2, 4 and 8 searched, the fewest GPUs in all chosen. "
                                                "1: none. None (default): `\"auto\"` under `world_size=\"auto\"` where the model has "
                                                "linears to split (its own `tp_plan`, or torchtitan's Llama names), else 1. "
                                                "[parallel.md](parallel.md)", Flag(
        ("--tensor-parallel",), "Split the attention and MLP linears over N ranks (tensor parallelism); --world-size auto searches "
        "the degree unless given (1: FSDP alone); --world-size counts every GPU.", "split the attention and MLP linears over N ranks "
        "(tensor parallelism, per [parallel.md](parallel.md)), or `auto` (the degree on the fewest GPUs, what `--world-size auto` "
        "does when this is left out; `1` there searches FSDP alone); `--world-size` counts every GPU, FSDP's ranks times these", str,
        verify=False, metavar="N", unset=True))
    tensor_parallel_plan: Mapping[str, str] | None = _option(None, "with `tensor_parallel` > 1, which linears are split: `{module name "
                                                             "pattern: \"colwise\" | \"rowwise\" | \"colwise_gather_output\"}` (the "
                                                             "last for an output head: split by the vocabulary, its logits gathered "
                                                             "whole). None (default): the model's own (transformers' `model.tp_plan`), "
                                                             "else torchtitan's Llama names (its head `output` split and gathered).")
    sequence_parallel: bool = _option(False, "with tensor parallelism (`tensor_parallel` > 1, or searched), keep the residual stream "
                                      "between the split linears as one Nth of the sequence on each rank, as torchtitan does "
                                      "(torch's `SequenceParallel` on the norms, the attention's and MLP's input all-gathered, the "
                                      "row-wise output reduce-scattered): a rank holds 1/N of the norms' and the residual's activations. "
                                      "For torchtitan's Llama names and transformers' Llama family; the sequence must divide by N. "
                                      "False (default): tensor parallelism alone. [parallel.md](parallel.md)", Flag(
        ("--sequence-parallel",), "With tensor parallelism: the norms and the residual stream hold 1/N of the sequence on each rank "
        "(torchtitan's sequence parallelism).", "with tensor parallelism: the norms and the residual stream hold one Nth of the sequence "
        "on each rank (torchtitan's sequence parallelism, per [parallel.md](parallel.md))", bool, verify=False))
    menu_size: int = _option(DEFAULT_MENU_SIZE, "per unit and precision, up to this many selective policies of its own (which op outputs "
                             "to save, `autoplan.profile.menu`) on top of keep/selective/full; 0: the three only.", recorded=False)
    loop: TrainingLoop | None = _option(None, "the training loop the peak is for, `autoplan.TrainingLoop(...)`: outputs kept or dropped, "
                                        "accumulation steps, `zero_grad(set_to_none)` and where it runs (Lightning: before backward), "
                                        "optimizer implementation, GradScaler, micro-batches fetched ahead, what the loop keeps on the "
                                        "device (`TrainingLoop().keeping(vae, ema)`), the loop's own autocast "
                                        "([loops.md](loops.md); `autoplan.frameworks` reads accelerate's and Lightning's). Default: "
                                        "outputs kept through backward, one micro-batch, `set_to_none=True`, torch's default "
                                        "implementation (on the command line: `--drop-outputs`, `--accumulation-steps`, "
                                        "`--optimizer-impl`, `--zero-grad-before-backward`, `--fetches-whole-step`, `--batches-ahead`, "
                                        "`--kept-on-device`, `--outer-autocast`).")
    allow_over_device: bool = _option(False, "plan for a budget above the device's memory (default False: a `ValueError`).", Flag(
        ("--allow-over-device",), "Plan for a budget above the device's memory (an error otherwise); the report says it fits the "
        "budget, not the device.", "plan for a budget above the device's memory (exit 2 otherwise); the report notes it fits the "
        "budget, not the device", bool, verify=False))
    segments: bool = _option(True, "True (default): runs of consecutive blocks may be checkpointed as one region (a segment, as in √n "
                             "checkpointing; `memory.segment_terms`) besides each block on its own; False: each block on its own. "
                             "Blocks pinned to a mode (`checkpoint`) are never in one.")
    moe_capacity: float | None = _option(None, MOE_DOC, Flag(
        ("--moe-capacity",), "Mixture-of-experts layers whose routing decides shapes: profile each expert with CAPACITY × tokens × "
        "top_k / experts tokens (1.0: balanced routing). Default: the worst case, every expert gets every token.",
        "mixture-of-experts layers written as a per-expert loop: profile C × tokens × top_k / experts tokens per expert (default: the "
        "worst case, every expert gets every token); not a positive number: exit 2", float, verify=False, metavar="C"))
    fuse_loss: bool = _option(True, FUSE_LOSS_DOC, Flag(
        ("--fuse-loss/--loss-as-written",), "Fuse the cross-entropy of the output head's logits with that Linear (gradients in "
        "chunks, during the forward; no FLOP added), or keep the loss as the model writes it.", "fuse the cross-entropy of the output "
        "head's logits with that Linear (default; `plan.decisions.fused_loss`, the report's `loss:` line), or keep the loss as the "
        "model writes it", bool))
    offload: bool | None = _option(None, OFFLOAD_DOC, Flag(
        ("--offload/--no-offload",), "Let units keep what they save in pinned host memory, copied over the host link (default: on "
        "for a GPU target, off for the CPU).", "let units keep what they save in pinned host memory (default: on for a GPU target, off "
        "for the CPU; `--offload` on the CPU is exit 2) or keep everything on the device ([offload.md](offload.md))", bool))
    host_budget: str | int | None = _option(None, "the pinned host memory offloaded units may hold at once: `\"64GB\"`, "
                                            "`\"40%\"` of this machine's RAM, an int of bytes; default half of this "
                                            "machine's RAM. `plan.prediction.host_peak_bytes` is what the plan holds there, "
                                            "`plan.prediction.simulated_host_peak_bytes` the whole-step simulation's.", Flag(
        ("--host-budget",), 'Pinned host memory offloading may use, e.g. "64GB" or "40%" of this machine\'s RAM. Default: half of it.',
        "pinned host memory offloading may use, e.g. `64GB` or `40%` of this machine's RAM (default: half of it)", metavar="SIZE"))
    compile: bool = _option(False, "plan the model you will run under `torch.compile`: recomputing ops without FLOPs is priced as free "
                            "(Inductor fuses them), so units save matmul/attention outputs and recompute the rest. Memory is still the "
                            "eager model's, an upper bound for the compiled one. Compile after `apply`/`optimize`. Segments and the "
                            "fused loss head are off with it.", Flag(
        ("--compile",), "Plan for the model you will run under torch.compile: recomputing ops without FLOPs (elementwise, norms) is "
        "priced as free, as Inductor fuses them, so units save matmul/attention outputs and recompute the rest. Peaks stay the eager "
        "model's; the loss is kept as written. Compile after applying the plan.", COMPILE_CLI_DOC, bool,
        verify_help="Plan as `autoplan plan --compile` does; the real steps run eagerly (the plan's peaks are the eager model's), so "
        "the measured time is not the compiled model's."))
    count_first: bool = _option(True, "True (default): where the parameters, gradients and optimizer state alone are over the usable "
                                "budget on one device, the answer (does not fit) comes from counting them, in seconds, with no step "
                                "simulated (`plan.outcome.decided_by == \"state count\"`; its peak is the states, a lower bound). False: "
                                "simulate the step anyway, for the whole report (the budget it needs, activations, FSDP's estimate "
                                "with them), minutes for a 70B model.", Flag(
        ("--count-first/--simulate-anyway",), "Where the states alone are over the budget, answer from their count (seconds), or "
        "simulate the step anyway for the whole report (minutes at 70B).", "where parameters, gradients and optimizer state alone are "
        "over the budget, answer from counting them in seconds (default), or simulate the step anyway for the whole report", bool))

    @staticmethod
    def given(options: Mapping[str, Any], called: str) -> PlanOptions:
        """The options a caller passed to `called`; a misspelled one is named as written, with the closest real one
        (Python's own error would name a function the caller never called)."""
        known = [option.name for option in dataclasses.fields(PlanOptions)]
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; the options are {', '.join(known)}"
                raise OptionTypeError(f"{called}() got an unexpected keyword argument {name!r}{hint} (docs/api.md)")
        return PlanOptions(**options)

    def arguments(self, profile_name: str | None) -> tuple[tuple[str, Any], ...]:
        """The options that shape the plan, as given: those not at their default (the budget, given apart, goes first).

        A value that is not a literal (a loss function, an optimizer or Device object) is recorded as None: the
        code that reproduces the plan passes the caller's own. An omitted device is recorded by its profile
        name when it has one (`profile_name`), so the code says what the plan was made for.
        """
        request: list[tuple[str, Any]] = []
        for option in dataclasses.fields(self):
            value = getattr(self, option.name)
            if not option.metadata["recorded"]:
                continue
            if option.name == "device" and value is None and profile_name is not None:
                value = profile_name
            if isinstance(value, TrainingLoop) and not changed_fields(value):
                continue  # the common loop, however it was given
            if value is not option.default and value != option.default:
                request.append((option.name, _literal(value)))
        return tuple(request)


def _literal(value: Any) -> Any:
    """`value` as a JSON and Python literal, or None when it is an object only the caller has."""
    given = getattr(value, "given", value)  # a size read already (`vocabulary.sizes.Size`): as it was written
    if isinstance(given, bool) or given is None or isinstance(given, (str, float)):
        return given
    if isinstance(given, TrainingLoop):
        return changed_fields(given)  # check_loop takes these back
    if isinstance(given, numbers.Integral):
        return int(given)
    if isinstance(given, (list, tuple)) and all(isinstance(item, str) for item in given):
        return list(given)
    if isinstance(given, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in given.items()):
        return dict(given)
    return None


class PlanKeywords(TypedDict, total=False):
    """`PlanOptions` as keywords, for an editor: `**options: Unpack[PlanKeywords]` (tests/inputs/test_options.py
    holds the two alike)."""

    example_inputs: Any
    batch_size: int | None
    seq_len: int | None
    device: str | Device | torch.device | None
    optimizer: str | torch.optim.Optimizer
    precision: str
    units: list[str] | None
    keep_fp32: list[str] | None
    checkpoint: list[str] | Mapping[str, str] | None
    reserve: str | int | None
    cuda_context: str | int | None
    loss_fn: Callable[[Any], torch.Tensor] | None
    time_limit_s: float
    profile: str
    progress: Callable[[str], None] | None
    on_profile: Callable[[Any], None] | None
    world_size: int | str
    reshard_after_forward: bool | Mapping[str, bool]
    fsdp_mixed_precision: str | None
    tensor_parallel: int | str | None
    tensor_parallel_plan: Mapping[str, str] | None
    sequence_parallel: bool
    menu_size: int
    loop: TrainingLoop | None
    allow_over_device: bool
    segments: bool
    moe_capacity: float | None
    fuse_loss: bool
    offload: bool | None
    host_budget: str | int | None
    compile: bool
    count_first: bool


F = TypeVar("F", bound=Callable[..., Any])


def with_options(function: F) -> F:
    """`function`, whose `**options` are PlanOptions' fields: its signature names each with its default (what
    `help()` and an editor's hover show) and its docstring ends with what each means."""
    signature = inspect.signature(function)
    own = [parameter for parameter in signature.parameters.values() if parameter.kind is not parameter.VAR_KEYWORD]
    keywords = [inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=option.default, annotation=option.type)
                for option in dataclasses.fields(PlanOptions)]
    setattr(function, "__signature__", signature.replace(parameters=own + keywords))
    function.__doc__ = f"{inspect.cleandoc(function.__doc__ or '')}\n\nOptions (docs/api.md):\n\n{options_text()}"
    return function


def options_text(width: int = 100) -> str:
    """Every option and what it means, as plain text (the end of `help(autoplan.plan)`)."""
    import textwrap

    return "\n".join(textwrap.fill(f"{option.name}={option.default!r}: {option.metadata['doc']}", width, subsequent_indent="    ")
                     for option in dataclasses.fields(PlanOptions))


def api_table() -> str:
    """docs/api.md's table of plan()'s arguments: the budget, then every option."""
    rows = [("budget", BUDGET_DOC)] + [(option.name, option.metadata["doc"]) for option in dataclasses.fields(PlanOptions)]
    return "| argument | meaning |\n|---|---|\n" + "".join(f"| `{name}` | {doc} |\n" for name, doc in rows)


def flagged() -> list[tuple[str, Flag]]:
    """The options the command line takes, by field name, in the schema's order (`cli.flags`)."""
    return [(option.name, option.metadata["flag"]) for option in dataclasses.fields(PlanOptions) if option.metadata["flag"]]
