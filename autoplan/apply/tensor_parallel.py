"""Apply stage for tensor parallelism: the plan's linears split with torch's own `parallelize_module`.

`apply_tensor_parallel(model, plan)` runs inside an initialised process group of every rank the plan is for
(`torchrun`): it makes torch's two-dimensional device mesh ("dp" × "tp", as torchtitan does), splits each
linear of the plan's `tp_layout` with `ColwiseParallel` or `RowwiseParallel` over "tp", then applies the
units' choices and, where the mesh has FSDP too, `fully_shard` over "dp" (`apply.sharding`), in torchtitan's
order: tensor parallelism, activation checkpointing, FSDP.
"""

from __future__ import annotations

import torch

from autoplan.apply.sharding import apply_fsdp, require_process_group
from autoplan.errors import OptionError
from autoplan.mesh import FSDP, TP
from autoplan.plan import Plan
from autoplan.planned.forwards import apply_choices


def apply_tensor_parallel(model: torch.nn.Module, plan: Plan) -> torch.nn.Module:
    """Split `plan.request.mesh.tp_layout`'s linears over the mesh's "tp" ranks, then apply the plan; returns `model`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = plan.request.mesh
    require_process_group(mesh.size)
    if any(isinstance(parameter, DTensor) for parameter in model.parameters()):
        raise OptionError(f"{type(model).__name__} holds DTensor parameters already (parallelized or sharded): pass the "
                          "model as it was planned, whole; autoplan.apply splits and shards it as the plan says")
    device_type = "cuda" if any(parameter.is_cuda for parameter in model.parameters()) else "cpu"
    device_mesh = init_device_mesh(device_type, (mesh.along(FSDP), mesh.along(TP)), mesh_dim_names=("dp", TP.name))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, device_mesh[TP.name], {name: styles[style]() for name, style in mesh.tp_layout})
    if mesh.shards > 1:
        return apply_fsdp(model, plan, mesh=device_mesh["dp"])
    return apply_choices(model, plan.decisions.choices_by_unit(), plan.decisions.outside_units)
