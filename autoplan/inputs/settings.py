"""plan()'s options (`inputs.options.PlanOptions`) checked into the values the stages take: `settle`.

- `StepOptions`: the training step the peak is for: the optimizer whose state is counted, the
  loss, the loop, and how data-dependent expert routing is profiled;
- `SearchSpace`: which choices the solver may make: precisions, pins, each unit's menu of
  selective policies, segments, compile pricing, the fused loss head, and offload (`HostMemory`:
  the host link and how much pinned host memory it may use, or None);
- `Settings`: those two, the device, and how the search runs (GPUs, where times come from, the
  solver's time limit, the reserve read once).

Settled once when a Planner is made, every option checked there with an `OptionError` that names
the option and what it takes, and passed down whole instead of a list of keywords; what the solve
stage needs for one budget is its `SolveRequest`. No torch at import: the command line checks some
options here before it loads torch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

from autoplan.axes.precision import check_setting, dtype_of
from autoplan.errors import OptionError
from autoplan.inputs.budget import context_bytes, read_reserve
from autoplan.inputs.devices import Device, get_device
from autoplan.inputs.loop import TrainingLoop, check_loop
from autoplan.inputs.options import PlanOptions
from autoplan.mesh import MAX_RANKS
from autoplan.vocabulary.sizes import Size, parse_size

if TYPE_CHECKING:  # annotations only: the command line checks its options here before torch is imported
    import torch

    from autoplan.axes.placement import HostMemory

    from autoplan.instruments.routing import MoeRoutingBound

PROFILE_SOURCES = ("auto", "measure", "roofline")


@dataclass(frozen=True)
class StepOptions:
    """The training step the peak is for."""

    optimizer: str | torch.optim.Optimizer
    loss_fn: Callable[[Any], torch.Tensor] | None
    loop: TrainingLoop
    routing: MoeRoutingBound  # how experts whose routing decides shapes are profiled
    fsdp_mixed_precision: str | None = None  # FSDP2's MixedPrecisionPolicy param dtype ("bf16", "fp16"); fp32 reduce

    @property
    def parameter_dtype(self) -> torch.dtype | None:
        """What the units compute with under FSDP2's MixedPrecisionPolicy (None: the parameters as they are)."""
        return dtype_of(self.fsdp_mixed_precision) if self.fsdp_mixed_precision else None


@dataclass(frozen=True)
class SearchSpace:
    """Which choices the solver may make."""

    precision: str  # "auto" (per unit) or one for every unit
    keep_fp32: list[str] | None  # unit patterns pinned to fp32
    checkpoint: list[str] | Mapping[str, str] | None  # unit patterns pinned to a checkpoint mode
    menu_size: int  # selective policies of each unit's own, per precision
    segments: bool  # runs of consecutive blocks as one region; off with compile
    compile: bool  # recomputing FLOP-free ops priced as free (Inductor fuses them)
    fuse_loss: bool  # the output head's cross-entropy fused; off with compile and with FSDP
    host: HostMemory | None = None  # offload: keep/full units may hold what they save in this pinned host memory


def flag(name: str, value: Any) -> bool:
    """A yes/no option, which must be a bool: `fuse_loss="no"` would otherwise read as True."""
    if not isinstance(value, bool):
        raise OptionError(f"{name} takes True or False; got {value!r}")
    return value


def check_time_limit(time_limit_s: float) -> float:
    if not (isinstance(time_limit_s, numbers.Real) and not isinstance(time_limit_s, bool) and 0 < time_limit_s < math.inf):
        raise OptionError(f"time_limit_s (--time-limit on the command line) must be a positive number of seconds; got {time_limit_s!r}")
    return float(time_limit_s)


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        listed = ", ".join(repr(a) for a in allowed[:-1]) + f" or {allowed[-1]!r}"
        raise OptionError(f"{name} must be {listed}; got {value!r}")
    return value


def check_menu_size(menu_size: Any) -> int:
    if isinstance(menu_size, bool) or not isinstance(menu_size, numbers.Integral) or menu_size < 0:
        raise OptionError(f"menu_size takes a whole number ≥ 0 (0: keep/selective/full only); got {menu_size!r}")
    return int(menu_size)


