"""Simulated training steps of a rewritten model, and the two the profile starts from.

`run_timeline` simulates one steady-state step of the model rewritten with a set of choices, under
fake tensors. `base_timelines` gives the profile its *timeline* (every unit at its base choice) and
its *reference* (no plan at all), and decides the loss head: fused (`runtime.loss_head`) only
where that lowers the step's peak around the head. Fusing trades the log-softmax and two
logits-sized gradients at the start of backward for the head's weight and input gradients held
from the end of forward, so it pays off when the vocabulary is wider than the model (a language
model) and not when it is narrower; the blocks hold the same bytes there either way, so the
comparison made with every unit kept holds for every plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autoplan.inputs.devices import Device
from autoplan.inputs.loop import TrainingLoop
from autoplan.plan import BACKWARD_START, Choice
from autoplan.profile.timeline import Timeline, simulate_training
from autoplan.runtime.fake import fake_copy, new_fake_mode
from autoplan.runtime.planned import apply_choices, fused_losses, remove_plan
from autoplan.trace.tracer import Traced


def simulation_model(traced: Traced, fake_mode: FakeTensorMode, choices: Mapping[str, Choice], rest: str, fused_loss: bool = False):
    """A fake twin of the traced model in training mode, rewritten with `choices`."""
    model = remove_plan(fake_copy(traced.model, fake_mode))
    model.train()  # plans are for training: dropout on, BatchNorm updating its statistics
    return apply_choices(model, choices, rest_precision=rest, fused_loss=fused_loss)


def run_timeline(
    traced: Traced,
    choices: Mapping[str, Choice],
    *,
    device: Device,
    optimizer: str | torch.optim.Optimizer,
    rest_precision: str = "fp32",
    loss_fn: Callable | None = None,
    fake_mode: FakeTensorMode | None = None,
    loop: TrainingLoop | None = None,
    fused_loss: bool = False,
) -> Timeline:
    """Simulate a steady-state step of `loop` (default: the common loop) with the model rewritten with
    `choices` (and its loss head fused, if `fused_loss`), under `fake_mode` (or a new one)."""
    fake_mode = fake_mode or new_fake_mode(traced.routing)
    model = simulation_model(traced, fake_mode, choices, rest_precision, fused_loss)
    timeline = simulate_training(
        model, traced.example_inputs, fake_mode=fake_mode, units=list(traced.units), device=device, optimizer=optimizer,
        loss_fn=loss_fn, loop=loop,
    )
    return dataclasses.replace(timeline, fused_loss=", ".join(f"{shape} logits" for shape in fused_losses(model)))


def head_peak_bytes(timeline: Timeline) -> int:
    """The step's peak from the end of the last forward phase to the start of backward: where the loss head is."""
    phases = timeline.phases
    last_forward = max(i for i, sample in enumerate(phases) if sample.phase.kind == "fwd")
    backward_start = next((i for i, sample in enumerate(phases) if sample.phase == BACKWARD_START), last_forward)
    return max(sample.peak_bytes for sample in phases[last_forward : backward_start + 1])


@dataclass(frozen=True)
class BaseTimelines:
    timeline: Timeline  # every unit at its base choice, the loss head as the plan runs it
    reference: Timeline  # no plan: every unit keep/fp32, nothing under autocast, the loss as written


def base_timelines(
    traced: Traced, base: Mapping[str, Choice], *, device: Device, optimizer, rest_precision: str, loss_fn, fake_mode: FakeTensorMode,
    loop: TrainingLoop, fuse_loss: bool,
) -> BaseTimelines:
    """The profile's timeline and reference; with `fuse_loss`, the head fused where that lowers the peak around it."""
    def simulate(choices, rest: str, fused: bool, mode: FakeTensorMode | None = None) -> Timeline:
        return run_timeline(traced, choices, device=device, optimizer=optimizer, rest_precision=rest, loss_fn=loss_fn,
                            fake_mode=mode, loop=loop, fused_loss=fused)

    timeline = simulate(base, rest_precision, fuse_loss, fake_mode)
    written = timeline
    if timeline.fused_loss:
        written = simulate(base, rest_precision, False)
        if head_peak_bytes(timeline) >= head_peak_bytes(written):
            timeline = written  # fusing would not lower the peak (a vocabulary narrower than the model)
    if rest_precision == "fp32":
        return BaseTimelines(timeline, written)
    return BaseTimelines(timeline, simulate({name: Choice("keep", "fp32") for name in base}, "fp32", False))
