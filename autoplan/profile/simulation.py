"""Simulated training steps of a rewritten model, and the two the profile starts from.

`run_timeline` simulates one steady-state step of the model rewritten with a set of choices, under
fake tensors. `base_timelines` gives the profile its *timeline* (every unit at its base choice),
its *reference* (no plan at all), and, where the loss head can be fused (`planned.loss_head`),
the step the other way as an *alternative*: the solve plans both and keeps the faster plan that
fits (`solve.assemble.faster_loss_head`), so fusing is decided by the same objective as every
other choice. The timeline is the fused step where it holds no more than the step as written in
every phase and less in some (then it is the lower-memory start). Fusing trades the
log-softmax and two logits-sized gradients at the start of backward for the head's weight and
input gradients held from the end of forward: a language model gains; a model whose vocabulary
is narrower than its width does not, nor one whose caller keeps the logits through backward
(the head's Linear then keeps its input to the end of backward, which can raise a later phase).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.utils._pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from autoplan.errors import OptionError
from autoplan.inputs.devices import Device
from autoplan.inputs.loop import TrainingLoop
from autoplan.plan import Choice, OutsideUnits, Precision
from autoplan.units import SequentialRun, Unit
from autoplan.vocabulary.names import run_layers, unit_module
from autoplan.profile.stack import shortened_step
from autoplan.profile.timeline import Timeline, simulate_training
from autoplan.instruments.fake import fake_copy, new_fake_mode
from autoplan.instruments.tracker import RooflineRates
from autoplan.planned.forwards import apply_choices, fused_losses, fusing_held_longer, remove_plan
from autoplan.trace.tracer import Traced


def simulation_model(traced: Traced, fake_mode: FakeTensorMode, choices: Mapping[Unit, Choice], rest: Precision, fused_loss: bool = False,
                     dropped: frozenset[str] = frozenset()):
    """A fake twin of the traced model in training mode, rewritten with `choices` (its parameters cast where FSDP2's
    MixedPrecisionPolicy gathers them in another dtype: `Traced.parameter_dtype`); without the layers in `dropped`."""
    model = remove_plan(fake_copy(traced.model, fake_mode, leave_out=dropped))
    model.train()  # plans are for training: dropout on, BatchNorm updating its statistics
    kept = {unit: choice for unit, choice in choices.items() if unit.name not in dropped}
    model = apply_choices(model, kept, OutsideUnits(rest, fused_loss))
    if traced.parameter_dtype is not None:
        cast_as_fsdp_computes(model, traced.parameter_dtype, fake_mode, [unit for unit in traced.units if unit.name not in dropped])
    return model


def cast_as_fsdp_computes(model: torch.nn.Module, dtype: torch.dtype, fake_mode: FakeTensorMode, units) -> None:
    """`model`'s floating parameters cast to `dtype` in place (tied ones once; buffers as they are), and the floating
    inputs of its forward and of every unit's cast on the way in, as each FSDP group's pre-forward does: what FSDP2's
    MixedPrecisionPolicy(param_dtype=dtype) computes with. The kept fp32 shards, the fp32 reduce and the optimizer's
    fp32 state are the per-rank model's (`memory.sharded`)."""
    stored = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32})
    if stored:
        raise OptionError(f"fsdp_mixed_precision is planned for fp32 parameters (kept in fp32, gathered in {str(dtype).removeprefix('torch.')}); "
                          f"this model has {', '.join(stored)} ones: load it in fp32, or plan without fsdp_mixed_precision")
    cast: dict[int, torch.nn.Parameter] = {}
    with fake_mode:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.is_floating_point() and param.dtype != dtype:
                    if id(param) not in cast:
                        cast[id(param)] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                    module._parameters[name] = cast[id(param)]

    def inputs_cast(module, args, kwargs):
        def to(value):
            return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
        return torch.utils._pytree.tree_map(to, (args, kwargs))

    # a Sequential run's layers each (unit_module would make a new Sequential of them, which nothing calls)
    groups = [model] + [layer for unit in units for layer in (run_layers(model, unit) if isinstance(unit, SequentialRun) else
                                                              [unit_module(model, unit)])]
    for module in dict.fromkeys(groups):
        module.register_forward_pre_hook(inputs_cast, with_kwargs=True)


