"""The lines that make a plan again and apply it: `autoplan.optimize(model, ...)` with plan()'s arguments as given.

The report prints them under the plan and the ladder under its first rung that fits; they are Python source, wrapped
inside their brackets so they can be copied and pasted.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from autoplan.vocabulary.code_lines import wrap_code
from autoplan.vocabulary.formatting import format_bytes

if TYPE_CHECKING:
    from autoplan.plan import Plan


def apply_code(plan: "Plan", budget_text: str | None = None) -> str:
    """The call that makes this plan again and applies it: plan()'s arguments as given (`plan.request.arguments`).

    An argument that was an object only the caller has (a loss function, an optimizer) is passed by its
    own name; `batch` is the caller's batch, unless the plan built its batch from batch_size/seq_len.
    """
    request = dict(plan.request.arguments) or _request_of(plan)
    budget = request.pop("budget", None) or budget_text or format_bytes(plan.request.budget_bytes).replace(" ", "")
    arguments = [_python(budget)]
    if "batch_size" not in request and "seq_len" not in request:
        arguments.append("example_inputs=batch")
    arguments += [f"{name}={name if value is None else _python(value)}" for name, value in request.items()]
    code = f"model = autoplan.optimize(model, {', '.join(arguments)})"
    if plan.target.needs_grad_scaler:
        code += "\nscaler = torch.amp.GradScaler()  # fp16 units: scale the loss"
    return wrap_code(code)


def _request_of(plan: "Plan") -> dict:
    """For a Plan made without a record of its arguments: what its own fields say."""
    request: dict[str, object] = {"device": plan.target.device}
    if plan.decisions.rest_precision != "fp32":
        request["precision"] = plan.decisions.rest_precision
    if plan.request.world_size > 1:
        request["world_size"] = plan.request.world_size
    return request


def _python(value) -> str:
    """A literal of plan.request.arguments as Python source (strings in double quotes, as the README writes them)."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_python(key)}: {_python(item)}" for key, item in value.items()) + "}"
    return repr(value)
