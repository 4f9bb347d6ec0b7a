"""Every error autoplan raises on purpose, one class per failure, so callers (the CLI's exit codes
among them) tell failures apart by type, never by message text.

Part of the vocabulary: imports nothing of autoplan. Most subclass ValueError, as the errors
they replace did, so `except ValueError` in a caller's code keeps working.
"""

from __future__ import annotations

from typing import Any


class TraceError(ValueError):
    """The model could not be traced or partitioned; the message says what to do."""


class UnitPatternError(TraceError):
    """A unit name pattern (units=, checkpoint=, keep_fp32=, --units) matched no unit of the model."""


class RepeatedUnitError(TraceError):
    """A unit ran more than once per forward where autoplan could not tell its calls apart."""


class SegmentError(RuntimeError):
    """A planned segment's blocks were not called as planned (out of order, or not fed one another's output)."""


class ProfileError(ValueError):
    """The traced model failed while its training step ran on fake tensors; names the model's line."""


class TrainingStepError(ProfileError):
    """The model's own training step raised in verify's real steps (the model's or a library's code, not
    autoplan's): names the step, the library or file and the function where it failed."""


class LossError(ProfileError):
    """The training step has nothing to backpropagate: the model's output holds no floating-point tensor,
    or the loop says the model computes its loss and its output has no `.loss`."""


class SparseGradientError(ProfileError):
    """The model has layers with sparse gradients (nn.Embedding(sparse=True)): autoplan plans dense gradients only."""


class BudgetError(ValueError):
    """A budget or reserve that is not a size autoplan can plan for (unparsable, negative, too small,
    or a reserve that leaves nothing of the budget)."""


class BudgetOverDeviceError(BudgetError):
    """The budget is more memory than the device has: a plan that fits it would not fit the device."""

    def __init__(self, message: str, *, budget_bytes: int, device_name: str, device_memory_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.device_name = device_name
        self.device_memory_bytes = device_memory_bytes


class OptionError(ValueError):
    """An argument outside what the planner can use: a time limit that is not a positive number of
    seconds, a sequence longer than the model's positions."""


class OptionTypeError(OptionError, TypeError):
    """An argument of the wrong kind (a Plan, a TrainingLoop, TrainingArguments expected, something else
    given); a TypeError too, as the errors it replaces were."""


class DeviceError(ValueError):
    """A device name or value that names no device profile."""


class PlanMismatchError(ValueError):
    """A plan applied to (or verified on) a model or batch other than the one it was made for: another
    parameter shape or dtype, or, for verify, another batch; the message names the first difference."""


class InfeasibleBudgetError(ValueError):
    """`optimize` was asked for a budget no plan fits; `.plan` says how close it gets."""

    def __init__(self, plan: Any, message: str) -> None:
        super().__init__(message)
        self.plan = plan


class DistributedSetupError(RuntimeError):
    """FSDP was asked for, but this process is not part of a matching process group."""


class UnknownModelError(ValueError):
    """The spec is neither a preset nor a config.json; the message lists the presets."""


class ModelConfigError(ValueError):
    """A Hugging Face config that transformers rejects or cannot build a model from: not a JSON object,
    an unknown model_type, values of the wrong type, a hidden size its heads do not divide."""


class SolverTimeoutError(RuntimeError):
    """The ILP solver stopped at its time limit without an answer to rely on; says which limit to raise."""

    def __init__(self, time_limit_s: float, message: str | None = None) -> None:
        super().__init__(message or f"the solver ran out of time ({time_limit_s:g} s) before it found a plan: raise time_limit_s")
        self.time_limit_s = time_limit_s


class MissingExtraError(ImportError):
    """An optional dependency is missing (transformers for hf:, matplotlib for plots); says what to install."""


class PlotUnavailable(MissingExtraError):
    """matplotlib is not installed."""


class TargetError(Exception):
    """A CLI target (path/to/file.py:factory, package.module:factory, hf:CONFIG) could not be loaded."""


class TargetUsageError(TargetError):
    """The target or an option given with it is malformed (no factory named, an argument it does not take)."""


class TargetNotFoundError(TargetError):
    """The target's file, module, function or Hugging Face config does not exist."""


class FactoryError(TargetError):
    """Importing the target or calling its factory raised, or it returned no (model, example_inputs)."""