@dataclass(frozen=True)
class Settings:
    """plan()'s options, checked, in the holders the stages take."""

    device: Device
    step: StepOptions
    space: SearchSpace
    ranks: int | Literal["auto"]  # FSDP2's ranks (every GPU over tensor_parallel), or "auto": the fewest that fit
    reshard_after_forward: bool | tuple[tuple[str, bool], ...]  # FSDP2 frees units' gathered parameters after forward (Mesh's)
    profile: str  # where unit times come from: "auto", "measure" or "roofline"
    time_limit_s: float  # per solve
    reserve: Size | None  # as given, read once (None: the default reserve); taken in bytes with each budget
    allow_over_device: bool
    tensor_parallel: int | Literal["auto"] = 1  # ranks each linear of `tp_layout_given` (or the model's own) is split over;
    # "auto": searched with world_size="auto" (`inputs.tensor_parallel.degrees_to_plan`)
    tp_layout_given: tuple[tuple[str, str], ...] | None = None  # tensor_parallel_plan's (pattern, style) pairs
    sequence_parallel: bool = False  # with a degree > 1: the residual stream split along the sequence (inputs.sequence_parallel)

    @property
    def fsdp_policy(self) -> tuple[bool | tuple[tuple[str, bool], ...], str | None]:
        """How FSDP2 runs the units, as `Mesh.fsdp` takes it after the ranks: reshard_after_forward, the mixed precision."""
        return self.reshard_after_forward, self.step.fsdp_mixed_precision


def settle(options: PlanOptions) -> Settings:
    """Every option checked, before minutes of tracing and profiling; the budget is checked by each plan()."""
    from autoplan.instruments.routing import check_moe_capacity  # torch: not for the command line's early checks

    check_optimizer(options.optimizer)
    ranks = fsdp_ranks(options)
    mixed = check_fsdp_mixed_precision(options.fsdp_mixed_precision, ranks, options.precision)
    step = StepOptions(options.optimizer, options.loss_fn, check_loop(options.loop), check_moe_capacity(options.moe_capacity), mixed)
    device = with_context(get_device(options.device), options.cuda_context)
    space = search_space(options, device)
    if mixed:  # every unit computes in the policy's dtype already: autocast on top is not what FSDP runs
        space = dataclasses.replace(space, precision="fp32")
    return Settings(device, step, space, ranks, check_reshard(options.reshard_after_forward, ranks), check_choice("profile", options.profile, PROFILE_SOURCES),
                    check_time_limit(options.time_limit_s), read_reserve(options.reserve),
                    flag("allow_over_device", options.allow_over_device), requested_degree(options),
                    check_layout_given(options.tensor_parallel_plan), check_sequence_parallel(options))


def check_sequence_parallel(options: PlanOptions) -> bool:
    """sequence_parallel as given: True or False, and True only with tensor parallelism to split the sequence over."""
    wanted = flag("sequence_parallel", options.sequence_parallel)
    if wanted and requested_degree(options) == 1:
        raise OptionError("sequence_parallel splits the sequence over tensor parallelism's ranks: give tensor_parallel=N (N > 1), "
                          "or world_size=\"auto\" with tensor_parallel left out or \"auto\"")
    return wanted


