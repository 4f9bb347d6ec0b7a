"""A stack of identical units simulated a few layers deep: the whole step's phases from shortened steps.

A transformer is mostly a stack (`model.layers.0` … `model.layers.79`) of layers that are the same
module, called the same way. Where a run of them makes the same choice, each extra layer of the run
adds the same bytes and time to every later phase, and its own phases repeat the neighbour's shifted
by what one layer holds: every phase of the step is affine in the run's length and in the layer's
position in it. So the step is simulated with each long run cut to its first layer, one or two
interior layers and its last (`run_timeline(..., dropped=...)`: the skipped layers leave their
container), and the whole step's phases are solved from those: one shortened step with every run at
one interior layer, one per run with that run at two, and a check at three that every phase lands
where the others put it (else no shortcut: the whole step is simulated).

What comes out is phases, peak, static bytes and host peak: what checking a plan's peak needs; asked, the
unit calls and boundaries too (`profile.stack_records`), what a profile's timeline needs. It has no
allocation log: not for checking a plan on one GPU, whose caching allocator replays the whole log
(`verify.simulate.Simulation.reserved_bytes`); a profile's timeline replays none.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from autoplan.plan import Choice, Phase
from autoplan.profile.stack_records import NoPattern, same_records, whole_records
from autoplan.profile.timeline import PhaseSample, StaticBytes, Timeline
from autoplan.units import ModuleUnit, Unit
from autoplan.vocabulary.names import numbered_child

MIN_INTERIOR = 4  # a run shorter than its first, last and this many layers is simulated whole: no time to win
_SCALARS = (int, float, str, bool, type(None))


@dataclass(frozen=True)
class Run:
    """Layers of one container, consecutive and identical, with one choice: `names` in forward order."""

    names: tuple[str, ...]

    @property
    def interior(self) -> tuple[str, ...]:
        return self.names[1:-1]


def stack_runs(model: torch.nn.Module, units: tuple[Unit, ...], choices: Mapping[str, Choice]) -> tuple[Run, ...]:
    """The runs of `units` (forward order) worth shortening: the numbered children of one ModuleList or Sequential,
    consecutive in the forward and in their numbers, the same module up to their own index, with one choice."""
    runs: list[Run] = []
    current: list[str] = []
    previous: _Layer | None = None
    for unit in units:
        layer = _layer(model, unit, choices)
        if not (layer is not None and previous is not None and layer.follows(previous)):
            _close(current, runs)
            current = []
        if layer is not None:
            current.append(unit.name)
        previous = layer
    _close(current, runs)
    return tuple(runs)


def _close(names: list[str], runs: list[Run]) -> None:
    if len(names) >= MIN_INTERIOR + 2:
        runs.append(Run(tuple(names)))


@dataclass(frozen=True)
class _Layer:
    container: str
    index: int
    structure: tuple  # classes, parameter and buffer shapes, by submodule
    attributes: tuple  # every plain attribute of every submodule, in order
    choice: Choice | None

    def follows(self, other: "_Layer") -> bool:
        """The next layer of `other`'s container, the same module and choice; an attribute may differ only where
        each holds its own layer's index (transformers' `layer_idx`)."""
        if (self.container, self.index, self.structure, self.choice) != (other.container, other.index + 1, other.structure, other.choice):
            return False
        return len(self.attributes) == len(other.attributes) and all(
            mine == theirs or (type(mine) is int and type(theirs) is int and (mine, theirs) == (self.index, other.index))
            for mine, theirs in zip(self.attributes, other.attributes))


def _layer(model: torch.nn.Module, unit: Unit, choices: Mapping[str, Choice]) -> _Layer | None:
    """A unit that is a numbered child of a ModuleList or Sequential, as `stack_runs` compares it; else None."""
    numbered = numbered_child(unit.name)
    # a unit left out of a plan's choices is in a segment (planned as one region with its neighbours), never shortened;
    # no choices at all is the step with no plan, every unit as written
    if type(unit) is not ModuleUnit or numbered is None or (choices and unit.name not in choices):
        return None
    container_name, index = numbered
    container = model.get_submodule(container_name) if container_name else model
    if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
        return None
    structure: list[tuple] = []
    attributes: list[object] = []
    for name, sub in model.get_submodule(unit.name).named_modules():
        parameters = tuple((key, tuple(p.shape), p.dtype, p.requires_grad) for key, p in sub.named_parameters(recurse=False))
        buffers = tuple((key, tuple(b.shape), b.dtype) for key, b in sub.named_buffers(recurse=False))
        plain = sorted((key, value) for key, value in vars(sub).items() if not key.startswith("_") and _is_plain(value))
        structure.append((name, type(sub), parameters, buffers, tuple(key for key, _ in plain)))
        attributes.extend(value for _, value in plain)
    return _Layer(container_name, index, tuple(structure), tuple(attributes), choices.get(unit.name))  # None: as written (no plan)


def _is_plain(value) -> bool:
    return isinstance(value, _SCALARS) or (isinstance(value, tuple) and all(isinstance(item, _SCALARS) for item in value))


def shortened_step(traced, choices: Mapping[Unit, Choice], simulate: Callable[[frozenset[str]], Timeline], *,
                   records: bool = False) -> Timeline | None:
    """The whole step's timeline from shortened ones where the model has a stack long enough to win time, else None
    (`simulate(dropped)` simulates the step without the layers in `dropped`). A shortened step that fails to run (a
    forward that indexes its layers by number) or is not affine is None too: the whole step is simulated. `records`:
    with its unit calls and boundaries too (`profile.stack_records`), as a profile's timeline needs them."""
    if not _one_optimizer_group(traced.model):
        return None
    runs = stack_runs(traced.model, traced.units, {unit.name: choice for unit, choice in choices.items()})
    if not runs or _kept_layers(runs) > sum(len(run.names) for run in runs) // 2:
        return None
    try:
        return shortened_timeline(runs, simulate, records=records)
    except Exception:  # noqa: BLE001 - the whole step runs next, and says what is wrong if anything is
        return None


