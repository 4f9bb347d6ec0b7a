"""Measure one FSDP2 rank's peak in real training steps.

`measure_rank_peak` counts live tensor bytes with the same tracker the simulation uses, taught
FSDP2's habit of resizing a storage to zero and back instead of freeing it, and counting a DTensor
by its local shard.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from autoplan.inputs.devices import get_device
from autoplan.inputs.loop import TrainingLoop, check_loop
from autoplan.vocabulary.tensors import rounded_bytes, tensors_of
from autoplan.instruments.tracker import LiveBytesTracker
from autoplan.training.runner import LoopRunner
from autoplan.training.step_parts import optimizer_state_tensors


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
        inputs = tensors_of(inputs_tree)
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
    loop: TrainingLoop | None = None,
) -> RankMeasurement:
    """Train `steps` real optimizer steps of `loop` on this rank; the live-tensor peak of the last one.

    `loop` is the loop the plan was made for (`plan.request.loop`; default: the common loop, outputs kept
    through backward), run by the same `LoopRunner` as `autoplan.verify`. Everything alive before
    the last step (shards, optimizer state, the batch, the outputs the loop still holds) is counted
    from its start.
    """
    args, kwargs = batch
    tracker = _ShardedBytesTracker(get_device("cpu"))
    runner = LoopRunner(model, optimizer, check_loop(loop), loss_fn)
    losses: list[float] = []
    with _reporting_resizes(tracker):
        for step in range(steps):
            if step == steps - 1:
                held = tensors_of(runner.outputs) + ([runner.loss] if runner.loss is not None else [])
                _adopt_everything(tracker, model, optimizer, (args, kwargs), held)
                tracker.begin_phase("steady")
            with tracker if step == steps - 1 else contextlib.nullcontext():
                runner.step(args, kwargs, record_loss=losses.append)
    runner.close()
    return RankMeasurement(max(phase.peak_bytes for phase in tracker.phases()[1:]), tuple(losses))


def _adopt_everything(tracker: _ShardedBytesTracker, model, optimizer, batch, held: list[torch.Tensor]) -> None:
    from torch.distributed.tensor import DTensor

    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
    tensors = [local(t) for t in list(model.parameters()) + list(model.buffers())]
    tensors += [local(t) for t in optimizer_state_tensors(optimizer)]
    tensors += tensors_of(batch) + held
    # FSDP's own persistent buffers: the padded shards behind each DTensor, and unsharded storages
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            tensors.append(fsdp_param._sharded_param_data)
            tensors.extend(getattr(fsdp_param, "all_gather_outputs", []))
            tensors.extend(getattr(fsdp_param, "_unsharded_inner_tensors", []))
    tracker.adopt([t for t in tensors if t.untyped_storage().nbytes() > 0])
