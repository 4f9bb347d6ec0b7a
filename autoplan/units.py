"""Units, typed: the parts of a model a plan decides about, each kind with its parts as fields.

- `ModuleUnit`: a submodule, by its qualified name, e.g. "transformer.h.3";
- `SequentialRun`: layers [start, stop) of an nn.Sequential (or ModuleList), "features[0:4]";
- `GraphRun`: a run of fx graph nodes, by its first and last node, "graph[fc1:relu]" (`planned.graph`);
- `CallSite`: one call of a module that runs several times per forward, "block@2" (its third call);
- `Segment`: consecutive units checkpointed as one region, "layers.0–layers.3" (its first and last
  unit, an en dash between; `memory.segment_terms`).

A unit's `name` is what patterns (`units=["layers.*"]`), the JSON and the reports use. The trace
stage builds the units where it finds them and every later stage asks a unit for its kind and
parts; `Unit.from_name` is the one place a name is read back into a unit (the trace stage's own
names, and a plan written by hand). Part of the vocabulary: imports nothing of autoplan, so the
Plan's decisions can hold their units.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import ClassVar


class UnitKind(enum.Enum):
    MODULE = "module"
    SEQUENTIAL_RUN = "Sequential run"
    GRAPH_RUN = "graph run"
    CALL_SITE = "call site"
    SEGMENT = "segment"


SEGMENT_DASH = "\u2013"  # an en dash: no module or run name contains one
_RUN = re.compile(r"^(?P<parent>.*)\[(?P<start>\d+):(?P<stop>\d+)\]$")
_GRAPH = re.compile(r"^graph\[(?P<first>[A-Za-z_][\w]*):(?P<last>[A-Za-z_][\w]*)\]$")
_CALL = re.compile(r"^(?P<module>.+)@(?P<index>\d+)$")
_NUMBERED = re.compile(r"^(?P<stem>.*?)(?P<index>\d+)$")


@dataclass(frozen=True)
class Unit:
    """One unit of a model; its subclasses are the kinds (the module docstring)."""

    kind: ClassVar[UnitKind]

    @property
    def name(self) -> str:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name

    def numbered(self) -> tuple[str, int] | None:
        """The numbered series it belongs to and its number in it ("layers.", 3 for "layers.3";
        "block@", 2 for "block@2"), for reports that fold a run of alike units into one row; None
        for a unit that is not numbered (a run or a segment)."""
        return None

    @staticmethod
    def from_name(name: str) -> Unit:
        """The unit a name denotes: the one parser of unit names (see the module docstring)."""
        first, dash, last = name.partition(SEGMENT_DASH)
        if dash and first and last:
            return Segment(first, last)
        match = _GRAPH.match(name)
        if match is not None:
            return GraphRun(match["first"], match["last"])
        match = _RUN.match(name)
        if match is not None:
            return SequentialRun(match["parent"], int(match["start"]), int(match["stop"]))
        match = _CALL.match(name)
        if match is not None:
            return CallSite(match["module"], int(match["index"]))
        return ModuleUnit(name)


@dataclass(frozen=True)
class ModuleUnit(Unit):
    """A submodule, by its qualified name."""

    kind: ClassVar[UnitKind] = UnitKind.MODULE
    path: str

    @property
    def name(self) -> str:
        return self.path

    @property
    def parent(self) -> str:
        """The qualified name of the module that holds it ("" for a child of the model)."""
        return self.path.rpartition(".")[0]

    @property
    def child(self) -> str:
        """Its name inside its parent: "3" for "layers.3"."""
        return self.path.rpartition(".")[2]

    def numbered(self) -> tuple[str, int] | None:
        match = _NUMBERED.match(self.path)  # "layers.3", and "layer3" beside "layer2" in a ResNet
        return None if match is None else (match["stem"], int(match["index"]))


@dataclass(frozen=True)
class SequentialRun(Unit):
    """Layers [start, stop) of the nn.Sequential (or ModuleList) named `parent`."""

    kind: ClassVar[UnitKind] = UnitKind.SEQUENTIAL_RUN
    parent: str
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"{self.parent}[{self.start}:{self.stop}]"

    def layer_names(self) -> list[str]:
        prefix = f"{self.parent}." if self.parent else ""
        return [f"{prefix}{i}" for i in range(self.start, self.stop)]


@dataclass(frozen=True)
class GraphRun(Unit):
    """The fx graph nodes from `first` to `last` (`planned.graph`); on the planner's split
    GraphModule, the submodule of the same name."""

    kind: ClassVar[UnitKind] = UnitKind.GRAPH_RUN
    first: str
    last: str

    @property
    def name(self) -> str:
        return f"graph[{self.first}:{self.last}]"


@dataclass(frozen=True)
class CallSite(Unit):
    """Call number `index` (from 0, per forward) of the module named `module`."""

    kind: ClassVar[UnitKind] = UnitKind.CALL_SITE
    module: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.module}@{self.index}"

    def numbered(self) -> tuple[str, int] | None:
        return f"{self.module}@", self.index


@dataclass(frozen=True)
class Segment(Unit):
    """The consecutive children of one module from `first` to `last` (qualified names), checkpointed
    as one region; which children lie between is the model's (`vocabulary.names.segment_members`)."""

    kind: ClassVar[UnitKind] = UnitKind.SEGMENT
    first: str
    last: str

    @property
    def name(self) -> str:
        return f"{self.first}{SEGMENT_DASH}{self.last}"