def _one_optimizer_group(model: torch.nn.Module) -> bool:
    """Whether the trainable parameters share one dtype. torch's foreach optimizers step each dtype's parameters as
    one group, temporaries for the whole group at once, and the step's peak is the largest group's: with two groups
    the largest can be one at a few layers' depth (an fp32 embedding) and the other at the whole depth, which no
    shortened step shows. One group grows with every layer alike."""
    return len({param.dtype for param in model.parameters() if param.requires_grad}) <= 1


def _kept_layers(runs: tuple[Run, ...]) -> int:
    """Layers of the runs the shortened steps simulate in all: one at one interior layer, one per run at two, the check."""
    per_step = 2 * len(runs)
    return (per_step + len(runs)) + sum(per_step + len(runs) + 1 for _ in runs) + (per_step + 3 * len(runs))


def shortened_timeline(runs: tuple[Run, ...], simulate: Callable[[frozenset[str]], Timeline], *,
                       records: bool = False) -> Timeline | None:
    """The whole step's timeline (phases, peak, static bytes, host peak; with `records`, unit calls and boundaries too)
    from shortened steps, `simulate(dropped)` simulating the step without the layers named in `dropped`; None where
    the check step disagrees (not affine, or its calls not a chain of identical layers)."""
    interiors = [len(run.interior) for run in runs]

    def shortened(counts: list[int]) -> Timeline:
        dropped = frozenset(name for run, count in zip(runs, counts) for name in run.interior[count:])
        return simulate(dropped)

    base = shortened([1] * len(runs))
    varied = [shortened([2 if k == r else 1 for k in range(len(runs))]) for r in range(len(runs))]
    model = _AffineSteps(runs, base, varied)
    check = shortened([3] * len(runs))
    if not agrees(model.timeline([3] * len(runs)), check):
        return None
    timeline = model.timeline(interiors)
    if not records:
        return timeline
    template = varied[0] if len(runs) == 1 else shortened([2] * len(runs))
    names = [run.interior for run in runs]
    try:
        if not same_records(whole_records(names, template, [3] * len(runs)), check):
            return None
        made = whole_records(names, template, interiors)
    except NoPattern:
        return None
    return dataclasses.replace(timeline, unit_calls=made.unit_calls, boundaries=made.boundaries)


