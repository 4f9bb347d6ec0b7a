"""Measure one FSDP2 rank's peak in real training steps.

`measure_rank_peak` counts with the CPU allocator's own reports (`verify.allocator`), which share
nothing with the simulation: FSDP2's habit of resizing a storage to zero and back is the allocator
freeing and making a block, and a DTensor's bytes are its local shard's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from autoplan.inputs.loop import TrainingLoop, check_loop
from autoplan.vocabulary.tensors import tensors_of
from autoplan.training.runner import LoopRunner
from autoplan.training.step_parts import optimizer_state_tensors
from autoplan.verify.allocator import AllocatorCount, resident_bytes


@dataclass(frozen=True)
class RankMeasurement:
    peak_bytes: int  # the most bytes this rank's CPU allocator held during the steady step counted lowest
    losses: tuple[float, ...]  # the loss of every step, as this rank computed it
    peak_blocks: tuple[tuple[int, int, int, str], ...] = ()  # with keep_peak_blocks: what was alive then (CountedStretch)
    # the least the peak can be: the count less blocks gloo's threads freed unheard (CountedStretch.floor_bytes); the
    # true peak lies between floor_bytes and peak_bytes, equal where the count heard every free that mattered
    floor_bytes: int = 0


def measure_rank_peak(
    model: torch.nn.Module,
    batch: tuple[tuple, dict],
    optimizer: torch.optim.Optimizer,
    *,
    steps: int = 3,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    loop: TrainingLoop | None = None,
    keep_peak_blocks: bool = False,
) -> RankMeasurement:
    """Train `steps` real optimizer steps of `loop` on this rank; the steady peak, as the allocator counts: the lowest
    of the steps after the first (whose optimizer state is made lazily), or the only step.

    `loop` is the loop the plan was made for (`plan.request.loop`; default: the common loop, outputs kept
    through backward), run by the same `LoopRunner` as `autoplan.verify`. Everything alive before
    the last step (shards, optimizer state, the batch, the outputs the loop still holds) is counted.
    `keep_peak_blocks`: list the blocks alive at that peak, by who made them (`RankMeasurement.peak_blocks`).
    """
    args, kwargs = batch
    runner = LoopRunner(model, optimizer, check_loop(loop), loss_fn)
    losses: list[float] = []
    # counted from the first step: FSDP2 frees and remakes its gathered storages (resize_ to 0 and back), and the
    # allocator reports the free of a block only if it saw the block made. The buffers gloo stages inside its
    # collectives (and drops in threads of its own, unreported) are left out, as a GPU's NCCL holds none of PyTorch's
    # (verify/allocator.py); before they were, the count was an upper bound by as much as those threads ran late. Each
    # steady step is counted and the lowest kept
    first_steady = min(1, steps - 1)
    with AllocatorCount(resident=_resident(model, optimizer, (args, kwargs)), keep_peak_blocks=keep_peak_blocks) as count:
        for step in range(steps):
            if step >= first_steady:
                # what the loop still holds of the last step (its outputs, its loss) is alive here too: a mark's held
                # bytes must be all that is, as the count takes every later reported free from them (summed in one
                # expression: a name bound to them would keep them alive through the step)
                count.mark(f"step {step + 1}", held_bytes=resident_bytes(
                    _resident(model, optimizer, (args, kwargs)) + tensors_of((runner.outputs, runner.loss))))
            runner.step(args, kwargs, record_loss=losses.append)
    runner.close()
    steady = min(count.stretches()[-(steps - first_steady):], key=lambda stretch: stretch.peak_bytes)
    return RankMeasurement(steady.peak_bytes, tuple(losses), steady.peak_blocks, steady.floor_bytes)


def _resident(model, optimizer, batch) -> list[torch.Tensor]:
    """What this rank holds before its first step: its shards (a DTensor by its local tensor), buffers, any optimizer
    state, the batch, and FSDP2's own persistent buffers (the padded shards behind each DTensor)."""
    from torch.distributed.tensor import DTensor

    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
    tensors = [local(t) for t in list(model.parameters()) + list(model.buffers())]
    tensors += [local(t) for t in optimizer_state_tensors(optimizer)]
    tensors += tensors_of(batch)
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            tensors.append(fsdp_param._sharded_param_data)
            tensors.extend(getattr(fsdp_param, "all_gather_outputs", []))
            tensors.extend(getattr(fsdp_param, "_unsharded_inner_tensors", []))
    return [t for t in tensors if t.untyped_storage().nbytes() > 0]
