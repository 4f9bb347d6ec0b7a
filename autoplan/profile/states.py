"""Counted states: a model's parameters, gradients and optimizer state, from one optimizer step and no forward.

What every training step on one device holds whatever its units choose. They are made the way the
simulated step's warm-up makes them (`timeline.warm_up`: a gradient for every trainable parameter,
then `optimizer.step()` on a fake twin), so they are the bytes the simulation's `StaticBytes` count,
for any optimizer it plans (bitsandbytes' 8-bit and paged ones included), in seconds where a
simulated step of a large model takes minutes. The planner answers from them alone when they are
over the budget (`solve.states_bound`): no checkpointing, precision or offload choice changes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoplan.inputs.devices import Device
from autoplan.inputs.loop import TrainingLoop
from autoplan.instruments.fake import FakeGradScaler, fake_copy, new_fake_mode
from autoplan.instruments.quantized import resident_tensors
from autoplan.instruments.target import as_the_target_runs
from autoplan.instruments.tracker import LiveBytesTracker
from autoplan.profile.timeline import warm_up
from autoplan.training.runner import LoopRunner
from autoplan.training.step_parts import make_optimizer, optimizer_state_tensors
from autoplan.vocabulary.tensors import unique_storage_bytes


@dataclass(frozen=True)
class CountedStates:
    """The bytes a training step holds whatever its units do, counted for every trainable parameter."""

    parameters: int  # parameters, buffers and quantization state, tied weights once
    gradients: int  # one gradient per trainable parameter
    optimizer: int  # the optimizer's state after a step (on the device: a paged optimizer's is not)
    trainable_numels: tuple[int, ...]  # elements of each trainable parameter, tied ones once

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def count_states(model: torch.nn.Module, *, device: Device, optimizer: str | torch.optim.Optimizer,
                 loop: TrainingLoop) -> CountedStates:
    """`model`'s states on `device` after one `optimizer` step in `loop`, on a fake twin (no memory, no forward)."""
    fake_mode = new_fake_mode()
    twin = fake_copy(model, fake_mode)
    # the tracker loads bitsandbytes' fake kernels, which its 8-bit optimizers' first step needs
    with fake_mode, as_the_target_runs(device), LiveBytesTracker(device):
        trainable = list({id(p): p for p in twin.parameters() if p.requires_grad}.values())
        return CountedStates(
            parameters=unique_storage_bytes(resident_tensors(twin)),
            gradients=unique_storage_bytes(trainable),
            optimizer=_optimizer_state_bytes(trainable, device=device, optimizer=optimizer, loop=loop),
            trainable_numels=tuple(p.numel() for p in trainable),
        )


def _optimizer_state_bytes(trainable: list[torch.nn.Parameter], *, device: Device, optimizer, loop: TrainingLoop) -> int:
    """The state `optimizer` keeps after a step over `trainable`.

    A named optimizer keeps the same state for every parameter of one shape and dtype (elementwise moments,
    bitsandbytes' blocks per tensor), plus what it shares (bitsandbytes' quantization maps): it steps two
    parameters of each shape, counts the rest of that shape as the first, and what two of them share once.
    An optimizer instance may do anything (one flat buffer for all): it steps them all.
    """
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for param in trainable:
        groups.setdefault((tuple(param.shape), param.dtype), []).append(param)
    stepped: list[torch.nn.Parameter] = [p for members in groups.values() for p in members[:2]] if isinstance(optimizer, str) else trainable
    opt = _stepped(stepped, device=device, optimizer=optimizer, loop=loop)
    if len(stepped) == len(trainable):
        return unique_storage_bytes(optimizer_state_tensors(opt))
    owners: dict[int, set[int]] = {}  # storage -> the stepped parameters whose state holds it
    for param in stepped:
        for tensor in _state_of(opt, param):
            owners.setdefault(id(tensor.untyped_storage()), set()).add(id(param))
    shared = {key for key, holders in owners.items() if len(holders) > 1}
    total = unique_storage_bytes(t for p in stepped for t in _state_of(opt, p) if id(t.untyped_storage()) in shared)
    for members in groups.values():
        own = [unique_storage_bytes(t for t in _state_of(opt, p) if id(t.untyped_storage()) not in shared) for p in members[:2]]
        if len(set(own)) > 1:  # two parameters of one shape keep different state: count them all, stepped
            return unique_storage_bytes(optimizer_state_tensors(_stepped(trainable, device=device, optimizer=optimizer, loop=loop)))
        total += own[0] * len(members)
    return total


def _stepped(params: list[torch.nn.Parameter], *, device: Device, optimizer, loop: TrainingLoop) -> torch.optim.Optimizer:
    """`optimizer` over `params` after the warm-up step the simulation runs (`timeline.warm_up`)."""
    opt = make_optimizer(optimizer, params, implementation=loop.optimizer_implementation(device.kind), device_kind=device.kind)
    owner = torch.nn.Module()  # the runner wants a model; the step reads only the optimizer's parameters
    runner = LoopRunner(owner, opt, loop, None, scaler=FakeGradScaler() if loop.grad_scaler else None)
    warm_up(runner, params)
    return opt


def _state_of(opt: torch.optim.Optimizer, param: torch.Tensor) -> list[torch.Tensor]:
    """What `opt` keeps for `param` on the device (`optimizer_state_tensors`' rule, one parameter)."""
    return [t for t in opt.state.get(param, {}).values() if isinstance(t, torch.Tensor) and not getattr(t, "is_paged", False)]
