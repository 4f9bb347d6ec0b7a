"""A whole step's unit calls and boundaries from a shortened one: what a profile's timeline needs beyond its phases.

`profile.stack` solves a step's phases from shortened steps. A profile's timeline also says what every unit was
called with and which tensors units hand each other (`UnitCall`, `Boundary`, named by storage keys). In a run of
identical layers those repeat: the template is a shortened step with every run at two interior layers, the first
(`I1`) fed by the run's first layer and the second (`I2`) feeding its last. The whole run's interior copy 0 is `I1`
as it was; copy j ≥ 1 is `I2` with its keys moved along the chain:
- an input `I2` takes from `I1`'s output is copy j−1's output; one it takes at the same place as `I1` does (a rotary
  table, a mask) is shared by every copy;
- copy j's output is a new tensor, `I2`'s own for the last copy (the run's last layer reads it).
A tensor's boundary follows from the calls (`recorder.boundaries_of`). What only the step could tell (whether the
rest holds it, the phase that last read it, where an op outside the units saved it) comes from the template tensor it
repeats, with `I1` and `I2` renamed: copy j's output repeats `I1`'s (the next copy reads it) or, for the last copy,
`I2`'s (the run's last layer does).
Checked like the phases: a step with three interior layers per run, synthesized, must equal the simulated one up to
the keys' numbering, or the whole step is simulated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from autoplan.plan import Phase
from torch.utils._pytree import tree_flatten

from autoplan.profile.recorder import Boundary, TensorSpec, UnitCall, boundaries_of
from autoplan.profile.timeline import Timeline


class NoPattern(Exception):
    """The template's calls do not repeat the way a chain of identical layers does."""


@dataclass(frozen=True)
class Records:
    unit_calls: tuple[UnitCall, ...]
    boundaries: tuple[Boundary, ...]


@dataclass(frozen=True)
class _Source:
    """Where a synthesized key's facts come from: a template key, with the template's layers renamed."""

    key: int
    renamed: Mapping[str, str]


class _RunCopies:
    """One run's interior layers of the whole step, made from the template's two."""

    def __init__(self, interior: Sequence[str], count: int, calls: Mapping[str, UnitCall], fresh) -> None:
        if count < 2:
            raise NoPattern("a run of one interior layer has no chain")
        self.names = tuple(interior[:count])
        self.first, self.second = calls[interior[0]], calls[interior[1]]
        if len(self.first.output_keys) != len(self.second.output_keys) or len(self.first.input_keys) != len(self.second.input_keys):
            raise NoPattern("interior layers called differently")
        self._outputs = {j: tuple(fresh() for _ in self.second.output_keys) for j in range(1, count - 1)}

    def renamed(self, before: int, after: int) -> dict[str, str]:
        return {self.first.name: self.names[before], self.second.name: self.names[after]}

    def output(self, j: int, leaf: int) -> int:
        if j == 0:
            return self.first.output_keys[leaf]
        return self.second.output_keys[leaf] if j == len(self.names) - 1 else self._outputs[j][leaf]

    def output_source(self, j: int, leaf: int) -> _Source:
        last = len(self.names) - 1
        if j < last:  # read by the next copy, as I2 reads I1's
            return _Source(self.first.output_keys[leaf], self.renamed(j, j + 1))
        return _Source(self.second.output_keys[leaf], self.renamed(j - 1, j))  # read by the run's last layer

    def call(self, j: int, sources: dict[int, _Source]) -> UnitCall:
        """Copy j's call (j ≥ 1): `I2`'s, its keys moved along the chain; the sources of its new keys noted."""
        moved: dict[int, int] = {}
        for leaf, key in enumerate(self.second.input_keys):
            if key == self.first.input_keys[leaf]:  # shared; also where every layer hands it on (T5's position bias)
                moved[key] = key
            elif key in self.first.output_keys:
                moved[key] = self.output(j - 1, self.first.output_keys.index(key))
            else:
                raise NoPattern(f"{self.second.name} takes an input {self.first.name} does not")
        outputs = []
        for leaf, key in enumerate(self.second.output_keys):
            if key in moved or key == self.first.output_keys[leaf]:
                outputs.append(moved.get(key, key))  # an input handed on, or one tensor every layer returns
                continue
            outputs.append(self.output(j, leaf))
            sources[outputs[-1]] = self.output_source(j, leaf)
        return dataclasses.replace(self.second, name=self.names[j], input_keys=tuple(moved[key] for key in self.second.input_keys),
                                   output_keys=tuple(outputs))


