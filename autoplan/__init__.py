"""autoplan: make a PyTorch training step fit a memory budget, as fast as possible inside it.

    import autoplan
    plan = autoplan.plan(model, "20GB", example_inputs=(batch,))   # decide, change nothing
    model = autoplan.optimize(model, "20GB", example_inputs=(batch,))  # decide and rewrite
    result = autoplan.verify(model, plan, example_inputs=(batch,))     # real steps: did it hold?

The package is the pipeline, one sub-package per stage in order: inputs, trace, profile, memory,
solve, verify, apply, report, cli; `plan.py` and `errors.py` are the vocabulary; what they share
is in `vocabulary/` (names, formatting), `instruments/` (fake tensors, the live-bytes tracker),
`training/` (the step, run once for simulation and measurement) and `planned/` (what a rewritten
model runs); `api.py` is the orchestration.
"""

from autoplan.cli.interrupt import exit_on_interrupt, is_command_line

if is_command_line():
    # before seconds of torch imports: a KeyboardInterrupt raised inside them (numpy's lazy
    # submodules) can surface as another error; the handler raises nothing
    exit_on_interrupt()

try:  # seconds of torch imports: Ctrl-C here, in the command line, is its exit 130 too (cli.interrupt)
    from autoplan.api import apply, optimize, plan
    from autoplan.errors import InfeasibleBudgetError, PlanMismatchError, TraceError, UnitPatternError
    from autoplan.inputs.budget import Budget, make_budget, parse_bytes
    from autoplan.inputs.devices import DEVICES, Device, get_device, list_devices
    from autoplan.inputs.loop import TrainingLoop
    from autoplan.plan import Choice, MemoryBreakdown, Plan, UnitDecision
    from autoplan.report.text import format_report
    from autoplan.planned.forwards import planned_choices, remove_plan
    from autoplan.verify.real import Verification, verify
except KeyboardInterrupt:
    from autoplan.cli.interrupt import exit_interrupted, is_command_line

    if is_command_line():
        exit_interrupted()
    raise

__all__ = [
    "Budget",
    "Choice",
    "DEVICES",
    "Device",
    "InfeasibleBudgetError",
    "MemoryBreakdown",
    "Plan",
    "PlanMismatchError",
    "TraceError",
    "TrainingLoop",
    "UnitDecision",
    "UnitPatternError",
    "Verification",
    "apply",
    "format_report",
    "get_device",
    "list_devices",
    "make_budget",
    "optimize",
    "parse_bytes",
    "plan",
    "planned_choices",
    "remove_plan",
    "verify",
]
__version__ = "0.1.0"
