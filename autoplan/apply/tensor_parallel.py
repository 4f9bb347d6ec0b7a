"""Apply stage for tensor parallelism: the plan's linears split with torch's own `parallelize_module`.

`apply_tensor_parallel(model, plan)` runs inside an initialised process group of every rank the plan is for
(`torchrun`): it makes torch's two-dimensional device mesh ("dp" × "tp", as torchtitan does), splits each
linear of the plan's `tp_layout` with `ColwiseParallel` or `RowwiseParallel` over "tp", then applies the
units' choices and, where the mesh has FSDP too, `fully_shard` over "dp" (`apply.sharding`), in torchtitan's
order: tensor parallelism, activation checkpointing, FSDP.

With sequence parallelism (`inputs.sequence_parallel`), torchtitan's styles besides: the first block's input
split along the sequence and the attention's, the MLP's and the head's gathered (`PrepareModuleInput`), the
norms run on the rank's part (`SequenceParallel`), the row-wise linears' outputs reduce-scattered to it
(`RowwiseParallel(output_layouts=Shard(1))`).
"""

from __future__ import annotations

import functools

import torch

from autoplan.apply.sharding import apply_fsdp, require_process_group
from autoplan.errors import OptionError
from autoplan.inputs.sequence_parallel import SEQUENCE_DIM, resolve_sequence_layout
from autoplan.mesh import FSDP, TP, Mesh
from autoplan.plan import Plan
from autoplan.planned.forwards import apply_choices


def apply_tensor_parallel(model: torch.nn.Module, plan: Plan) -> torch.nn.Module:
    """Split `plan.request.mesh.tp_layout`'s linears over the mesh's "tp" ranks, then apply the plan; returns `model`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = plan.request.mesh
    require_process_group(mesh.size)
    if any(isinstance(parameter, DTensor) for parameter in model.parameters()):
        raise OptionError(f"{type(model).__name__} holds DTensor parameters already (parallelized or sharded): pass the "
                          "model as it was planned, whole; autoplan.apply splits and shards it as the plan says")
    device_type = "cuda" if any(parameter.is_cuda for parameter in model.parameters()) else "cpu"
    device_mesh = init_device_mesh(device_type, (mesh.along(FSDP), mesh.along(TP)), mesh_dim_names=("dp", TP.name))
    parallelize_module(model, device_mesh[TP.name], _styles(model, mesh))
    if mesh.shards > 1:
        return apply_fsdp(model, plan, mesh=device_mesh["dp"])
    return apply_choices(model, plan.decisions.choices_by_unit(), plan.decisions.outside_units)


def _styles(model: torch.nn.Module, mesh: Mesh) -> dict:
    """parallelize_module's plan: {module name: its ParallelStyle}."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    plan: dict = {name: _linear_style(style, mesh.sequence_parallel) for name, style in mesh.tp_layout}
    if not mesh.sequence_parallel:
        return plan
    layout = resolve_sequence_layout(model, mesh.tp_layout)
    sequence, whole = Shard(SEQUENCE_DIM), Replicate()
    plan |= {name: SequenceParallel(use_local_output=True) for name in layout.norms}
    plan[layout.first_block] = _first_input(whole, sequence, use_local_output=True)
    for name, keyword in layout.gathered:
        plan[name] = _first_input(sequence, whole, keyword=keyword)
    split_head = dict(mesh.tp_layout).get(layout.head) == "colwise_gather_output"  # its input gathered by its own style
    plan[layout.head] = (ColwiseParallel(input_layouts=sequence, output_layouts=whole) if split_head
                         else _first_input(sequence, whole, use_local_output=True))
    return plan


def _linear_style(style: str, sequence_parallel: bool):
    """torch's style for one split linear of the layout: a row-wise one's output reduce-scattered to the rank's part of
    the sequence under sequence parallelism; a head's ("colwise_gather_output") logits gathered whole."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "rowwise":
        return RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM)) if sequence_parallel else RowwiseParallel()
    return ColwiseParallel(output_layouts=Replicate()) if style == "colwise_gather_output" else ColwiseParallel()


def _first_input(given, desired, keyword: str | None = None, use_local_output: bool = False):
    """torch's PrepareModuleInput for a module's first input (by position, or by `keyword`); its other arguments, however
    many the call passes, as they are (PrepareModuleInput wants a layout for each positional one)."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    if keyword is not None:
        return PrepareModuleInput(input_kwarg_layouts={keyword: given}, desired_input_kwarg_layouts={keyword: desired},
                                  use_local_output=use_local_output)
    return _first_positional()(input_layouts=(given,), desired_input_layouts=(desired,), use_local_output=use_local_output)


@functools.cache
def _first_positional() -> type:
    """PrepareModuleInput whose layouts name the first positional argument and pass any others as they are (made once,
    on first use: importing torch.distributed.tensor is left to a plan that needs it)."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    class FirstPositional(PrepareModuleInput):
        def _prepare_input_fn(self, inputs, device_mesh):
            extra = (None,) * (len(inputs) - 1)
            self.input_layouts = (self.input_layouts[0], *extra)
            self.desired_input_layouts = (self.desired_input_layouts[0], *extra)
            return super()._prepare_input_fn(inputs, device_mesh)

    return FirstPositional
