"""Units on a model: the modules a unit (`autoplan.units`) runs, and unit names matched against patterns.

A unit's kind and parts are its own (`autoplan.units`); what this file adds is where they are in a
given model: the Sequential that holds a run, the children a segment spans, the module that
computes a unit. Patterns (`units=["layers.*"]`) are shell-style, matched with fnmatch against the
units' names.
"""

from __future__ import annotations

import fnmatch
import re
from typing import cast

import torch

from autoplan.errors import PlanMismatchError, UnitPatternError
from autoplan.units import CallSite, Segment, SequentialRun, Unit

_NUMBERED = re.compile(r"^(.*)\.(\d+)$")


def numbered_child(name: str) -> tuple[str, int] | None:
    """`(container, index)` of a name that ends in a number (`model.layers.7` -> `("model.layers", 7)`), else None:
    how a stack's layers are told apart by their names."""
    match = _NUMBERED.match(name)
    return (match.group(1), int(match.group(2))) if match else None


def run_container(model: torch.nn.Module, run: SequentialRun) -> torch.nn.Sequential:
    """The Sequential (or ModuleList: indexed and iterated alike) that holds a run of layers."""
    return cast(torch.nn.Sequential, model.get_submodule(run.parent))


def run_layers(model: torch.nn.Module, run: SequentialRun) -> list[torch.nn.Module]:
    return list(run_container(model, run))[run.start : run.stop]


def segment_members(model: torch.nn.Module, segment: Segment) -> list[str]:
    """The modules of a segment: its first and last unit and the siblings between them (one container)."""
    parent, _, start = segment.first.rpartition(".")
    last_parent, _, stop = segment.last.rpartition(".")
    holder = model.get_submodule(parent)
    names = [child for child, _ in holder.named_children()]
    if parent != last_parent or start not in names or stop not in names or names.index(stop) <= names.index(start):
        raise PlanMismatchError(
            f"segment {segment.name!r}: {segment.first} and {segment.last} are not two children of one module, in order"
        )
    prefix = f"{parent}." if parent else ""
    return [prefix + child for child in names[names.index(start) : names.index(stop) + 1]]


def unit_endpoints(model: torch.nn.Module, unit: Unit) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The first and last module a unit runs: the unit itself, or the ends of a Sequential run or a segment."""
    if isinstance(unit, Segment):
        members = segment_members(model, unit)
        return model.get_submodule(members[0]), model.get_submodule(members[-1])
    if isinstance(unit, SequentialRun):
        parent = run_container(model, unit)
        return parent[unit.start], parent[unit.stop - 1]
    module = unit_module(model, unit)
    return module, module


def unit_module(model: torch.nn.Module, unit: Unit) -> torch.nn.Module:
    """The module that computes a unit; for a Sequential run, a new Sequential of the same layers.

    A graph run is the submodule of its name on the planner's split GraphModule (`planned.graph`)."""
    if isinstance(unit, CallSite):
        return model.get_submodule(unit.module)
    if isinstance(unit, SequentialRun):
        return torch.nn.Sequential(*run_layers(model, unit))
    if isinstance(unit, Segment):
        raise ValueError(f"a segment ({unit.name!r}) is several modules; ask for its members (segment_members)")
    return model.get_submodule(unit.name)


def match_units(units: list[str], patterns: str | list[str], what: str) -> set[str]:
    """The units matching any of `patterns`; every pattern must match one, or UnitPatternError says which."""
    if isinstance(patterns, str):
        patterns = [patterns]
    matched = {u for u in units if any(fnmatch.fnmatchcase(u, p) for p in patterns)}
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(u, p) for u in units)]
    if unmatched:
        raise UnitPatternError(f"{what}={unmatched} matched no unit; the units are: {', '.join(units)}")
    return matched
