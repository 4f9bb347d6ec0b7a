"""Checkpointing by hand, measured: the baseline autoplan must never be worse than.

`checkpoint_by_hand(model, structure)` does what a person writes without autoplan:
`torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` around each repeated block
(every call of a shared block), `checkpoint_sequential` over a Sequential backbone, or
`model.gradient_checkpointing_enable()` for a transformers model.

`torchtitan_policy_contexts` is torchtitan's op-level selective policy as its code decides it, for
`checkpoint(..., context_fn=...)` and `checkpoint_wrapper(..., context_fn=...)`.

`measured_step(model, inputs)` runs real training steps on the CPU and returns the steady-state
peak (step 2: optimizer state exists) counted as `autoplan.verify` counts on the CPU, by the CPU
allocator's own reports (autoplan.verify.allocator, nothing of the simulation's), and the FLOPs of that step (`torch.utils.flop_counter.FlopCounterMode`); the
difference of FLOPs to the same step without checkpointing is what a plan recomputes.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, checkpoint_sequential, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from autoplan.inputs.batch import normalize_inputs
from autoplan.inputs.loop import TrainingLoop
from autoplan.training.runner import LoopRunner
from autoplan.training.step_parts import default_loss, make_optimizer, preserved
from autoplan.verify.allocator import AllocatorCount

from tests.structures import Structure


def _checkpointed(forward: Callable) -> Callable:
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _checkpointed_sequential(module: torch.nn.Sequential, segments: int) -> Callable:
    def run(input):
        if not torch.is_grad_enabled():
            return torch.nn.Sequential.forward(module, input)
        return checkpoint_sequential(list(module), segments, input, use_reentrant=False)

    return run


def torchtitan_policy_contexts():
    """torchtitan's `_custom_policy` (9dec370): save mm (except every second one), attention and max outputs; the CPU's
    fused attention joins its list as the GPU's kernels are in it."""
    save = {torch.ops.aten.mm.default, torch.ops.aten.max.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            meta[mode] += 1
        keep = func in save and not (func == torch.ops.aten.mm.default and meta[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def enable_transformers_checkpointing(model: torch.nn.Module) -> None:
    """transformers' own checkpointing of every layer, by its current name (5.x deprecated gradient_checkpointing_enable)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def checkpoint_by_hand(model: torch.nn.Module, structure: Structure) -> torch.nn.Module:
    """`model` (in place) with every block checkpointed the way a person would do it by hand."""
    if structure.transformers_checkpointing:
        enable_transformers_checkpointing(model)
    elif structure.sequential_segments is not None:
        model.forward = _checkpointed_sequential(model, structure.sequential_segments(model))
    else:
        for block in structure.blocks(model):
            block.forward = _checkpointed(block.forward)
    return model


@dataclass(frozen=True)
class StepMeasurement:
    peak_bytes: int  # bytes at the peak of a steady-state training step (the CPU allocator's count)
    flops: int  # FLOPs of that step: forward, backward (recomputation included)


def measured_step(
    model: torch.nn.Module, example_inputs: Any, *, optimizer: str = "adamw", loss_fn: Callable | None = None
) -> StepMeasurement:
    """The steady-state peak and FLOPs of a real training step of `model` on the CPU.

    Counted as `autoplan.verify` counts on the CPU: the CPU allocator's bytes in use from step 2 on,
    starting from what the model, the batch and the optimizer hold.
    The model's parameters, buffers and the RNG are put back afterwards.
    """
    args, kwargs = normalize_inputs(example_inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    with preserved(model):
        opt = make_optimizer(optimizer, params, implementation="for-loop")  # torch's default on the CPU
        # the common loop, as autoplan.verify runs it by default: the outputs stay alive through backward
        runner = LoopRunner(model, opt, TrainingLoop(), loss_fn)
        # counted from the first step (the allocator reports only what it allocates while counted); the peak
        # of steps 2 and 3, as autoplan.verify counts them: in step 3 step 2's outputs are still alive
        with AllocatorCount(resident=(model, args, kwargs, opt)) as count:
            runner.step(args, kwargs)
            count.mark("steady")
            runner.step(args, kwargs)
            runner.step(args, kwargs)
        peak = count.stretches()[-1].peak_bytes
        runner.close()
        # FLOPs in a step of their own: FlopCounterMode's module tracking makes reference cycles that
        # keep checkpoint's recomputed tensors alive until the garbage collector runs, which would
        # make the peak depend on when it does
        counter = FlopCounterMode(display=False)
        with counter:
            (loss_fn or default_loss)(model(*args, **kwargs)).backward()
        opt.zero_grad(set_to_none=True)
    return StepMeasurement(peak, counter.get_total_flops())


@dataclass(frozen=True)
class Baseline:
    """One structure trained three ways: as built, checkpointed by hand."""

    plain: StepMeasurement  # no checkpointing at all
    by_hand: StepMeasurement  # every block checkpointed by hand

    @property
    def by_hand_recompute_flops(self) -> int:
        return self.by_hand.flops - self.plain.flops


def baseline(structure: Structure) -> Baseline:
    model, inputs = structure.build()
    model.train()
    plain = measured_step(model, inputs)
    by_hand = measured_step(checkpoint_by_hand(copy.deepcopy(model), structure), inputs)
    return Baseline(plain, by_hand)


@dataclass(frozen=True)
class Comparison:
    """autoplan against checkpointing every block by hand, on one structure (CPU, fp32, AdamW)."""

    structure: str
    by_hand: StepMeasurement
    floor_bytes: int  # plan.prediction.minimum_peak_bytes: the lowest peak autoplan can reach
    units: tuple[str, ...]  # the units of the plan at the by-hand peak
    feasible: bool  # autoplan's plan at a budget of the by-hand peak (no reserve) fits, it says
    planned: StepMeasurement | None  # that plan, measured (None when it said it does not fit)
    plain: StepMeasurement | None = None  # no checkpointing at all, when asked for
    plan: Any = None  # the autoplan.Plan at the by-hand peak

    @property
    def floor_ratio(self) -> float:
        return self.floor_bytes / self.by_hand.peak_bytes


def compare_with_plan(structure: Structure, *, with_plain: bool = False) -> Comparison:
    """Measure the by-hand peak, then plan at exactly that budget (reserve 0) and measure the plan."""
    import autoplan

    model, inputs = structure.build()
    model.train()
    plain = measured_step(model, inputs) if with_plain else None
    by_hand = measured_step(checkpoint_by_hand(copy.deepcopy(model), structure), inputs)
    plan = autoplan.plan(model, budget=by_hand.peak_bytes, example_inputs=inputs, device="cpu", precision="fp32", reserve=0)
    planned = measured_step(autoplan.apply(copy.deepcopy(model), plan), inputs) if plan.outcome.feasible else None
    units = tuple(unit.name for unit in plan.decisions.units)
    return Comparison(structure.name, by_hand, plan.prediction.minimum_peak_bytes, units, plan.outcome.feasible, planned, plain, plan)


def assert_same_step(model: torch.nn.Module, plan: Any, inputs: Any) -> None:
    """One training step of `model` rewritten with `plan` has the loss, gradients and buffers of the original.

    Both run with the same seeds, torch's and numpy's (dropout masks; transformers' SpecAugment draws
    its masks with numpy), and checkpoint replays the RNG on recomputation; each gets its own copy of
    the batch, which a forward may write into.
    """
    import numpy as np

    import autoplan

    planned = autoplan.apply(copy.deepcopy(model), plan)
    args, kwargs = normalize_inputs(inputs)
    losses = []
    for net in (model, planned):
        net.train()
        torch.manual_seed(1)
        np.random.seed(1)
        output = net(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        loss = output.loss if hasattr(output, "loss") else output.sum()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0])
    for (name, a), b in zip(model.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    for (name, a), b in zip(model.named_buffers(), planned.buffers()):
        torch.testing.assert_close(b, a, msg=name)
