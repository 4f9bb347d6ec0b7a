"""Unit names: what each kind of unit name means, and the one parser for each.

- a submodule's qualified name, e.g. "transformer.h.3";
- a run of an nn.Sequential's layers, "features[0:4]" (parent "features", layers 0 to 3);
- a run of graph nodes, "graph[fc1:relu]" (first and last fx node; see `planned.graph`);
- one call of a module that runs several times per forward, "block@2" (its third call);
- a segment: consecutive units checkpointed as one region, "layers.0–layers.3" (first and last
  unit, an en dash between; `planned.segments`).

Patterns (`units=["layers.*"]`) are shell-style, matched with fnmatch against these names.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import cast

import torch

from autoplan.errors import PlanMismatchError, UnitPatternError

RANGE_UNIT = re.compile(r"^(?P<parent>.*)\[(?P<start>\d+):(?P<stop>\d+)\]$")
GRAPH_UNIT = re.compile(r"^graph\[(?P<first>[A-Za-z_][\w]*):(?P<last>[A-Za-z_][\w]*)\]$")
CALL_UNIT = re.compile(r"^(?P<module>.+)@(?P<index>\d+)$")


@dataclass(frozen=True)
class SequentialRun:
    """A unit that is layers [start, stop) of the nn.Sequential named `parent`."""

    parent: str
    start: int
    stop: int

    def layer_names(self) -> list[str]:
        prefix = f"{self.parent}." if self.parent else ""
        return [f"{prefix}{i}" for i in range(self.start, self.stop)]

    def layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return list(_container(model, self.parent))[self.start : self.stop]


def _container(model: torch.nn.Module, name: str) -> torch.nn.Sequential:
    """The Sequential (or ModuleList: indexed and iterated alike) that holds a run of layers."""
    return cast(torch.nn.Sequential, model.get_submodule(name))


def sequential_run(name: str) -> SequentialRun | None:
    """The Sequential run a unit name denotes, or None for any other kind of unit."""
    match = RANGE_UNIT.match(name)
    if match is None:
        return None
    return SequentialRun(match["parent"], int(match["start"]), int(match["stop"]))


@dataclass(frozen=True)
class CallSite:
    """A unit that is call number `index` (from 0, per forward) of the module named `module`."""

    module: str
    index: int

    @property
    def name(self) -> str:
        return call_site_name(self.module, self.index)


def call_site(name: str) -> CallSite | None:
    """The call of a module a unit name denotes, or None for any other kind of unit."""
    match = CALL_UNIT.match(name)
    return None if match is None else CallSite(match["module"], int(match["index"]))


def call_site_name(module: str, index: int) -> str:
    return f"{module}@{index}"


SEGMENT_DASH = "\u2013"  # an en dash: no module or run name contains one


@dataclass(frozen=True)
class Segment:
    """A unit that is the consecutive units `members` (forward order), checkpointed as one region."""

    members: tuple[str, ...]

    @property
    def name(self) -> str:
        return segment_name(self.members[0], self.members[-1])


def segment_name(first: str, last: str) -> str:
    return f"{first}{SEGMENT_DASH}{last}"


def segment_ends(name: str) -> tuple[str, str] | None:
    """The first and last unit a segment name denotes, or None for any other kind of unit."""
    first, dash, last = name.partition(SEGMENT_DASH)
    return (first, last) if dash and first and last else None


def segment_members(model: torch.nn.Module, name: str) -> list[str]:
    """The modules of a segment: its first and last unit and the siblings between them (one container)."""
    ends = segment_ends(name)
    if ends is None:
        raise ValueError(f"{name!r} is not a segment name")
    first, last = ends
    parent, _, start = first.rpartition(".")
    last_parent, _, stop = last.rpartition(".")
    holder = model.get_submodule(parent)
    names = [child for child, _ in holder.named_children()]
    if parent != last_parent or start not in names or stop not in names or names.index(stop) <= names.index(start):
        raise PlanMismatchError(f"segment {name!r}: {first} and {last} are not two children of one module, in order")
    prefix = f"{parent}." if parent else ""
    return [prefix + child for child in names[names.index(start) : names.index(stop) + 1]]


def is_range_unit(name: str) -> bool:
    return sequential_run(name) is not None


def is_graph_unit(name: str) -> bool:
    return GRAPH_UNIT.match(name) is not None


def unit_endpoints(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The first and last module a unit runs: the unit itself, or the ends of a Sequential run or a segment."""
    ends = segment_ends(name)
    if ends is not None:
        members = segment_members(model, name)
        return model.get_submodule(members[0]), model.get_submodule(members[-1])
    site = call_site(name)
    if site is not None:
        module = model.get_submodule(site.module)
        return module, module
    run = sequential_run(name)
    if run is None:
        module = model.get_submodule(name)
        return module, module
    parent = _container(model, run.parent)
    return parent[run.start], parent[run.stop - 1]


def unit_module(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """The module that computes a unit; for a Sequential run, a new Sequential of the same layers."""
    site = call_site(name)
    if site is not None:
        return model.get_submodule(site.module)
    run = sequential_run(name)
    if run is None:
        return model.get_submodule(name)
    return torch.nn.Sequential(*run.layers(model))


def match_units(units: list[str], patterns: str | list[str], what: str) -> set[str]:
    """The units matching any of `patterns`; every pattern must match one, or UnitPatternError says which."""
    if isinstance(patterns, str):
        patterns = [patterns]
    matched = {u for u in units if any(fnmatch.fnmatchcase(u, p) for p in patterns)}
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(u, p) for u in units)]
    if unmatched:
        raise UnitPatternError(f"{what}={unmatched} matched no unit; the units are: {', '.join(units)}")
    return matched
