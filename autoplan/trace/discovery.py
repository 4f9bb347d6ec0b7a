"""Unit discovery: which parts of a model the plan decides about, at every level where blocks nest.

Units are found by structure, not by class name. Two modules are the same block when their
*structural signature* agrees: the tree of their submodules' classes and parameter shapes
(`structural_signature`); modules of one class of the user's own count as repeated too, whatever
their widths. Whatever holds them (`nn.ModuleList`, `nn.ModuleDict`, `nn.Sequential`, a custom
module, at any depth), a repeated block brings its *siblings* (every child with parameters of the
module that holds it; in a Sequential with parameter-free layers, runs of its layers) and its
*cousins* (the same place in another stage: `stages.1.blocks.0` for `stages.0.blocks.1`).

Where blocks nest, there is more than one **level**: stages, then the blocks inside them (a level
goes one deeper when the next one repeats at least twice inside most of its members; members with
nothing repeating inside stay whole, so a level can mix stages and blocks), and the finest level
of every repeated block however deep it sits. Each level is a complete, non-overlapping set of
units; `api.plan` plans every level and keeps the best, so the plan space always holds
"checkpoint every block by hand". Within a level, runs of consecutive blocks the model calls back
to back are segments the same program may choose (`memory.segment_terms`): a stage's blocks as one,
or √n-long runs of them.

Found in this order (`unit_levels`):
1. `units=["layers.*"]`: modules whose qualified names match the patterns (outermost wins);
2. a Hugging Face model's own layers (its `GradientCheckpointingLayer`s: what
   `gradient_checkpointing_enable()` checkpoints), one level;
3. repeated blocks by structure, coarse to fine;
4. a model with nothing repeated: an `nn.Sequential` model cut into runs (one block per run led by
   its first parametric layer's class, then one parametric layer per run); else runs of the fx
   graph between articulation points (`planned.graph`) and the model's own children.
A module that runs several times per forward becomes one unit per call, "block@0", "block@1"
(`trace.tracer`).
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TypeGuard

import torch

from autoplan.errors import TraceError, UnitPatternError
from autoplan.planned.graph import graph_units
from autoplan.units import SequentialRun, Unit
from autoplan.vocabulary.names import unit_module
from autoplan.training.step_parts import parameter_count

_LISTS = (torch.nn.ModuleList, torch.nn.ModuleDict)  # hold blocks, but are never called themselves
MAX_LEVELS = 2  # nested levels of repeated blocks (plus the finest); each level costs a whole profile


@dataclass(frozen=True)
class UnitLevel:
    """One complete set of units the plan may decide about, and where it came from."""

    units: tuple[Unit, ...]
    source: str  # "units= patterns", "transformers layers", "repeated blocks", "Sequential runs", ...


def structural_signature(module: torch.nn.Module) -> tuple:
    """What makes two modules the same block: their submodules' names, classes and parameter shapes."""
    return tuple(
        (name, type(sub).__qualname__, tuple((n, tuple(p.shape)) for n, p in sub.named_parameters(recurse=False)))
        for name, sub in module.named_modules()
    )


def outermost(names: list[str]) -> list[str]:
    """The names no other name of the list contains (`a.b` is inside `a`)."""
    kept: list[str] = []
    for name in sorted(names, key=lambda n: n.count(".")):
        if not any(name.startswith(outer + ".") for outer in kept):
            kept.append(name)
    return kept


def sequential_run(name: str) -> SequentialRun | None:
    """The Sequential run a unit name found here denotes, or None for a module."""
    unit = Unit.from_name(name)
    return unit if isinstance(unit, SequentialRun) else None


def _module_name(unit: str) -> str:
    """The module a unit lives in: itself, or for a Sequential run, the run's first layer."""
    run = sequential_run(unit)
    if run is None:
        return unit
    return run.layer_names()[0]


def _modules_of(unit: str) -> list[str]:
    """The modules a unit runs: itself, or every layer of a Sequential run."""
    run = sequential_run(unit)
    return [unit] if run is None else run.layer_names()


def _overlaps(unit: str, others: list[str]) -> bool:
    """Whether `unit` shares a module with any of `others` (the same one, or one inside the other)."""
    theirs = [m for other in others for m in _modules_of(other)]
    return any(name == o or name.startswith(o + ".") or o.startswith(name + ".") for name in _modules_of(unit) for o in theirs)


def _is_layer(module: torch.nn.Module) -> bool:
    """A single layer (Linear, Conv2d, a norm of the model's own): inside every block, never one itself."""
    return next(module.children(), None) is None


