"""Unit discovery: which parts of a model the plan decides about.

In order of preference: the layers transformers marks as checkpointable, submodules of a class the
model repeats (its blocks), runs of an nn.Sequential's layers between cut points, and, for a model
with none of these, runs of fx graph nodes (`runtime.graph.graph_units`). `units=` patterns name
them instead.
"""

from __future__ import annotations

import fnmatch
from collections import defaultdict

import networkx as nx
import torch

from autoplan.errors import TraceError, UnitPatternError
from autoplan.runtime.graph import graph_units
from autoplan.runtime.training import parameter_count

_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


def _outermost(names: list[str]) -> list[str]:
    kept: list[str] = []
    for name in sorted(names, key=lambda n: n.count(".")):
        if not any(name.startswith(outer + ".") for outer in kept):
            kept.append(name)
    return kept


def _repeated_class_units(model: torch.nn.Module) -> list[str]:
    by_class: dict[type, list[str]] = defaultdict(list)
    for name, module in model.named_modules():
        cls = type(module)
        if not name or isinstance(module, _CONTAINERS) or cls.__module__.startswith("torch.nn."):
            continue
        if parameter_count(module) > 0:
            by_class[cls].append(name)

    def coverage(names: list[str]) -> tuple[int, int]:
        outer = _outermost(names)
        return sum(parameter_count(model.get_submodule(n)) for n in outer), -min(n.count(".") for n in outer)

    candidates = {cls: _outermost(names) for cls, names in by_class.items() if len(_outermost(names)) >= 2}
    if not candidates:
        return []
    best = max(candidates, key=lambda cls: coverage(candidates[cls]))
    return candidates[best]


def _checkpointing_layer_units(model: torch.nn.Module) -> list[str]:
    """A transformers model's own layers: what it would checkpoint itself (`GradientCheckpointingLayer`).

    Covers encoder and decoder layers of different classes (Whisper) and both stacks of T5.
    Recognised by class name in the MRO, so transformers need not be installed.
    """
    names = [
        name
        for name, module in model.named_modules()
        if name and any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__[1:])
    ]
    outer = _outermost(names)
    return outer if len(outer) >= 2 else []


def _sequential_units(model: torch.nn.Module) -> list[str]:
    """Cut the longest Sequential into runs that each start at a layer with parameters."""
    sequentials = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Sequential) and len(m) >= 2]
    if not sequentials:
        return []
    name, seq = max(sequentials, key=lambda item: (parameter_count(item[1]), -item[0].count(".")))
    chain = nx.path_graph(["input", *range(len(seq)), "output"])
    cut_points = set(nx.articulation_points(chain))  # in a Sequential every layer boundary is one
    starts = [i for i in range(len(seq)) if i in cut_points and parameter_count(seq[i]) > 0]
    if len(starts) < 2:
        return []
    starts[0] = 0
    bounds = starts + [len(seq)]
    return [f"{name}[{a}:{b}]" for a, b in zip(bounds, bounds[1:])]


def find_units(model: torch.nn.Module, patterns: list[str] | None = None) -> list[str]:
    """Names of the modules (or Sequential runs) the plan will decide about."""
    if patterns:
        if isinstance(patterns, str):
            patterns = [patterns]
        names = [n for n, _ in model.named_modules() if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if not names:
            tops = ", ".join(n for n, _ in model.named_children()) or "(none)"
            raise UnitPatternError(
                f"units={patterns} matched no submodule of {type(model).__name__}; "
                f"its top-level submodules are: {tops}. Patterns match qualified names like 'layers.*'."
            )
        return _outermost(names)
    units = _checkpointing_layer_units(model) or _repeated_class_units(model) or _sequential_units(model) or graph_units(model)
    if not units:
        raise TraceError(
            f"{type(model).__name__} has no repeated submodule, no nn.Sequential, and no fx graph that cuts "
            "into two or more parametric runs; pass units=['name.pattern', ...] naming the submodules to plan."
        )
    return units
