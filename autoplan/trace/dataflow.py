"""Runtime dataflow: which unit feeds which, recorded by running the forward once on fake tensors.

The third way `trace.tracer` learns the unit graph, for models neither `torch.fx.symbolic_trace` nor
`torch.export` can trace (and first for Hugging Face models, where export is slow and their
caches and kwargs trip both tracers). A forward of a FakeTensor twin runs with hooks on the units
that say which unit is running, and a dispatch mode that labels every tensor an op creates with
where its data came from: the unit it was made in, or, outside the units, everything its inputs
came from. A unit reading a tensor labelled with another unit (or with "input") is an edge. Python
control flow on shapes or config flags, keyword-only forwards, dict/dataclass outputs and caches are
all just Python here; what cannot run is code that needs a tensor's *values* (`if x.sum() > 0`),
and the error says where that is.
"""

from __future__ import annotations

import weakref
from collections import Counter

import networkx as nx
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.instruments.fake import fake_copy, fake_tree, new_fake_mode
from autoplan.instruments.routing import WORST_CASE, MoeRoutingBound
from autoplan.vocabulary.formatting import first_line, where_in_user_code
from autoplan.units import CallSite, Unit
from autoplan.vocabulary.tensors import tensors_of


class _Provenance(TorchDispatchMode):
    """Labels each storage with the units (or "input") its data came from."""

    def __init__(self) -> None:
        super().__init__()
        self._labels: dict[int, tuple[weakref.ref, frozenset[str]]] = {}
        self.running: list[str] = []  # the unit whose forward is running (a stack, for safety)
        self.edges: set[tuple[str, str]] = set()

    def label(self, tensor: torch.Tensor, sources: frozenset[str]) -> None:
        storage = tensor.untyped_storage()
        self._labels[id(storage)] = (weakref.ref(storage), sources)

    def sources(self, tensor: torch.Tensor) -> frozenset[str]:
        storage = tensor.untyped_storage()
        entry = self._labels.get(id(storage))
        # ids are reused once a storage dies; the weak reference tells a stale entry apart
        return entry[1] if entry is not None and entry[0]() is storage else frozenset()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        incoming = frozenset().union(*(self.sources(t) for t in tensors_of((args, kwargs))))
        if self.running:
            unit = self.running[-1]
            self.edges.update((source, unit) for source in incoming if source != unit)
            made = frozenset((unit,))
        else:
            made = incoming
        if made:
            for tensor in tensors_of(out):
                self.label(tensor, made)
        return out


class _UnitCalls:
    """Which unit is running, from forward hooks on each unit's first and last module: every call a unit of its
    own, in call order ("block@0", "block@1"; `runtime_unit_graph` names a module called once back)."""

    def __init__(self, provenance: _Provenance) -> None:
        self.provenance = provenance
        self.order: list[str] = []
        self.calls: Counter[str] = Counter()
        self._running: list[str] = []  # the unit each entry of provenance.running is a call of

    def hook(self, twin: torch.nn.Module, units: list[Unit]) -> list:
        from autoplan.vocabulary.names import unit_endpoints

        handles = []
        for unit in units:
            first, last = unit_endpoints(twin, unit)
            handles.append(first.register_forward_pre_hook(self._enter(unit.name)))
            handles.append(last.register_forward_hook(self._leave(unit.name)))
        return handles

    def _enter(self, name: str):
        def hook(module, args):
            self.calls[name] += 1
            site = CallSite(name, self.calls[name] - 1)
            self.order.append(site.name)
            self.provenance.running.append(site.name)
            self._running.append(name)

        return hook

    def _leave(self, name: str):
        def hook(module, args, output):
            if self._running and self._running[-1] == name:
                self._running.pop()
                self.provenance.running.pop()

        return hook


def runtime_unit_graph(
    model: torch.nn.Module, inputs: tuple[tuple, dict], units: list[Unit], routing: MoeRoutingBound = WORST_CASE, draws: str = "high",
) -> tuple[list[str], nx.DiGraph, int]:
    """Run `model` once on fake tensors; return its units in call order, the unit dataflow graph and
    how many values computed from random draws the forward read (random control flow: `instruments.values`).

    Raises RuntimeError naming the failing line of the model's code when the forward cannot run
    on fake tensors.
    """
    from autoplan.planned.forwards import remove_plan

    fake_mode = new_fake_mode(routing, draws)
    twin = remove_plan(fake_copy(model, fake_mode))
    twin.train()  # the step being planned is a training step: dropout and friends as in training
    provenance = _Provenance()
    calls = _UnitCalls(provenance)
    handles = calls.hook(twin, units)
    try:
        with fake_mode, provenance, torch.no_grad():
            args, kwargs = fake_tree(inputs, fake_mode)
            for tensor in tensors_of((args, kwargs)):
                provenance.label(tensor, frozenset(("input",)))
            output = twin(*args, **kwargs)
            finished = frozenset().union(*(provenance.sources(t) for t in tensors_of(output)))
    except Exception as error:  # noqa: BLE001 - reported with where it happened
        raise RuntimeError(f"{type(error).__name__}: {first_line(error)}{where_in_user_code(error)}") from error
    finally:
        for handle in handles:
            handle.remove()
    graph = nx.DiGraph()
    graph.add_nodes_from(["input", *calls.order, "output"])
    graph.add_edges_from(provenance.edges)
    graph.add_edges_from((source, "output") for source in finished)
    once = {CallSite(name, 0).name: name for name, count in calls.calls.items() if count == 1}
    return [once.get(site, site) for site in calls.order], nx.relabel_nodes(graph, once), fake_mode.values.random_reads
