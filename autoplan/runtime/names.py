"""Unit names: what each kind of unit name means, and the one parser for each.

- a submodule's qualified name, e.g. "transformer.h.3";
- a run of an nn.Sequential's layers, "features[0:4]" (parent "features", layers 0 to 3);
- a run of graph nodes, "graph[fc1:relu]" (first and last fx node; see `runtime.graph`);
- one call of a module that runs several times per forward, "block@2" (its third call).

Patterns (`units=["layers.*"]`) are shell-style, matched with fnmatch against these names.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

import torch

from autoplan.errors import UnitPatternError

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
        return list(model.get_submodule(self.parent))[self.start : self.stop]


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


def is_range_unit(name: str) -> bool:
    return sequential_run(name) is not None


def is_graph_unit(name: str) -> bool:
    return GRAPH_UNIT.match(name) is not None


def unit_endpoints(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The first and last module a unit runs: the unit itself, or the ends of a Sequential run."""
    site = call_site(name)
    if site is not None:
        module = model.get_submodule(site.module)
        return module, module
    run = sequential_run(name)
    if run is None:
        module = model.get_submodule(name)
        return module, module
    parent = model.get_submodule(run.parent)
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