def whole_records(interiors: Sequence[Sequence[str]], template: Timeline, counts: Sequence[int]) -> Records:
    """The unit calls and boundaries of the step whose runs have `counts` interior layers, from `template`, a step with
    two interior layers in each run (`interiors`: each run's interior layer names, in order). NoPattern where the
    template is not a chain of identical layers."""
    calls = {call.name: call for call in template.unit_calls}
    fresh_keys = iter(range(max((k for c in template.unit_calls for k in (*c.input_keys, *c.output_keys)), default=0) + 1, 1 << 62))
    runs = [_RunCopies(names, count, calls, lambda: next(fresh_keys)) for names, count in zip(interiors, counts)]
    default = {run.first.name: run.names[0] for run in runs} | {run.second.name: run.names[-1] for run in runs}
    sources: dict[int, _Source] = {}
    by_first = {run.first.name: run for run in runs}
    by_second = {run.second.name: run for run in runs}
    unit_calls: list[UnitCall] = []
    for call in template.unit_calls:
        if call.name in by_second:
            run = by_second[call.name]
            unit_calls.extend(run.call(j, sources) for j in range(1, len(run.names)))
        elif call.name in by_first:
            run = by_first[call.name]
            unit_calls.append(call)
            for leaf, key in enumerate(call.output_keys):
                if key not in call.input_keys:  # an input handed on keeps its own source
                    sources.setdefault(key, run.output_source(0, leaf))
        else:
            unit_calls.append(call)
    facts = {boundary.key: boundary for boundary in template.boundaries}

    def source(key: int) -> tuple[Boundary, Mapping[str, str]]:
        found = sources.get(key, _Source(key, default))
        if found.key not in facts:
            raise NoPattern(f"no boundary for key {found.key}")
        return facts[found.key], {**default, **found.renamed}

    def moved(phase: Phase | None, renamed: Mapping[str, str]) -> Phase | None:
        if phase is None or phase.unit is None or phase.unit not in renamed:
            return phase
        return dataclasses.replace(phase, unit=renamed[phase.unit])

    boundaries = boundaries_of(unit_calls, lambda key: source(key)[0].held_by_rest,
                               lambda key: moved(source(key)[0].last_forward_use, source(key)[1]),
                               lambda key: moved(source(key)[0].rest_saved_in, source(key)[1]))
    return Records(tuple(unit_calls), boundaries)


def same_records(mine: Records, theirs: Timeline) -> bool:
    """Whether `mine` are `theirs`'s calls and boundaries, the storage keys numbered alike (by first appearance)."""
    return _numbered(mine.unit_calls, mine.boundaries) == _numbered(theirs.unit_calls, theirs.boundaries)


def _described(inputs) -> tuple:
    """A call's inputs as compared: tensors by their specs, plain values by value, other objects (a cache) by type."""
    leaves, spec = tree_flatten(inputs)
    plain = (TensorSpec, int, float, bool, str, type(None))
    return tuple(leaf if isinstance(leaf, plain) else type(leaf) for leaf in leaves), str(spec)


def _numbered(calls: Sequence[UnitCall], boundaries: Sequence[Boundary]) -> tuple:
    order: dict[int, int] = {}
    for call in calls:
        for key in (*call.input_keys, *call.output_keys):
            order.setdefault(key, len(order))
    for boundary in boundaries:
        order.setdefault(boundary.key, len(order))
    renumbered_calls = tuple(dataclasses.replace(call, inputs=_described(call.inputs), input_keys=tuple(order[k] for k in call.input_keys),
                                                 output_keys=tuple(order[k] for k in call.output_keys)) for call in calls)
    return renumbered_calls, tuple(dataclasses.replace(boundary, key=order[boundary.key]) for boundary in boundaries)