def fsdp_ranks(options: PlanOptions) -> int | Literal["auto"]:
    """FSDP's ranks: every GPU (`world_size`) over the tensor-parallel ranks; world_size left at 1 is the TP ranks alone."""
    degree = requested_degree(options)
    if options.tensor_parallel_plan is not None and degree == 1:
        raise OptionError("tensor_parallel_plan says which linears tensor parallelism splits: give tensor_parallel=N (N > 1) "
                          "or \"auto\" too")
    if degree == "auto" and options.world_size != "auto":
        raise OptionError("tensor_parallel=\"auto\" searches the degree beside FSDP's ranks: give world_size=\"auto\" too, or "
                          "tensor_parallel=N for a world_size of your own")
    if options.world_size == "auto":
        return "auto"
    tensor_parallel = degree if isinstance(degree, int) else 1
    world_size = check_world_size(options.world_size)
    if world_size % tensor_parallel and world_size != 1:
        raise OptionError(f"world_size={world_size} counts every GPU: FSDP's ranks times tensor_parallel={tensor_parallel}, "
                          f"so it must be a multiple of {tensor_parallel}; give world_size={tensor_parallel * max(1, world_size // tensor_parallel)} "
                          f"(or leave it at 1 for tensor parallelism alone)")
    return max(1, world_size // tensor_parallel)


def with_context(device: Device, given: object) -> Device:
    """`device` with the CUDA context the person gave (`cuda_context`), or as its profile has it (None)."""
    if given is None:
        return device
    if device.kind != "cuda":
        raise OptionError(f"cuda_context (--cuda-context) is the CUDA context of a GPU; the plan is for {device.name}, which has "
                          "none: leave it out, or plan for a GPU (device=...)")
    return dataclasses.replace(device, context_bytes=context_bytes(given, device), context_source=f"given: cuda_context={given!r}")


def check_optimizer(optimizer: Any) -> None:
    """An optimizer whose state plan() can count: a name it knows, or a torch.optim.Optimizer."""
    from autoplan.training.step_parts import optimizer_name  # torch

    try:
        optimizer_name(optimizer)
    except ValueError as error:
        raise OptionError(f"optimizer (--optimizer on the command line): {error}") from None


def loop_precision(options: PlanOptions) -> str:
    """The precision setting: the loop's own autocast decides it where the loop has one (every unit runs in it)."""
    outer = check_loop(options.loop).outer_autocast
    if outer is None or options.precision in ("auto", outer):
        return outer or options.precision
    raise OptionError(f"precision={options.precision!r} and a loop under its own autocast ({outer}): every unit runs in "
                      f"{outer} there; pass precision={outer!r} or 'auto', or plan the loop without its autocast")


def search_space(options: PlanOptions, device: Device) -> SearchSpace:
    """The checked search space; segments, the fused head and offload off where they cannot apply."""
    compile = flag("compile", options.compile)
    return SearchSpace(
        precision=check_setting(loop_precision(options), device),  # a precision this device runs
        keep_fp32=options.keep_fp32,
        checkpoint=options.checkpoint,
        menu_size=check_menu_size(options.menu_size),
        segments=flag("segments", options.segments) and not compile,  # a segment's region runs eagerly between compiled graphs
        compile=compile,
        fuse_loss=flag("fuse_loss", options.fuse_loss) and not compile and fsdp_ranks(options) == 1,
        host=_host_memory(options.offload, host_budget_bytes(options.host_budget), device,
                          sharded=options.world_size != 1 or requested_degree(options) != 1),
    )


def _host_memory(offload: bool | None, budget_bytes: int, device: Device, *, sharded: bool) -> HostMemory | None:
    """Offload as one value: the host link and the memory it may fill, where it is allowed (`axes.placement`)."""
    from autoplan.axes.placement import HostMemory, offload_allowed  # torch: the offload hooks live there too

    return HostMemory(budget_bytes, device.host_bandwidth) if offload_allowed(offload, device, sharded) else None


HOST_BUDGET_SHARE = 0.5  # default host budget: this share of this machine's RAM


def host_budget_bytes(host_budget: str | int | None) -> int:
    """The pinned host memory offloading may use: a size, a share of this machine's RAM ("40%"), or by
    default half of it (pinned memory cannot be swapped, and the data loader and the OS need the rest)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if host_budget is None:
        return int(ram * HOST_BUDGET_SHARE)
    return parse_size(host_budget, ram, allow_zero=True, what="host budget (--host-budget)",
                      fail=lambda reason: OptionError(f"host_budget: {reason}; e.g. '64GB' or '50%' of this machine's RAM"))


def check_fsdp_mixed_precision(value: object, ranks: int | str, precision: object) -> str | None:
    """FSDP2's MixedPrecisionPolicy as planned: parameters gathered and computed in bf16 or fp16, kept and reduced in fp32."""
    if value is None:
        return None
    if value not in ("bf16", "fp16"):
        raise OptionError(f"fsdp_mixed_precision must be \"bf16\" or \"fp16\" (MixedPrecisionPolicy's param_dtype; gradients "
                          f"reduced in fp32), or None; got {value!r}")
    if ranks == 1:  # world_size="auto" searches from 2 ranks with it (solve.worlds)
        raise OptionError("fsdp_mixed_precision is FSDP2's MixedPrecisionPolicy: give world_size=N (N > 1) or \"auto\"; "
                          "with one GPU nothing is sharded")
    if precision not in ("auto", "fp32"):
        raise OptionError(f"fsdp_mixed_precision={value!r} computes every unit in {value} already; precision={precision!r} would "
                          "add autocast on top, which is not what FSDP runs: leave precision out")
    return value


def check_reshard(reshard_after_forward: object, ranks: int | str) -> bool | tuple[tuple[str, bool], ...]:
    """FSDP2's reshard_after_forward: True, False, or {unit pattern: bool} (as a tuple of pairs: a Mesh is hashable).
    Its int form, resharding to a smaller mesh, is not modelled."""
    if isinstance(reshard_after_forward, Mapping) and reshard_after_forward and all(
            isinstance(p, str) and isinstance(v, bool) for p, v in reshard_after_forward.items()):
        pairs = tuple(reshard_after_forward.items())
        if ranks == 1 and not all(v for _, v in pairs):
            raise OptionError("reshard_after_forward={...: False} is FSDP's; with world_size=1 nothing is sharded: give world_size=N")
        return pairs
    if not isinstance(reshard_after_forward, bool):
        raise OptionError(f"reshard_after_forward must be True, False or {{unit pattern: True/False}}; got {reshard_after_forward!r} "
                          "(FSDP2's int form, resharding to fewer ranks after forward, is not modelled: plan with True for it, an upper bound)")
    if not reshard_after_forward and ranks == 1:
        raise OptionError("reshard_after_forward=False is FSDP's (the units' gathered parameters kept from forward to backward); "
                          "with world_size=1 nothing is sharded: give world_size=N (or \"auto\"), or leave it out")
    return reshard_after_forward


# the tensor-parallel styles planned (inputs.tensor_parallel); "colwise_gather_output": an output head split by its
# outputs, its logits gathered whole (transformers' name; torch's ColwiseParallel(output_layouts=Replicate()))
STYLES = ("colwise", "rowwise", "colwise_gather_output")


def requested_degree(options: PlanOptions) -> int | Literal["auto"]:
    """The tensor-parallel degree to plan: `tensor_parallel` as given, or left out (None), searched ("auto") under
    world_size="auto" and none (1) under a world size of the person's own. Under "auto" a model with no linears to split
    plans FSDP alone (`inputs.tensor_parallel.degrees_to_plan`)."""
    if options.tensor_parallel is None:
        return "auto" if options.world_size == "auto" else 1
    return check_degree(options.tensor_parallel)


def check_degree(degree: object) -> int | Literal["auto"]:
    """tensor_parallel as given: a whole number of ranks (the command line's digits too), or "auto"."""
    if degree == "auto":
        return "auto"
    if isinstance(degree, str) and degree.isdigit():
        degree = int(degree)
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise OptionError(f"tensor_parallel is a whole number of ranks each split linear is divided over, at least 1, or \"auto\" "
                          f"(with world_size=\"auto\"); got {degree!r}")
    return degree


def check_layout_given(given: object) -> tuple[tuple[str, str], ...] | None:
    """The person's `tensor_parallel_plan`: {module name pattern: "colwise" | "rowwise"}, or None."""
    if given is None:
        return None
    if not isinstance(given, Mapping) or not given:
        raise OptionError("tensor_parallel_plan takes {module name pattern: 'colwise' or 'rowwise'}, e.g. "
                          f"{{'layers.*.attention.wq': 'colwise', 'layers.*.attention.wo': 'rowwise'}}; got {given!r}")
    for pattern, style in given.items():
        if not isinstance(pattern, str) or style not in STYLES:
            raise OptionError(f"tensor_parallel_plan: {pattern!r}: {style!r} is not a style planned; use 'colwise', 'rowwise' or "
                              "'colwise_gather_output' (an output head)")
    return tuple(given.items())


def check_world_size(world_size: object, option: str = "world_size") -> int:
    """`option`: the name the person gave it by, "--world-size" on the command line (where auto is unquoted)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise OptionError(f"world_size must be a whole number of GPUs, at least 1 (or \"auto\"); got {world_size!r}")
    if world_size > MAX_RANKS:
        auto = "auto" if option.startswith("--") else '"auto"'
        raise OptionError(f"{option} {world_size:,} is more GPUs than FSDP shards over (at most {MAX_RANKS:,}): give the "
                          f"number of GPUs you will train on, or {auto} for the fewest that fit")
    return world_size
