"""Units for models with no repeated block and no nn.Sequential: runs of graph nodes.

The model is traced with `torch.fx.symbolic_trace`; a node every path from the inputs to the
output passes through (an articulation point of the dataflow graph that separates them) is a
place the model can be cut with one tensor crossing. Between consecutive cuts lie runs of nodes;
runs are grouped so that each unit starts at a run with parameters (one parametric layer per
unit, like a Sequential's). A unit is named after its first and last node: `"graph[fc1:relu]"`.
Parameters a forward uses directly (`x * self.scale`) are handed to the unit as arguments.

To plan and rewrite such units, `split_by_units` cuts the traced graph into one GraphModule per
unit (torch.fx's `split_module`), held by a GraphModule that calls them in order; their layers are
the model's own module objects. The planner runs on that module; `planned.forwards.apply_choices`
sets its forward on the model's instance.
"""

from __future__ import annotations

from typing import Sequence

import networkx as nx
import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from autoplan.errors import PlanMismatchError
from autoplan.units import GraphRun


class GraphRunModule(torch.nn.Module):
    """One graph unit: a plain module around its GraphModule, so its forward can be replaced on the
    instance like any unit's (torch.compile inlines GraphModules by their class's code)."""

    def __init__(self, run: torch.fx.GraphModule) -> None:
        super().__init__()
        self.run = run

    def forward(self, *args, **kwargs):
        return self.run(*args, **kwargs)


def split_by_units(model: torch.nn.Module, units: Sequence[GraphRun]) -> torch.fx.GraphModule:
    """A GraphModule that computes `model`'s forward through one submodule per graph unit, named as the unit."""
    traced = torch.fx.symbolic_trace(model)
    nodes = _compute_nodes(traced.graph)
    position = {node.name: i for i, node in enumerate(nodes)}
    names = [unit.name for unit in units]
    bounds = []
    for unit in units:
        if unit.first not in position or unit.last not in position:
            raise PlanMismatchError(
                f"{unit.name!r} is not a run of {type(model).__name__}'s graph; its graph units are: {[u.name for u in graph_units(model)]}"
            )
        bounds.append((position[unit.first], position[unit.last]))
    unit_of: dict[str, int] = {}
    order = sorted(range(len(names)), key=lambda i: bounds[i])
    for index, at in enumerate(order):
        first, last = bounds[at]
        for node in nodes[first : last + 1]:
            unit_of[node.name] = index
    missing = [node.name for node in nodes if node.name not in unit_of]
    if missing:
        raise PlanMismatchError(f"graph units {names} leave nodes {missing} of {type(model).__name__} outside every unit")
    split = split_module(traced, model, lambda node: unit_of[node.name])
    for node in split.graph.nodes:
        if node.op == "call_module" and str(node.target).startswith("submod_"):
            module = getattr(split, node.target)
            delattr(split, node.target)
            name = names[order[int(str(node.target)[len("submod_") :])]]
            split.add_submodule(name, GraphRunModule(module))
            node.target = name
    split.recompile()
    return torch.fx.GraphModule(split, split.graph, class_name=type(model).__name__)


_IGNORED = ("placeholder", "output", "get_attr")


def _compute_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [node for node in graph.nodes if node.op not in _IGNORED]


def _cut_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes that separate every input from the output."""
    dataflow = nx.Graph()
    output = next(node for node in graph.nodes if node.op == "output")
    for node in graph.nodes:
        if node.op == "get_attr":
            continue  # a parameter is not an activation: it does not join distant layers
        dataflow.add_node(node)
        if node.op == "placeholder":
            dataflow.add_edge("inputs", node)
        for source in node.all_input_nodes:
            if source.op != "get_attr":
                dataflow.add_edge(source, node)
    cuts = set()
    for node in nx.articulation_points(dataflow):
        if isinstance(node, torch.fx.Node) and node.op not in _IGNORED:
            rest = nx.restricted_view(dataflow, [node], [])
            if not nx.has_path(rest, "inputs", output):
                cuts.add(node)
    return cuts


def _has_parameters(node: torch.fx.Node, root: torch.nn.Module) -> bool:
    if node.op == "call_module":
        return any(True for _ in root.get_submodule(str(node.target)).parameters())
    return any(
        source.op == "get_attr" and isinstance(_attr(root, str(source.target)), torch.nn.Parameter)
        for source in node.all_input_nodes
    )


def _attr(root: torch.nn.Module, target: str):
    value = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def graph_units(model: torch.nn.Module) -> list[GraphRun]:
    """The graph units of `model` from its fx graph, or [] when it cannot be traced or cut in two."""
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # noqa: BLE001 - untraceable: the caller explains what to do instead
        return []
    nodes = _compute_nodes(graph)
    cuts = _cut_nodes(graph)
    runs: list[list[torch.fx.Node]] = [[]]
    for node in nodes:
        runs[-1].append(node)
        if node in cuts:
            runs.append([])
    runs = [run for run in runs if run]
    units: list[list[torch.fx.Node]] = []
    for run in runs:
        if not units or any(_has_parameters(node, model) for node in run):
            units.append(list(run))
        else:
            units[-1].extend(run)
    if len(units) >= 2 and not any(_has_parameters(node, model) for node in units[0]):
        units[1] = units[0] + units[1]
        units.pop(0)
    if len(units) < 2:
        return []
    return [GraphRun(unit[0].name, unit[-1].name) for unit in units]
