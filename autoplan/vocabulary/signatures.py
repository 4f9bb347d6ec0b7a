"""What a callable accepts, read from its signature (factories, model forwards)."""

from __future__ import annotations

import inspect
from typing import Callable


def accepts_argument(function: Callable, name: str, *, through_kwargs: bool = True) -> bool:
    """Whether `function` takes an argument `name`: a named parameter, or (with `through_kwargs`) **kwargs.

    A callable whose signature cannot be read (some builtins) accepts nothing.
    """
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    if name in parameters:
        return True
    return through_kwargs and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