def run_timeline(
    traced: Traced,
    choices: Mapping[Unit, Choice],
    *,
    device: Device,
    optimizer: str | torch.optim.Optimizer,
    rest_precision: Precision = "fp32",
    loss_fn: Callable | None = None,
    fake_mode: FakeTensorMode | None = None,
    loop: TrainingLoop | None = None,
    fused_loss: bool = False,
    rates: RooflineRates | None = None,
    dropped: frozenset[str] = frozenset(),
) -> Timeline:
    """Simulate a steady-state step of `loop` (default: the common loop) with the model rewritten with
    `choices` (and its loss head fused, if `fused_loss`), under `fake_mode` (or a new one); its ops timed at `rates`
    (default the device's). `dropped`: layers of a stack taken out of their container, a shortened step
    (`profile.stack`)."""
    fake_mode = fake_mode or new_fake_mode(traced.routing, traced.draws)
    model = simulation_model(traced, fake_mode, choices, rest_precision, fused_loss, dropped)
    timeline = simulate_training(
        model, traced.example_inputs, fake_mode=fake_mode, units=[u for u in traced.units if u.name not in dropped], device=device,
        optimizer=optimizer, loss_fn=loss_fn, loop=loop, rates=rates,
    )
    return dataclasses.replace(timeline, fused_logits=", ".join(f"{shape} logits" for shape in fused_losses(model)),
                               fusing_held_longer=fusing_held_longer(model))


def holds_less(fused: Timeline, written: Timeline) -> bool:
    """Whether the fused step peaks no higher than the step as written in every phase, and lower in one."""
    if [s.phase for s in fused.phases] != [s.phase for s in written.phases]:
        return False
    pairs = list(zip(fused.phases, written.phases))
    return all(f.peak_bytes <= w.peak_bytes for f, w in pairs) and any(f.peak_bytes < w.peak_bytes for f, w in pairs)


@dataclass(frozen=True)
class BaseTimelines:
    timeline: Timeline  # every unit at its base choice, the loss head fused where that holds less
    reference: Timeline  # no plan: every unit keep/fp32, nothing under autocast, the loss as written
    alternative: Timeline | None = None  # the loss head the other way, where it can be fused; None where it cannot


def base_timelines(
    traced: Traced, base: Mapping[Unit, Choice], *, device: Device, optimizer, rest_precision: Precision, loss_fn, fake_mode: FakeTensorMode,
    loop: TrainingLoop, fuse_loss: bool, rates: RooflineRates | None = None,
) -> BaseTimelines:
    """The profile's timeline and reference, timed at `rates` (default the device's); with `fuse_loss`, the head fused
    where that holds less (`holds_less`)."""
    def simulate(choices, rest: Precision, fused: bool, mode: FakeTensorMode | None = None) -> Timeline:
        def step(dropped: frozenset[str] = frozenset()) -> Timeline:
            return run_timeline(traced, choices, device=device, optimizer=optimizer, rest_precision=rest, loss_fn=loss_fn,
                                fake_mode=mode, loop=loop, fused_loss=fused, rates=rates, dropped=dropped)
        # a deep stack of identical layers: a few layers deep, the rest solved (profile.stack); the profile's timeline
        # replays no allocation log, so this holds on any target
        return shortened_step(traced, choices, step, records=True) or step()

    timeline = simulate(base, rest_precision, fuse_loss, fake_mode)
    written, alternative = timeline, None
    if timeline.fused_loss:
        written = simulate(base, rest_precision, False)
        timeline, alternative = (timeline, written) if holds_less(timeline, written) else (written, timeline)
    elif timeline.fusing_held_longer:  # nothing fused, and looking for a head held more than the step as written does
        timeline = written = simulate(base, rest_precision, False, fake_mode)
    if rest_precision == "fp32" and all(choice.precision == "fp32" for choice in base.values()):
        return BaseTimelines(timeline, written, alternative)
    # no plan: the model as written; under the loop's own autocast that runs its units in the loop's precision, with
    # autocast's weight cache (a planned keep/fp32 unit would switch the autocast off for itself)
    reference = {} if loop.outer_autocast else {unit: Choice("keep", "fp32") for unit in base}
    return BaseTimelines(timeline, simulate(reference, "fp32", False), alternative)
