"""Make a model run its units the way a set of choices says, in place.

Each unit's `forward` is replaced *on the instance* by a `PlannedForward` (`planned.wrappers`); a
run of an nn.Sequential's layers by a `PlannedSequential` on the Sequential, graph units by a
`PlannedGraph` on the model, and each block of a segment by a `SegmentMember` of one
`PlannedSegment` (`planned.segments`). Nothing else changes: the class, the parameter objects,
`state_dict()` keys and the model's own methods stay as they were, `copy.deepcopy` copies the
wrappers with the model, and `remove_plan(model)` puts the original forwards back. The profile
uses this on fake twins; the apply stage on the caller's model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping, TypeGuard, cast

import torch

from autoplan.axes.precision import kind
from autoplan.axes.precisions.float8 import Float8Forward
from autoplan.plan import Choice, OutsideUnits
from autoplan.planned.graph import split_by_units
from autoplan.planned.loss_head import FusedLossForward
from autoplan.units import CallSite, GraphRun, ModuleUnit, Segment, SequentialRun, Unit
from autoplan.vocabulary.names import run_layers, segment_members
from autoplan.planned.segments import PlannedSegment, SegmentMember
from autoplan.planned.wrappers import PlannedForward


@dataclass
class PlannedSequential:
    """An nn.Sequential's forward whose runs of layers are units: each run goes through its PlannedForward.

    The runs are plain Sequentials over the same layer objects, held here rather than registered,
    so `state_dict()` keys and `model.modules()` are unchanged.
    """

    module: torch.nn.Sequential
    runs: list[tuple[int, int, PlannedForward]]  # (start, stop, the run's planned forward)
    original: Any = None

    def __call__(self, input):
        layers = list(self.module)
        position = 0
        for start, stop, run in self.runs:
            for layer in layers[position:start]:
                input = layer(input)
            input = run(input)
            position = stop
        for layer in layers[position:]:
            input = layer(input)
        return input


@dataclass
class PlannedGraph:
    """A model's forward through its graph units: a GraphModule of the model's own layers, one
    submodule per unit, each with its PlannedForward. Held here, not registered, so `state_dict()`
    keys and `model.modules()` are unchanged."""

    module: torch.nn.Module
    split: torch.fx.GraphModule
    choices: Mapping[Unit, Choice]  # the split's units: a submodule each
    original: Any = None

    def __call__(self, *args, **kwargs):
        return self.split(*args, **kwargs)

    def __deepcopy__(self, memo):
        # GraphModule's own deepcopy rebuilds its submodules and drops their instance forwards:
        # copy the split (its layers via memo, so they are the model copy's), then plan it again.
        split = copy.deepcopy(self.split, memo)
        remove_plan(split)
        apply_choices(split, self.choices)
        return PlannedGraph(copy.deepcopy(self.module, memo), split, dict(self.choices), copy.deepcopy(self.original, memo))


@dataclass
class PlannedCalls:
    """The forward of a module that runs several times per forward (shared weights), planned per call.

    Call k of a forward runs `calls[k]` (None: as it was). Calls are counted modulo their number,
    so every forward starts again at call 0; recomputation in backward runs a call's own function,
    not this, and does not count. One module, one set of parameters: only the forward is per call.
    """

    module: torch.nn.Module
    calls: list[PlannedForward | None]
    original: Any = None
    count: int = 0

    def __call__(self, *args, **kwargs):
        planned = self.calls[self.count % len(self.calls)]
        self.count += 1
        if planned is not None:
            return planned(*args, **kwargs)
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


def _has_submodule(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


Planned = PlannedForward | PlannedSequential | PlannedGraph | PlannedCalls | SegmentMember | FusedLossForward


def _is_planned(forward: Any) -> TypeGuard[Planned]:
    return isinstance(forward, (PlannedForward, PlannedSequential, PlannedGraph, PlannedCalls, SegmentMember, FusedLossForward,
                                Float8Forward))


def remove_plan(model: torch.nn.Module) -> torch.nn.Module:
    """Put back the forward each module had before a plan was applied."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        while _is_planned(forward):
            forward = forward.original
        if forward is None:
            module.__dict__.pop("forward", None)
        elif module.__dict__.get("forward") is not forward:
            module.forward = forward
    return model


