"""Apply stage for more than one GPU: a plan's units become FSDP2 units.

`apply_fsdp(model, plan)` runs inside an initialised process group (`torchrun`): it rewrites each
unit for its checkpoint mode and precision (`planned.forwards.apply_choices`, as on one GPU), then
calls PyTorch's own `torch.distributed.fsdp.fully_shard` on each unit and on the root, so the units
the plan decided about are exactly the groups FSDP gathers and reduce-scatters.

Precision is torch.autocast per unit by default: autocast keeps norms, softmax and losses in fp32 as
the single-GPU plan does, lets each unit choose its own precision, and parameters stay fp32 in the
all-gathers. A plan made with `fsdp_mixed_precision` is applied with FSDP2's own
`MixedPrecisionPolicy(param_dtype=bf16 or fp16, reduce_dtype=fp32)` on every group, as it was profiled.
Per-rank peaks are measured by `verify.fsdp`.
"""

from __future__ import annotations

from typing import Any

import torch

from autoplan.axes.precision import dtype_of
from autoplan.errors import DistributedSetupError, OptionError
from autoplan.plan import OutsideUnits, Plan
from autoplan.memory.sharded import fsdp_group, kept_names
from autoplan.units import GraphRun, SequentialRun, Unit
from autoplan.vocabulary.names import run_layers
from autoplan.planned.forwards import apply_choices


def process_group_world_size() -> int | None:
    """The world size of the default process group, or None when there is none."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    return torch.distributed.get_world_size()


def require_process_group(world_size: int) -> None:
    """Say what to do, in one sentence, when the process group is missing or the wrong size."""
    current = process_group_world_size()
    if current is None:
        asked = "world_size='auto'" if world_size == 0 else f"world_size={world_size}"
        raise DistributedSetupError(
            f"{asked} shards the model with FSDP, which needs an initialised process group: "
            "launch with `torchrun --nproc_per_node=N script.py` and call "
            "torch.distributed.init_process_group('nccl' on GPUs, 'gloo' on the CPU) before autoplan.optimize; "
            "or use autoplan.plan(...) to plan without applying"
        )
    if current != world_size:
        raise DistributedSetupError(
            f"the plan is for world_size={world_size} but the process group has {current} ranks; "
            f"plan with world_size={current} (or launch {world_size} processes)"
        )


def _unit_modules(model: torch.nn.Module, unit: Unit) -> torch.nn.Module | list[torch.nn.Module]:
    """What fully_shard groups for one unit: its submodule, or the layers of a Sequential range."""
    if isinstance(unit, GraphRun):
        raise OptionError(
            f"unit {unit.name!r} is a run of graph nodes, not a submodule; FSDP shards submodules. "
            "Pass units=['pattern'] naming the model's blocks"
        )
    if not isinstance(unit, SequentialRun):
        return model.get_submodule(unit.name)
    layers = run_layers(model, unit)
    return [layer for layer in layers if any(True for _ in layer.parameters())] or layers


def apply_fsdp(model: torch.nn.Module, plan: Plan, *, mesh: Any = None) -> torch.nn.Module:
    """Apply `plan`'s choices, then FSDP2 `fully_shard` to every unit and the root; returns `model`.

    Each unit is one FSDP group (gathered before its forward, resharded after, gathered again for
    its backward with the next one prefetched; with the plan's `reshard_after_forward=False`, kept gathered
    from its forward to its backward); the root group holds everything else and, as FSDP2 does for the
    root, stays unsharded from forward until its backward.
    """
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as error:  # FSDP2 became public API in torch 2.6
        raise DistributedSetupError(
            f"applying an FSDP plan needs torch.distributed.fsdp.fully_shard (FSDP2, torch >= 2.6); this is torch "
            f"{torch.__version__}. Upgrade torch, or plan with world_size=1."
        ) from error

    require_process_group(plan.request.world_size)
    apply_choices(model, plan.decisions.choices_by_unit(), OutsideUnits(plan.decisions.rest_precision))  # FSDP runs the loss as written
    options: dict[str, Any] = {"mesh": mesh} if mesh is not None else {}
    if plan.request.mesh.param_dtype:  # as planned: gathered and computed in bf16/fp16, reduced in fp32
        from torch.distributed.fsdp import MixedPrecisionPolicy

        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype_of(plan.request.mesh.param_dtype), reduce_dtype=torch.float32)
    # the call sites of one module (block@0, block@1, ...) are one group: FSDP2 gathers it again for every call
    kept = kept_names(plan.request.mesh.reshard_after_forward, [unit.unit.name for unit in plan.decisions.units])
    for group in dict.fromkeys(fsdp_group(unit.unit) for unit in plan.decisions.units):
        fully_shard(_unit_modules(model, group), reshard_after_forward=group.name not in kept, **options)
    fully_shard(model, **options)  # the root: FSDP2 keeps it gathered from forward to backward whatever it is given
    return model


# -- measuring a rank ------------------------------------------------------------------------
