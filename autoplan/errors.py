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


class BudgetError(ValueError):
    """A budget or reserve that is not a size autoplan can plan for (unparsable, negative, too small)."""


class DeviceError(ValueError):
    """A device name or value that names no device profile."""


class InfeasibleBudgetError(ValueError):
    """`optimize` was asked for a budget no plan fits; `.plan` says how close it gets."""

    def __init__(self, plan: Any, message: str) -> None:
        super().__init__(message)
        self.plan = plan


class DistributedSetupError(RuntimeError):
    """FSDP was asked for, but this process is not part of a matching process group."""


class UnknownModelError(ValueError):
    """The spec is neither a preset nor a config.json; the message lists the presets."""


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