def apply_choices(
    model: torch.nn.Module,
    choices: Mapping[Unit, Choice],
    outside: OutsideUnits = OutsideUnits(),
) -> torch.nn.Module:
    """Wrap each unit of `model` (in place) to run with its choice; returns `model`.

    `outside.precision` is the precision of everything outside the units: when it is low, the whole
    forward runs under autocast, and units chosen fp32 switch it off for themselves.
    `outside.fused_loss`: the forward's cross-entropy of its output head is fused (`planned.loss_head`).
    """
    remove_plan(model)
    # graph units of the user's model; on the planner's split GraphModule they are submodules
    graph_runs: dict[Unit, Choice] = {u: c for u, c in choices.items() if isinstance(u, GraphRun) and not _has_submodule(model, u.name)}
    if graph_runs:
        split = split_by_units(model, [unit for unit in graph_runs if isinstance(unit, GraphRun)])
        apply_choices(split, graph_runs)  # there each is its submodule of the same name
        model.forward = PlannedGraph(model, split, graph_runs, original=model.__dict__.get("forward"))
    runs: dict[str, list[tuple[int, int, PlannedForward]]] = {}
    calls: dict[str, dict[int, Choice]] = {}
    for unit, choice in choices.items():
        if unit in graph_runs:
            continue
        if isinstance(unit, Segment):
            _apply_segment(model, unit, choice)
            for member in segment_members(model, unit):
                prepare_precision(model.get_submodule(member), choice)
        elif isinstance(unit, CallSite):
            calls.setdefault(unit.module, {})[unit.index] = choice
        elif isinstance(unit, SequentialRun):
            layers = torch.nn.Sequential(*run_layers(model, unit))
            runs.setdefault(unit.parent, []).append((unit.start, unit.stop, PlannedForward(layers, choice)))
            prepare_precision(layers, choice)
        else:  # a module, or a graph run on the split GraphModule (its submodule of that name)
            module = model.get_submodule(unit.name)
            module.forward = PlannedForward(module, choice, original=module.__dict__.get("forward"))
            prepare_precision(module, choice)
    for parent_name, parent_runs in runs.items():
        parent = model.get_submodule(parent_name)  # a run's parent: a Sequential or ModuleList, indexed alike
        parent.forward = PlannedSequential(cast(torch.nn.Sequential, parent), sorted(parent_runs, key=lambda run: run[0]),
                                           parent.__dict__.get("forward"))
    for module_name, by_call in calls.items():
        module = model.get_submodule(module_name)
        original = module.__dict__.get("forward")
        by_index = [by_call.get(i) for i in range(max(by_call) + 1)]
        planned = [None if c is None else PlannedForward(module, c, original=original) for c in by_index]
        module.forward = PlannedCalls(module, planned, original)
    if outside.fused_loss:
        model.forward = FusedLossForward(model, original=model.__dict__.get("forward"))
    if outside.precision != "fp32":
        model.forward = PlannedForward(
            model, Choice("keep", outside.precision), original=model.__dict__.get("forward"), cast_outputs=False
        )
    return model


def prepare_precision(module: torch.nn.Module, choice: Choice) -> None:
    """A unit's precision that swaps its modules (float8) swaps them now, for good (`remove_plan` undoes it), not
    each time it runs: torch.compile then traces modules made before it, not their making. Not for a module called
    at more than one call site, whose calls may differ in precision (they swap while they run)."""
    prepare = getattr(kind(choice.precision), "prepare", None)
    if prepare is not None:
        prepare(module)


def _apply_segment(model: torch.nn.Module, unit: Segment, choice: Choice) -> None:
    modules = [model.get_submodule(member) for member in segment_members(model, unit)]
    originals = [module.__dict__.get("forward") for module in modules]
    segment = PlannedSegment(unit, modules, choice, originals)
    for index, (module, original) in enumerate(zip(modules, originals)):
        module.forward = SegmentMember(segment, index, original)


def planned_choices(model: torch.nn.Module) -> dict[str, Choice]:
    """The choice each unit of a rewritten model runs with, by unit name (as `Plan.choices()`, the report and the
    JSON name them; `planned_units` keys the same by Unit)."""
    return {unit.name: choice for unit, choice in planned_units(model).items()}


def planned_units(model: torch.nn.Module) -> dict[Unit, Choice]:
    """The choice each unit of a rewritten model runs with (the root's own autocast excluded)."""
    choices: dict[Unit, Choice] = {}
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        while isinstance(forward, (PlannedForward, FusedLossForward)) and not name and forward.original is not None:
            forward = forward.original  # the root's autocast or fused loss around a graph plan
        if isinstance(forward, PlannedGraph):
            choices.update(forward.choices)
        elif isinstance(forward, PlannedCalls):
            choices.update({CallSite(name, i): p.choice for i, p in enumerate(forward.calls) if p is not None})
        elif isinstance(forward, PlannedSequential):
            choices.update({SequentialRun(name, start, stop): run.choice for start, stop, run in forward.runs})
        elif isinstance(forward, SegmentMember) and forward.index == 0:
            choices[forward.segment.unit] = forward.choice
        elif isinstance(forward, PlannedForward) and name:
            choices[ModuleUnit(name)] = forward.choice
    return choices


def _fused_loss_forward(model: torch.nn.Module) -> FusedLossForward | None:
    """The FusedLossForward among the wrappers around `model`'s forward, if any."""
    forward = model.__dict__.get("forward")
    while _is_planned(forward) and not isinstance(forward, FusedLossForward):
        forward = forward.original
    return forward if isinstance(forward, FusedLossForward) else None


def has_fused_loss(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward runs with its loss head fused (`apply_choices(..., OutsideUnits(fused_loss=True))`)."""
    return _fused_loss_forward(model) is not None


def fused_losses(model: torch.nn.Module) -> tuple[str, ...]:
    """The logits' shapes whose cross-entropy the model's last forward fused (empty: none)."""
    wrapper = _fused_loss_forward(model)
    return () if wrapper is None else wrapper.fused


def fusing_held_longer(model: torch.nn.Module) -> bool:
    """Whether the model's last forward under a fused loss head kept a linear's input alive longer than the forward as
    written would (`planned.loss_head.LossHeadMode.held_longer`)."""
    wrapper = _fused_loss_forward(model)
    return wrapper is not None and wrapper.held_longer
