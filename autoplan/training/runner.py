"""The person's training step, written once: `LoopRunner` runs it, and instruments watch it.

The simulation (`profile.timeline`, fake tensors, a phase mark at each boundary) and the
measurements (`verify`'s real steps, the FSDP rank measurement, `profile="measure"` timings) all
run a step through this runner, so a loop shape (outputs kept or dropped, accumulation, GradScaler,
`zero_grad(set_to_none)`) is written here and nowhere else; an instrument only says what it does
at the step's phases through `StepHooks`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch

from autoplan.axes.precision import dtype_of
from autoplan.training.step_parts import loss_function, real_scalar
from autoplan.vocabulary.tensors import tensors_of


class StepHooks:
    """What an instrument does at the phases of a step; these defaults do nothing."""

    def forward_context(self) -> ContextManager:
        """Around the forward and the loss (the simulation records saved tensors here)."""
        return contextlib.nullcontext()

    def forward_started(self) -> None: ...

    def forward_finished(self, output: Any) -> None:
        """The forward and the loss have run; `output` is the model's, still alive."""

    def backward_started(self) -> None: ...

    def optimizer_step_started(self) -> None: ...

    def zero_grad_started(self) -> None: ...


class LoopRunner:
    """The person's training loop, one optimizer step at a time, as the plan models it.

    `loop` is the TrainingLoop planned for (autoplan.inputs.loop). Between steps the runner holds
    what the loop's variables hold (`outputs`, `loss`), so the next forward runs with them alive,
    as in `for batch in loader: outputs = model(**batch)`, where `outputs` is reassigned only when
    the forward returns. `scaler`: the GradScaler (default torch's when the loop has one; the
    simulation passes its fake one). `hooks`: the instrument watching the step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loop: Any, loss_fn=None,
                 device_type: str = "cpu", *, scaler: Any = None, hooks: StepHooks | None = None) -> None:
        self.model, self.optimizer, self.loop, self.device_type = model, optimizer, loop, device_type
        self.loss_of = loss_function(loss_fn, loop.loss_in_model)
        self.scaler = scaler if scaler is not None or not loop.grad_scaler else torch.amp.GradScaler(device_type)
        self.hooks = hooks or StepHooks()
        self.outputs: Any = None
        self.loss: torch.Tensor | None = None

    def step(self, args: tuple, kwargs: dict, record_loss: Callable[[float], None] | None = None) -> None:
        """One optimizer step: every micro-batch's forward and backward, optimizer.step(), zero_grad."""
        for index in range(self.loop.accumulation_steps):
            self.micro_batch(args, kwargs, record_loss, first=index == 0)
        self.optimizer_step()

    def micro_batch(self, args: tuple, kwargs: dict, record_loss: Callable[[float], None] | None = None, *,
                    first: bool | None = None) -> None:
        """One micro-batch: forward, the loss (divided by the micro-batches), backward. `first`: whether it is the first
        of its optimizer step (default: only when the step has one), where a loop that zeroes before backward zeroes."""
        micro_batches = self.loop.accumulation_steps
        self.hooks.forward_started()
        with self.hooks.forward_context(), self._outer_autocast():
            if self.loop.keep_outputs:
                self.outputs = output = self.model(*args, **kwargs)  # the previous outputs go only now
                loss = real_scalar(self.loss_of(output))
            else:
                output = self.model(*args, **kwargs)  # `loss = loss_fn(model(x))`: the previous loss lives on
                loss = real_scalar(self.loss_of(output))
            if micro_batches > 1:
                loss = loss / micro_batches
        self.hooks.forward_finished(output)
        self.loss = loss
        del output, loss  # dropped outputs live on only where the loss saved them for backward
        if record_loss is not None:
            record_loss(float(self.loss.detach()))
        if self.loop.zeroes_before_backward(self.loop.accumulation_steps == 1 if first is None else first):
            self.optimizer.zero_grad(set_to_none=self.loop.zero_grad_set_to_none)  # Lightning's order: forward, zero_grad, backward
        self.hooks.backward_started()
        (self.scaler.scale(self.loss) if self.scaler is not None else self.loss).backward()

    def _outer_autocast(self) -> ContextManager:
        """The loop's own `with torch.autocast(...)` around the forward and the loss, where it has one."""
        if self.loop.outer_autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=dtype_of(self.loop.outer_autocast))

    def optimizer_step(self) -> None:
        """optimizer.step() (through the scaler's unscale and update when there is one), then zero_grad."""
        self.hooks.optimizer_step_started()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.hooks.zero_grad_started()
        if not self.loop.zero_grad_before_backward:
            self.optimizer.zero_grad(set_to_none=self.loop.zero_grad_set_to_none)

    def close(self) -> None:
        """Drop what the loop holds (outputs, loss, gradients): the loop has ended."""
        self.outputs = self.loss = None
        self.optimizer.zero_grad(set_to_none=True)


def held_by_loop(loop: Any, batch: Any, device: torch.device | None = None) -> list[torch.Tensor]:
    """What `loop` holds on the device beside the model and the micro-batch it trains, as blocks of bytes: one per
    storage of `batch` for each other micro-batch on the device (`batches_on_device`), and one of
    `kept_on_device_bytes`. Under a fake mode (the simulation) these are fakes; for real steps, on `device`."""
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors_of(batch)}  # shared storages once
    held = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(loop.batches_on_device - 1)
            for nbytes in storages.values()]
    if loop.kept_on_device_bytes:
        held.append(torch.empty(loop.kept_on_device_bytes, dtype=torch.uint8, device=device))
    return held
