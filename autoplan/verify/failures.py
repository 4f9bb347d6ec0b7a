"""What to say when the model's own training step fails in verify's real steps.

A model that cannot train a second step (a library keeps state its second forward trips over) is the
model's or the library's problem, not autoplan's; the person needs one line that names where it
failed, so they know whom to ask, and which step, so they know it is not the plan's first forward.
"""

from __future__ import annotations

import os
import traceback

_AUTOPLAN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def failed_step_message(error: BaseException, step: int, steps: int) -> str:
    """One line: the step, the error, and the innermost frame outside autoplan and torch's own machinery."""
    where = _where(error)
    earlier = "; the steps before it ran" if step else ""
    return (f"the model's own training step {step + 1} of {steps} failed{earlier}: {type(error).__name__}: {_first_line(error)}"
            f" (in {where}). Train two steps of the model without autoplan to see whether it fails the same way; "
            "if it does, the model or that library cannot train as set up")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else "(no message)"


def _where(error: BaseException) -> str:
    """The innermost frame of the model's or a library's code (not autoplan's, not torch's): `library: module.function,
    line N` in an installed package, `file.py:N, function` otherwise; and torch's function it called, if it raised there."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if not os.path.abspath(frame.filename).startswith(_AUTOPLAN)]
    if not frames:
        return "autoplan's own code"
    culprit = next((frame for frame in reversed(frames) if _package(frame.filename) != "torch"), frames[-1])
    where = _describe(culprit)
    if frames[-1] is not culprit:
        where += f", calling {_describe(frames[-1])}"
    return where


def _package(filename: str) -> str | None:
    path = filename.replace(os.sep, "/")
    return path.split("-packages/", 1)[1].split("/")[0] if "-packages/" in path else None


def _describe(frame: traceback.FrameSummary) -> str:
    path = frame.filename.replace(os.sep, "/")
    if "-packages/" in path:
        module = path.split("-packages/", 1)[1].removesuffix(".py").replace("/", ".")
        return f"{module.split('.')[0]}: {module}.{frame.name}, line {frame.lineno}"
    return f"{frame.filename}:{frame.lineno}, {frame.name}"
