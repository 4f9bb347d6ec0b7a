"""autoplan: make a PyTorch training step fit a memory budget, as fast as possible inside it.

    import autoplan
    plan = autoplan.plan(model, "20GB", example_inputs=(batch,))   # decide, change nothing
    model = autoplan.optimize(model, "20GB", example_inputs=(batch,))  # decide and rewrite
    result = autoplan.verify(model, plan, example_inputs=(batch,))     # real steps: did it hold?
"""

from autoplan.api import InfeasibleBudgetError, apply, optimize, plan
from autoplan.budget import Budget, make_budget, parse_bytes
from autoplan.devices import DEVICES, Device, get_device, list_devices
from autoplan.measure import Verification, verify
from autoplan.plan import Choice, MemoryBreakdown, Plan, UnitDecision
from autoplan.rewrite import planned_choices, remove_plan
from autoplan.trace import TraceError

__all__ = [
    "Budget",
    "Choice",
    "DEVICES",
    "Device",
    "InfeasibleBudgetError",
    "MemoryBreakdown",
    "Plan",
    "TraceError",
    "UnitDecision",
    "Verification",
    "apply",
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
