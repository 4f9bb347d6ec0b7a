"""autoplan: make a PyTorch training step fit a memory budget, as fast as possible inside it.

    import autoplan
    plan = autoplan.plan(model, "20GB", example_inputs=(batch,))   # decide, change nothing
    model = autoplan.optimize(model, "20GB", example_inputs=(batch,))  # decide and rewrite
    result = autoplan.verify(model, plan, example_inputs=(batch,))     # real steps: did it hold?

The package is the pipeline, one sub-package per stage in order: inputs, trace, profile, memory,
solve, verify, apply, report, cli; `plan.py` and `errors.py` are the vocabulary; what they share
is in `vocabulary/` (names, formatting), `instruments/` (fake tensors, the live-bytes tracker),
`training/` (the step, run once for simulation and measurement) and `planned/` (what a rewritten
model runs); `planner.py` runs the stages in order and `api.py` is the public entry.

The public names are imported on first use, not with the package: `import autoplan` costs no
torch import, so the command line (`autoplan.cli.main`, inside this package) answers `--help`
and a mistyped option at once, not after seconds of imports.
"""

from __future__ import annotations

import importlib
import sys
import types

from autoplan.cli.interrupt import exit_on_interrupt, is_command_line

if is_command_line():
    # before seconds of torch imports: a KeyboardInterrupt raised inside them (numpy's lazy
    # submodules) can surface as another error; the handler raises nothing
    exit_on_interrupt()

# public name -> the module that defines it
_EXPORTS = {
    "apply": "autoplan.api",
    "optimize": "autoplan.api",
    "plan": "autoplan.api",
    "Planner": "autoplan.planner",
    "InfeasibleBudgetError": "autoplan.errors",
    "PlanMismatchError": "autoplan.errors",
    "TraceError": "autoplan.errors",
    "UnitPatternError": "autoplan.errors",
    "Budget": "autoplan.inputs.budget",
    "make_budget": "autoplan.inputs.budget",
    "parse_bytes": "autoplan.inputs.budget",
    "DEVICES": "autoplan.inputs.devices",
    "Device": "autoplan.inputs.devices",
    "get_device": "autoplan.inputs.devices",
    "list_devices": "autoplan.inputs.devices",
    "TrainingLoop": "autoplan.inputs.loop",
    "Choice": "autoplan.plan",
    "MemoryBreakdown": "autoplan.plan",
    "Plan": "autoplan.plan",
    "UnitDecision": "autoplan.plan",
    "Unit": "autoplan.units",
    "format_report": "autoplan.report.text",
    "planned_choices": "autoplan.planned.forwards",
    "remove_plan": "autoplan.planned.forwards",
    "Verification": "autoplan.verify.real",
    "verify": "autoplan.verify.real",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


class _Export:
    """A public name of the package, imported from its module when first read.

    A data descriptor, not a module `__getattr__`: `plan`, `apply` and `verify` are also the names
    of submodules, and importing a submodule binds it on the package (`autoplan.plan` would become
    the module `autoplan/plan.py` once anything imported it). The import system's binding is
    dropped here; anything else set on the name (a test's monkeypatch) is kept.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, package, owner=None):
        if package is None:
            return self
        if self.name not in vars(package):
            vars(package)[self.name] = getattr(importlib.import_module(_EXPORTS[self.name]), self.name)
        return vars(package)[self.name]

    def __set__(self, package, value) -> None:
        if isinstance(value, types.ModuleType) and value.__name__ == f"{package.__name__}.{self.name}":
            return  # a submodule of the same name being imported: the public name keeps its function
        vars(package)[self.name] = value

    def __delete__(self, package) -> None:
        vars(package).pop(self.name, None)


class _Package(types.ModuleType):
    """The package's module type: its public names are `_Export`s."""

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_EXPORTS))


for _name in _EXPORTS:
    _export = _Export()
    _export.__set_name__(_Package, _name)
    setattr(_Package, _name, _export)
del _name, _export

sys.modules[__name__].__class__ = _Package
