"""Apply stage for more than one GPU: a plan's units become FSDP2 units, and per-rank peaks are measured.

`apply_fsdp(model, plan)` runs inside an initialised process group (`torchrun`): it rewrites each
unit for its checkpoint mode and precision (`rewrite.apply_choices`, as on one GPU), then calls
PyTorch's own `torch.distributed.fsdp.fully_shard` on each unit and on the root, so the units the
plan decided about are exactly the groups FSDP gathers and reduce-scatters.

Precision stays torch.autocast per unit, not FSDP2's `MixedPrecisionPolicy`: autocast keeps norms,
softmax and losses in fp32 as the single-GPU plan does, lets each unit choose its own precision,
and is what the profile measured; parameters stay fp32 in the all-gathers and gradients are
reduced in fp32 (twice the traffic of a bf16 policy, and no weight-cast rounding across ranks).

`measure_rank_peak` runs real training steps on this rank and counts live tensor bytes with the
same tracker the simulation uses, taught FSDP2's habit of resizing a storage to zero and back
instead of freeing it.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from autoplan.measure import train_step
from autoplan.partition import is_graph_unit
from autoplan.plan import Plan
from autoplan.rewrite import apply_choices
from autoplan.simulate import LiveBytesTracker, rounded_bytes
from autoplan.trace import RANGE_UNIT


class DistributedSetupError(RuntimeError):
    """FSDP was asked for, but this process is not part of a matching process group."""


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


def _unit_modules(model: torch.nn.Module, name: str) -> torch.nn.Module | list[torch.nn.Module]:
    """What fully_shard groups for one unit: its submodule, or the layers of a Sequential range."""
    if is_graph_unit(name):
        raise ValueError(
            f"unit {name!r} is a run of graph nodes, not a submodule; FSDP shards submodules. "
            "Pass units=['pattern'] naming the model's blocks"
        )
    match = RANGE_UNIT.match(name)
    if match is None:
        return model.get_submodule(name)
    layers = list(model.get_submodule(match["parent"]))[int(match["start"]):int(match["stop"])]
    return [layer for layer in layers if any(True for _ in layer.parameters())] or layers


def apply_fsdp(model: torch.nn.Module, plan: Plan, *, mesh: Any = None) -> torch.nn.Module:
    """Apply `plan`'s choices, then FSDP2 `fully_shard` to every unit and the root; returns `model`.

    Each unit is one FSDP group (gathered before its forward, resharded after, gathered again for
    its backward with the next one prefetched); the root group holds everything else and, as
    FSDP2 does for the root, stays unsharded from forward until its backward.
    """
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as error:  # FSDP2 became public API in torch 2.6
        raise RuntimeError(
            f"applying an FSDP plan needs torch.distributed.fsdp.fully_shard (FSDP2, torch >= 2.6); this is torch "
            f"{torch.__version__}. Upgrade torch, or plan with world_size=1."
        ) from error

    require_process_group(plan.world_size)
    apply_choices(model, plan.choices(), rest_precision=plan.rest_precision)
    options = {"mesh": mesh} if mesh is not None else {}
    for unit in plan.units:
        fully_shard(_unit_modules(model, unit.name), **options)
    fully_shard(model, **options)
    return model


# -- measuring a rank ------------------------------------------------------------------------


class _ShardedBytesTracker(LiveBytesTracker):
    """LiveBytesTracker for FSDP2: DTensors count by their local shard, resized storages by their size."""

    def __init__(self, device) -> None:
        super().__init__(device)
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
        out = func(*args, **(kwargs or {}))
        self._record(func, torch.utils._pytree.tree_map_only(torch.Tensor, local, (args, kwargs or {})),
                     torch.utils._pytree.tree_map_only(torch.Tensor, local, out))
        return out

    def _record(self, func, inputs_tree, out_tree) -> None:
        inputs = [t for t in torch.utils._pytree.tree_flatten(inputs_tree)[0] if isinstance(t, torch.Tensor)]
        input_storages = {id(t.untyped_storage()) for t in inputs}
        for tensor in torch.utils._pytree.tree_flatten(out_tree)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if id(storage) not in input_storages and id(storage) not in self._finalizers:
                    self._count(storage, id(storage))

    def _count(self, storage, key: int) -> None:
        nbytes = rounded_bytes(storage.nbytes())
        self._sizes[key] = nbytes
        self.live_bytes += nbytes
        current = self._phases[-1]
        current.peak_bytes = max(current.peak_bytes, self.live_bytes)
        self._finalizers[key] = weakref.finalize(storage, self._release_current, key)

    def _release_current(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)
        self._finalizers.pop(key, None)

    def resized(self, tensor: torch.Tensor) -> None:
        """A storage FSDP2 just resized (to 0 when resharding, to full size when gathering)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self._finalizers:
            self._count(storage, key)
            return
        nbytes = rounded_bytes(storage.nbytes())
        self.live_bytes += nbytes - self._sizes[key]
        self._sizes[key] = nbytes
        current = self._phases[-1]
        current.peak_bytes = max(current.peak_bytes, self.live_bytes)


@contextlib.contextmanager
def _reporting_resizes(tracker: _ShardedBytesTracker) -> Iterator[None]:
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    originals = (_fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage)

    def wrap(function):
        def resize(tensor):
            function(tensor)
            tracker.resized(tensor)

        return resize

    _fsdp_param.alloc_storage, _fsdp_param.free_storage = wrap(originals[0]), wrap(originals[1])
    _fsdp_param_group.alloc_storage = wrap(originals[2])
    try:
        yield
    finally:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage = originals


@dataclass(frozen=True)
class RankMeasurement:
    peak_bytes: int  # the most live tensor bytes on this rank during the last step
    losses: tuple[float, ...]  # the loss of every step, as this rank computed it


def measure_rank_peak(
    model: torch.nn.Module,
    batch: tuple[tuple, dict],
    optimizer: torch.optim.Optimizer,
    *,
    steps: int = 2,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> RankMeasurement:
    """Train `steps` real steps on this rank; the live-tensor peak of the last one (the steady state).

    The step is the one the plan models: loss.backward(), optimizer.step(), zero_grad(set_to_none=True).
    Everything alive before the last step (shards, optimizer state, the batch) is counted from its start.
    """
    from autoplan.devices import get_device

    args, kwargs = batch
    tracker = _ShardedBytesTracker(get_device("cpu"))
    losses = []
    with _reporting_resizes(tracker):
        for step in range(steps):
            if step == steps - 1:
                _adopt_everything(tracker, model, optimizer, (args, kwargs))
                tracker.begin_phase("steady")
            with tracker if step == steps - 1 else contextlib.nullcontext():
                train_step(model, args, kwargs, optimizer, loss_fn, record_loss=losses.append)
    return RankMeasurement(max(phase.peak_bytes for phase in tracker.phases()[1:]), tuple(losses))


def _adopt_everything(tracker: _ShardedBytesTracker, model, optimizer, batch) -> None:
    from torch.distributed.tensor import DTensor

    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
    tensors = [local(t) for t in list(model.parameters()) + list(model.buffers())]
    tensors += [local(t) for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    tensors += [t for t in torch.utils._pytree.tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    # FSDP's own persistent buffers: the padded shards behind each DTensor, and unsharded storages
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            tensors.append(fsdp_param._sharded_param_data)
            tensors.extend(getattr(fsdp_param, "all_gather_outputs", []))
            tensors.extend(getattr(fsdp_param, "_unsharded_inner_tensors", []))
    tracker.adopt([t for t in tensors if t.untyped_storage().nbytes() > 0])