def sequential_runs(name: str, seq: torch.nn.Sequential, starts_at=None) -> list[str]:
    """`seq`'s layers cut into runs (`_runs`), by name."""
    return [run.name for run in _runs(name, seq, starts_at)]


def _runs(name: str, seq: torch.nn.Sequential, starts_at=None) -> list[SequentialRun]:
    """`seq`'s layers cut into runs, each starting at a layer `starts_at` accepts (default: one with
    parameters), so parameter-free layers (ReLU, pooling) ride with the layer before them."""
    accept = starts_at or (lambda layer: parameter_count(layer) > 0)
    starts = [i for i, layer in enumerate(seq) if accept(layer)]
    if not starts:
        return []
    starts[0] = 0
    bounds = starts + [len(seq)]
    return [SequentialRun(name, a, b) for a, b in zip(bounds, bounds[1:])]


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _cut_into_runs(holder: torch.nn.Module) -> TypeGuard[torch.nn.Sequential]:
    """A Sequential with parameter-free layers: its units are runs of layers, not its children."""
    return isinstance(holder, torch.nn.Sequential) and any(parameter_count(child) == 0 for child in holder)


def _siblings(model: torch.nn.Module, name: str, blocks: set[str]) -> list[str]:
    """Every child with parameters of the module that holds `name` (the model, for a top-level one)."""
    parent = _parent(name)
    holder = model.get_submodule(parent)
    if _cut_into_runs(holder):
        return _runs_between_blocks(parent, holder, blocks)
    prefix = f"{parent}." if parent else ""
    return [f"{prefix}{child}" for child, module in holder.named_children() if parameter_count(module) > 0 and not isinstance(module, _LISTS)]


def _runs_between_blocks(parent: str, seq: torch.nn.Sequential, blocks: set[str]) -> list[str]:
    """`seq`'s runs (`sequential_runs`), each repeated block among them a unit of its own, by its
    module name: a block is never also inside a run. The parameter-free layers a run would have
    added to a block (pooling, a flatten after the last one) belong to no unit: they run as written."""
    prefix = f"{parent}." if parent else ""
    units: list[str] = []
    for run in _runs(parent, seq):
        at = [i for i in range(run.start, run.stop) if f"{prefix}{i}" in blocks]
        if not at:
            units.append(run.name)
        # blocks have parameters, so they start runs; only the first run may hold parameter-free layers before one
        units.extend(f"{prefix}{i}" for i in at)
    return units


def _cousins(model: torch.nn.Module, name: str) -> list[str]:
    """Modules at the same place in another stage: `stages.1.blocks.0` for `stages.0.blocks.1`."""
    parts = [r"\d+" if part.isdigit() else re.escape(part) for part in name.split(".")]
    pattern = re.compile("^" + r"\.".join(parts) + "$")
    return [n for n, m in model.named_modules() if n and pattern.match(n) and parameter_count(m) > 0 and not isinstance(m, _LISTS)]