def agrees(shortcut: Timeline, whole: Timeline) -> bool:
    """Whether the shortcut's timeline is the whole step's: every phase's bytes and flops equal, its time to float
    rounding (the shortcut sums float times in another order), and the static bytes, carried bytes and host peak."""
    if [p.phase for p in shortcut.phases] != [p.phase for p in whole.phases]:
        return False
    exact = ("start_bytes", "peak_bytes", "grad_bytes", "flops")
    for mine, theirs in zip(shortcut.phases, whole.phases):
        if any(getattr(mine, name) != getattr(theirs, name) for name in exact):
            return False
        if abs(mine.time_s - theirs.time_s) > 1e-9 * max(abs(theirs.time_s), 1e-12):
            return False
    same = ("peak_bytes", "static", "carried_bytes", "host_peak_bytes", "fused_logits", "fusing_held_longer", "loss_summed", "target_kernels")
    return all(getattr(shortcut, name) == getattr(whole, name) for name in same)


class _AffineSteps:
    """Every phase's figures as affine in each run's interior length, and an interior layer's in its position."""

    def __init__(self, runs: tuple[Run, ...], base: Timeline, varied: list[Timeline]) -> None:
        self.runs, self.base, self.varied = runs, base, varied
        self.position = {name: (r, j) for r, run in enumerate(runs) for j, name in enumerate(run.interior)}
        self.varied_rows = [{p.phase: p for p in timeline.phases} for timeline in varied]

    def timeline(self, interiors: list[int]) -> Timeline:
        phases = tuple(self._phases(interiors))
        extra = [count - 1 for count in interiors]
        static = StaticBytes(*(self._affine(getattr(self.base.static, f.name), [getattr(t.static, f.name) for t in self.varied], extra)
                               for f in dataclasses.fields(StaticBytes)))
        return dataclasses.replace(
            self.base, phases=phases, peak_bytes=max(p.peak_bytes for p in phases), static=static, unit_calls=(), boundaries=(),
            allocation_log=(), carried_bytes=self._affine(self.base.carried_bytes, [t.carried_bytes for t in self.varied], extra),
            host_peak_bytes=self._affine(self.base.host_peak_bytes, [t.host_peak_bytes for t in self.varied], extra),
        )

    @staticmethod
    def _affine(base, varied: list, extra: list[int]):
        return base + sum((value - base) * count for value, count in zip(varied, extra))

    def _phases(self, interiors: list[int]):
        """The base step's phases in order, each interior layer's group of phases repeated for every position (in the
        order the run's second interior layer takes in its shortened step), each figure moved by every run's extra layers."""
        phases = list(self.base.phases)
        k = 0
        while k < len(phases):
            run = self._run_of(phases[k].phase)
            if run is None:
                yield self._moved(phases[k], None, 0, interiors)
                k += 1
                continue
            group = [phases[k]]
            while k + len(group) < len(phases) and self._run_of(phases[k + len(group)].phase) == run:
                group.append(phases[k + len(group)])
            positions = range(interiors[run]) if self._ascending(run, group[0].phase) else range(interiors[run] - 1, -1, -1)
            for j in positions:
                for sample in group:
                    yield self._moved(sample, run, j, interiors)
            k += len(group)

    def _ascending(self, run: int, phase: Phase) -> bool:
        """Whether this phase of the run's interior layers comes layer after layer in the step (a forward; the phases
        after an encoder-decoder's decoder layers, which run once all their backwards have) or the other way round."""
        order = [p.phase for p in self.varied[run].phases]
        return order.index(self._at(phase, run, 1)) > order.index(phase)

    def _run_of(self, phase: Phase) -> int | None:
        place = self.position.get(phase.unit) if phase.unit is not None else None
        return place[0] if place is not None else None

    def _moved(self, sample: PhaseSample, run: int | None, j: int, interiors: list[int]) -> PhaseSample:
        extra = [count - 1 for count in interiors]
        fields = ("start_bytes", "peak_bytes", "grad_bytes", "time_s", "flops")
        values = {}
        for name in fields:
            base = getattr(sample, name)
            varied = [getattr(rows[sample.phase], name) for rows in self.varied_rows]
            value = self._affine(base, varied, extra)
            if run is not None:  # this layer's place in its run: the step per position, from the run's second layer
                second = self.varied_rows[run][self._at(sample.phase, run, 1)]
                value += (getattr(second, name) - getattr(self.varied_rows[run][sample.phase], name)) * j
            values[name] = value
        phase = self._at(sample.phase, run, j) if run is not None else sample.phase
        return PhaseSample(phase, **values)

    def _at(self, phase: Phase, run: int, j: int) -> Phase:
        return dataclasses.replace(phase, unit=self.runs[run].interior[j])
