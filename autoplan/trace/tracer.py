"""Trace stage: find the units of a model and the graph of how data flows between them.

Units are what the plan decides about. Found in this order:
1. `units=["layers.*"]`: modules whose qualified names match the patterns (outermost wins);
2. a Hugging Face model's layers (its `GradientCheckpointingLayer`s: encoder and decoder layers);
   else the submodule class a model repeats that covers the most parameters (transformer blocks,
   ResNet blocks, U-Net conv blocks);
3. a model with no repeated class but an `nn.Sequential` backbone: runs of its children cut at
   the articulation points of their dataflow graph, one parametric layer per unit
   (named like `"net[0:2]"`);
4. otherwise, runs of the fx graph's nodes between articulation points (`planned.graph`, named
   like `"graph[fc1:relu]"`); the planner then works on a GraphModule that calls one submodule
   per run, made of the model's own layers.

The model is traced with `torch.fx.symbolic_trace` (units kept as leaf calls), else with
`torch.export.export(strict=False)`, whose graph is fx too, else by running it once on fake tensors
with hooks on the units (`trace.dataflow`; first for Hugging Face models). The unit graph (networkx) says which
unit feeds which; edges between non-neighbours are skip connections whose tensors stay alive
across units.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.errors import OptionError, TraceError
from autoplan.inputs.batch import normalize_inputs
from autoplan.vocabulary.formatting import first_line
from autoplan.vocabulary.tensors import tensors_of
from autoplan.planned.graph import split_by_units
from autoplan.instruments.routing import WORST_CASE, MoeRoutingBound
from autoplan.units import CallSite, GraphRun, SequentialRun, Unit
from autoplan.trace.discovery import find_units


@dataclass(frozen=True)
class Traced:
    """A model, its example inputs, its units and the graph between them."""

    model: torch.nn.Module  # the model; for graph units, a GraphModule of its layers, one submodule per unit
    example_inputs: tuple[tuple, dict]  # (args, kwargs)
    units: tuple[Unit, ...]  # in execution order when the graph is known
    graph: torch.fx.Graph | None  # None when the units were found by running the model ("hooks")
    method: str  # "symbolic_trace", "export" or "hooks"
    unit_graph: nx.DiGraph  # unit -> unit dataflow ("input" and "output" included)
    skip_edges: tuple[tuple[str, str], ...]  # dataflow between units that are not neighbours
    trace_errors: tuple[str, ...] = ()  # what each tracer tripped on, when one did
    never_ran: tuple[str, ...] = ()  # units found in the model that its forward never calls: not planned
    routing: MoeRoutingBound = WORST_CASE  # how every fake-tensor run of this model answers data-dependent expert routing
    draws: str = "high"  # the value small random draws take in every fake-tensor run ("high" or "low": `instruments.values`)
    random_reads: int = 0  # values computed from random draws the forward read (LayerDrop): random control flow
    # FSDP2's MixedPrecisionPolicy: every simulation runs the parameters cast to this dtype, and the floating inputs as
    # the root casts them (`profile.simulation.simulation_model`); None: as they are
    parameter_dtype: torch.dtype | None = None

    @property
    def unit_names(self) -> tuple[str, ...]:
        return tuple(unit.name for unit in self.units)


# What a failure under fake tensors most often is, and its fix (trace and profile both run there).
FAKE_TENSOR_HINT = (
    "autoplan runs the forward on fake tensors, which carry the example batch's values (and what is computed from "
    "them alone) but no values computed from the weights: code that reads such a value (`if x.sum() > 0` on "
    "activations, `.item()`, `.tolist()`) cannot run there. Compute it with tensor ops (torch.where) or move it out "
    "of forward."
)


META_BATCH_HINT = (
    "the example batch is on the meta device, which has no values to read: pass a real batch (example_inputs=..., "
    "a few real rows are enough), and the values the forward reads (image grids, labels, lengths) are taken from it."
)


def _value_hint(inputs: tuple[tuple, dict]) -> str:
    """What to do when the forward needed a value: a real batch, when the example one has none."""
    on_meta = any(tensor.device.type == "meta" for tensor in tensors_of(inputs))
    return FAKE_TENSOR_HINT + (" Here, " + META_BATCH_HINT if on_meta else "")


# -- finding units ------------------------------------------------------------------------


# -- tracing ------------------------------------------------------------------------------

class _UnitLeafTracer(torch.fx.Tracer):
    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, module: torch.nn.Module, qualified_name: str) -> bool:
        return qualified_name in self.leaves or super().is_leaf_module(module, qualified_name)


def _symbolic_trace(model: torch.nn.Module, leaves: set[str]) -> torch.fx.Graph:
    with _EagerDraws() as draws:
        graph = _UnitLeafTracer(leaves).trace(model)
    if draws.seen:
        # torch.fx runs what does not depend on the inputs for real, so `torch.rand([]) < p` was decided once,
        # at random, and the graph holds that branch: LayerDrop would leave layers out of the plan at random
        raise RuntimeError(f"the forward draws random numbers ({draws.seen}) that the traced graph would fix at one "
                           "random value (random control flow, such as LayerDrop)")
    return graph


class _EagerDraws(TorchDispatchMode):
    """Notes random ops run for real (outside the graph) while torch.fx traces."""

    seen = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags and not self.seen:
            self.seen = func.__name__
        return func(*args, **(kwargs or {}))


def _export(model: torch.nn.Module, inputs: tuple[tuple, dict]) -> torch.fx.Graph:
    args, kwargs = inputs
    # export prints the whole graph (and warns) when it meets a value it cannot guard on; the error says enough
    quiet = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return torch.export.export(model, args, kwargs, strict=False).graph
    finally:
        quiet.setLevel(level)


def _node_unit(node: torch.fx.Node, module_units: dict[str, str]) -> str | None:
    if node.op == "call_module":
        return module_units.get(str(node.target))
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        path = re.sub(r"^L\['self'\]\.?", "", str(path)).replace("._modules['", ".").replace("']", "")
        if path in module_units:
            return module_units[path]
    return None


def _unit_graph(graph: torch.fx.Graph, units: list[Unit]) -> tuple[list[str], nx.DiGraph]:
    """Which unit's output reaches which unit's input (by name), through the ops between them."""
    module_units: dict[str, str] = {}
    for unit in units:
        for layer in unit.layer_names() if isinstance(unit, SequentialRun) else [unit.name]:
            module_units[layer] = unit.name
    # a unit module called several times (shared weights) is one unit per call: "block@0", "block@1", ...
    names = {unit.name for unit in units}
    calls = Counter(str(node.target) for node in graph.nodes if node.op == "call_module" and str(node.target) in names)
    seen: Counter[str] = Counter()
    sources: dict[torch.fx.Node, set[str]] = {}
    order: list[str] = []
    dataflow = nx.DiGraph()
    dataflow.add_nodes_from(["input", "output"])
    for node in graph.nodes:
        owner = _node_unit(node, module_units)
        if owner is not None and node.op == "call_module" and calls[owner] > 1:
            seen[owner] += 1
            owner = CallSite(owner, seen[owner] - 1).name
        incoming = set().union(*(sources.get(arg, set()) for arg in node.all_input_nodes)) if node.all_input_nodes else set()
        if node.op == "placeholder":
            sources[node] = {"input"}
        elif owner is not None:
            if owner not in order:
                order.append(owner)
                dataflow.add_node(owner)
            for source in incoming - {owner}:
                dataflow.add_edge(source, owner)
            sources[node] = {owner}
        else:
            sources[node] = incoming
            if node.op == "output":
                for source in incoming:
                    dataflow.add_edge(source, "output")
    return order, dataflow


def trace(
    model: torch.nn.Module, example_inputs: Any, units: list[str] | None = None, *, unit_names: tuple[Unit, ...] | None = None,
    routing: MoeRoutingBound = WORST_CASE,
) -> Traced:
    """Find the units of `model` and trace how data flows between them.

    Tracers are tried in order: `torch.fx.symbolic_trace`, `torch.export(strict=False)`, then a
    forward on fake tensors with hooks (`trace.dataflow`, method "hooks", no fx graph). Hugging Face
    models start with the hooks: export of a large one takes seconds per layer, and symbolic_trace
    cannot follow their keyword-only forwards. `routing`: how mixture-of-experts routing whose shapes
    depend on the data is profiled (`instruments.routing`); the later stages read it from the result.
    """
    from autoplan.inputs.hf_models import is_hf_model

    inputs = normalize_inputs(example_inputs)
    found = list(unit_names) if unit_names else find_units(model, units)  # unit_names: one level of `unit_levels`
    graph_runs = [unit for unit in found if isinstance(unit, GraphRun)]
    if graph_runs and len(graph_runs) == len(found):
        model = split_by_units(model, graph_runs)  # the same layers, one submodule per unit
    leaves = {u.name for u in found if not isinstance(u, SequentialRun)}
    labels = {"symbolic_trace": "torch.fx.symbolic_trace", "export": "torch.export(strict=False)", "hooks": "a forward on fake tensors"}
    order = ("hooks", "export") if is_hf_model(model) else ("symbolic_trace", "export", "hooks")
    errors: list[str] = []
    for method in order:
        graph: torch.fx.Graph | None = None
        try:
            if method == "hooks":
                executed, dataflow, random_reads, draws = _worst_case_draws(model, inputs, found, routing)
            else:
                graph = _symbolic_trace(model, leaves) if method == "symbolic_trace" else _export(model, inputs)
        except OptionError:
            raise  # an option the model cannot run with (a sequence tensor parallelism cannot split), whichever tracer ran it
        except Exception as error:  # noqa: BLE001 - any failure means: try the next tracer
            label = labels[method]
            errors.append(f"{label}: {first_line(error)}" if method == "hooks" else f"{label}: {type(error).__name__}: {first_line(error)}")
            continue
        if graph is not None:
            draws, random_reads = "high", 0
            executed, dataflow = _unit_graph(graph, found)
        traced = _traced(model, inputs, found, graph, method, executed, dataflow, errors)
        return dataclasses.replace(traced, routing=routing, draws=draws, random_reads=random_reads)
    raise TraceError(
        f"could not trace {type(model).__name__}:\n  " + "\n  ".join(errors) + "\n" + _value_hint(inputs) + " If the "
        "units were the problem, name the submodules to plan, e.g. its blocks (units=['pattern', ...]; --units on the "
        "command line)."
    )


def _worst_case_draws(model, inputs, unit_names, routing) -> tuple[list[str], nx.DiGraph, int, str]:
    """The forward on fake tensors with the random draws that run the most units: the worst case.

    Random control flow (LayerDrop's `torch.rand([]) < p`, stochastic depth as a branch) skips
    layers at random in training; a plan must hold when none is skipped. Draws at the top of their
    range make `rand < p` false (every layer runs); a forward that skips on `rand > p` instead runs
    every layer with draws at the bottom, so both are tried when the first skipped a unit.
    """
    from autoplan.trace.dataflow import runtime_unit_graph

    executed, dataflow, random_reads = runtime_unit_graph(model, inputs, unit_names, routing, "high")
    skipped = _never_ran(unit_names, executed)
    if not random_reads or not skipped:
        return executed, dataflow, random_reads, "high"
    low = runtime_unit_graph(model, inputs, unit_names, routing, "low")
    if len(_never_ran(unit_names, low[0])) < len(skipped):
        return (*low, "low")
    return executed, dataflow, random_reads, "high"


def _never_ran(units: list[Unit], executed: list[str]) -> tuple[str, ...]:
    """The units the forward never called (a module called several times counts once it ran at all)."""
    sites = [Unit.from_name(name) for name in executed]  # the names this stage gave the calls it saw
    called = {site.module for site in sites if isinstance(site, CallSite)}  # units planned per call site
    return tuple(u.name for u in units if u.name not in executed and u.name not in called)


def _traced(model, inputs, unit_names, graph, method, executed, dataflow, errors) -> Traced:
    # A unit the forward never calls (a layer built but unused, a branch not taken) has nothing to plan:
    # it is left out, and the plan names it. When a tracer placed no unit at all, none is left out.
    never_ran = _never_ran(unit_names, executed) if executed else ()
    ordered = list(executed) if executed else [unit.name for unit in unit_names]
    neighbours = {(a, b) for a, b in zip(["input", *ordered], [*ordered, "output"])}
    skips = tuple(sorted((a, b) for a, b in dataflow.edges if (a, b) not in neighbours and a != "input" and b != "output"))
    found = {unit.name: unit for unit in unit_names}
    units = tuple(found.get(name) or Unit.from_name(name) for name in ordered)  # a call site is named here, by this stage
    return Traced(model, inputs, units, graph, method, dataflow, skips, tuple(errors), never_ran)