def _groups(model: torch.nn.Module, *, with_members: bool = False) -> list:
    """Repeated modules (one structural signature, or one class of the user's own), each widened to
    its siblings and cousins (with_members: pairs of the repeated modules themselves and that)."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name, module in model.named_modules():
        if not name or isinstance(module, _LISTS) or _is_layer(module) or parameter_count(module) == 0:
            continue
        groups[structural_signature(module)].append(name)
        if not type(module).__module__.startswith("torch.nn."):
            groups[("class", type(module))].append(name)
    widened: dict[tuple[str, ...], tuple[str, ...]] = {}
    for names in groups.values():
        names = outermost(names)
        if len(names) < 2:
            continue
        cousins = {c for n in names for c in _cousins(model, n)}
        blocks = set(names)
        # units never overlap: where a Sequential is cut into runs, its runs stand for its layers
        around = {c for c in cousins if not _cut_into_runs(model.get_submodule(_parent(c)))}
        around |= {s for n in {*names, *cousins} for s in _siblings(model, _module_name(n), blocks)}
        # a sibling or cousin that holds one of the blocks (a module calling a shared block) is not one itself
        found = set(names) | {s for s in around if not any(_module_name(n).startswith(_module_name(s) + ".") for n in names)}
        widened.setdefault(tuple(sorted(outermost(sorted(found)), key=_unit_order(model))), tuple(names))
    if with_members:
        return sorted((members, group) for group, members in widened.items())
    return sorted(widened)


def _unit_order(model: torch.nn.Module):
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}

    def key(unit: str) -> tuple[int, int]:
        run = sequential_run(unit)  # a run sits where its first layer does
        return (order[unit], 0) if run is None else (order[run.layer_names()[0]], 0)

    return key


def _coverage(model: torch.nn.Module, units) -> int:
    return sum(parameter_count(unit_module(model, Unit.from_name(unit))) for unit in units)


def _level(model: torch.nn.Module, groups: list[tuple[str, ...]], first: tuple[str, ...]) -> tuple[str, ...]:
    """`first`, and every other group of at least a tenth of its coverage that does not overlap it."""
    chosen = list(first)
    least = _coverage(model, first) / 10
    for names in sorted(groups, key=lambda g: _coverage(model, g), reverse=True):
        if _coverage(model, names) >= least and not any(_overlaps(n, chosen) for n in names):
            chosen.extend(names)
    return tuple(sorted(chosen, key=_unit_order(model)))


def _inside(unit: str, container: str) -> bool:
    return sequential_run(container) is None and _module_name(unit).startswith(container + ".")


def _repeats_inside(model: torch.nn.Module, level: tuple[str, ...], names: tuple[str, ...]) -> bool:
    """Whether `names` nest in `level`, at least two alike (signature or class) inside most of its members."""
    if not all(any(_inside(n, outer) for outer in level) for n in names):
        return False
    repeated = 0
    for outer in level:
        inner = [unit_module(model, Unit.from_name(n)) for n in names if _inside(n, outer)]
        inner = [m for m in inner if not _is_layer(m)]
        kinds = Counter(type(m) for m in inner) + Counter(structural_signature(m) for m in inner)
        repeated += any(count >= 2 for count in kinds.values())
    return 2 * repeated >= len(level)


def nested_levels(model: torch.nn.Module, max_levels: int = MAX_LEVELS) -> list[tuple[str, ...]]:
    """Levels of repeated blocks, coarse to fine.

    The coarsest is the shallowest group covering at least half the parameters the widest group
    covers; each next level is the widest group that repeats inside it.
    """
    groups = _groups(model)
    if not groups:
        return []
    widest = max(_coverage(model, g) for g in groups)
    candidates = [g for g in groups if 2 * _coverage(model, g) >= widest]
    first = min(candidates, key=lambda g: (sum(_module_name(n).count(".") for n in g) / len(g), -_coverage(model, g)))
    levels = [_level(model, candidates, first)]
    while len(levels) < max_levels:
        inner = [g for g in groups if _repeats_inside(model, levels[-1], g)]
        if not inner:
            break
        finer = _level(model, inner, max(inner, key=lambda g: _coverage(model, g)))
        # members with nothing repeating inside stay whole, so each level covers what the one before did
        whole = [outer for outer in levels[-1] if not any(_inside(unit, outer) for unit in finer)]
        levels.append(tuple(sorted((*finer, *whole), key=_unit_order(model))))
    return levels


def _finest_blocks(model: torch.nn.Module) -> tuple[str, ...]:
    """The widest group of repeated blocks on its own (most members on ties): every block, however
    deep each one sits, checkpointable one by one, as a person would by hand."""
    pairs = _groups(model, with_members=True)
    if not pairs:
        return ()
    # ranked by what the repeated modules themselves cover, not their siblings: a block's attention
    # repeats once per block, the blocks are what repeats
    def rank(pair) -> tuple[int, int, float]:  # on ties the more, then the deeper, blocks
        members = pair[0]
        return _coverage(model, members), len(members), sum(n.count(".") for n in members) / len(members)

    _, widest = max(pairs, key=rank)
    return _level(model, [group for _, group in pairs], widest)


def _checkpointing_layer_units(model: torch.nn.Module, innermost: bool = False) -> tuple[str, ...]:
    """A transformers model's own layers: what it would checkpoint itself (`GradientCheckpointingLayer`).

    Covers encoder and decoder layers of different classes (Whisper) and both stacks of T5.
    Recognised by class name in the MRO, so transformers need not be installed.
    """
    names = [
        name
        for name, module in model.named_modules()
        if name and any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__[1:])
    ]
    if innermost:
        chosen = [n for n in names if not any(other.startswith(n + ".") for other in names)]
    else:
        chosen = outermost(names)
    return tuple(chosen) if len(chosen) >= 2 else ()


def _sequential_levels(model: torch.nn.Module) -> list[tuple[str, ...]]:
    """The Sequential with most parameters, cut into blocks led by its first parametric layer's class
    (conv–BN–ReLU), then into one parametric layer per run."""
    sequentials = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Sequential) and len(m) >= 2]
    if not sequentials:
        return []
    name, seq = max(sequentials, key=lambda item: (parameter_count(item[1]), -item[0].count(".")))
    leading = next((type(layer) for layer in seq if parameter_count(layer) > 0), None)
    levels = [
        tuple(sequential_runs(name, seq, lambda layer: type(layer) is leading)),
        tuple(sequential_runs(name, seq)),
    ]
    return [level for level in dict.fromkeys(levels) if len(level) >= 2]


def _children_level(model: torch.nn.Module) -> tuple[str, ...]:
    """The model's own children with parameters (the contents of a ModuleList/ModuleDict child)."""
    units: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, _LISTS):
            units.extend(f"{name}.{n}" for n, grandchild in child.named_children() if parameter_count(grandchild) > 0)
        elif parameter_count(child) > 0:
            units.append(name)
    return tuple(units) if len(units) >= 2 else ()


def _matching(model: torch.nn.Module, patterns) -> tuple[str, ...]:
    if isinstance(patterns, str):
        patterns = [patterns]
    modules = [n for n, _ in model.named_modules() if n]
    # every pattern must name something: a typo among good patterns would otherwise go unnoticed
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in modules)]
    if unmatched:
        tops = ", ".join(n for n, _ in model.named_children()) or "(none)"
        raise UnitPatternError(
            f"units {unmatched} matched no submodule of {type(model).__name__}; "
            f"its top-level submodules are: {tops}. Patterns match qualified names like 'layers.*'."
        )
    matched = outermost([n for n in modules if any(fnmatch.fnmatchcase(n, p) for p in patterns)])
    return tuple(unit for name in matched for unit in _called(model, name))


def _called(model: torch.nn.Module, name: str) -> list[str]:
    """A matched module as units: itself, or for a ModuleList/ModuleDict (never called, so never a unit that
    runs: `--units 'b*'` matching `blocks`) the children it holds."""
    module = model.get_submodule(name)
    if not isinstance(module, _LISTS):
        return [name]
    return [f"{name}.{child}" for child, _ in module.named_children()]


def unit_levels(model: torch.nn.Module, patterns: list[str] | None = None) -> list[UnitLevel]:
    """Every level of units the plan may decide about, the preferred first (see the module docstring)."""
    return [UnitLevel(tuple(map(Unit.from_name, names)), source) for names, source in _named_levels(model, patterns)]


def _named_levels(model: torch.nn.Module, patterns: list[str] | None) -> list[tuple[tuple[str, ...], str]]:
    """`unit_levels` by name: each level's unit names and where they came from."""
    if patterns:
        return [(_matching(model, patterns), "units= patterns")]
    transformers_layers = _checkpointing_layer_units(model)
    if transformers_layers:
        # what gradient_checkpointing_enable() checkpoints: where its layers nest (Swin's stages
        # and their blocks), transformers checkpoints both, so both levels are offered
        inner = _checkpointing_layer_units(model, innermost=True)
        levels = [(transformers_layers, "transformers layers")]
        return levels + ([(inner, "transformers layers inside them")] if inner != transformers_layers else [])
    blocks = nested_levels(model)
    finest = _finest_blocks(model)
    if finest and finest not in blocks:
        blocks = [*blocks[-1:], finest]  # at most two levels: each costs a whole profile
    if blocks:
        return [(level, "repeated blocks") for level in blocks]
    sequential = _sequential_levels(model)
    if isinstance(model, torch.nn.Sequential):
        levels = [(level, "Sequential runs") for level in sequential]
    else:
        # a Sequential inside (its runs, as before), else the fx graph's runs; and the model's children
        graph = () if sequential else tuple(unit.name for unit in graph_units(model))
        first = [(sequential[-1], "Sequential runs")] if sequential else [(graph, "graph runs")] if graph else []
        children = _children_level(model)
        levels = first + ([(children, "the model's children")] if children else [])
    if not levels:
        raise TraceError(
            f"{type(model).__name__} has no repeated submodule, no nn.Sequential, no two children with parameters and "
            "no fx graph that cuts into two or more parametric runs; name the submodules to plan (units=['name.pattern', ...]; "
            "--units on the command line)."
        )
    return levels


def find_units(model: torch.nn.Module, patterns: list[str] | None = None) -> list[Unit]:
    """The units (modules, Sequential runs, graph runs) of the preferred level (`unit_levels`' first)."""
    return list(unit_levels(model, patterns)[0].units)
