"""All or nothing: the caller's model as it was before `apply`, put back when apply does not finish.

apply rewrites the model in steps: a 4-bit layer's bias cast to its compute dtype, `use_cache` off
in its configs, the previous plan's wrappers taken off, then each unit's forward wrapped on its
instance, one unit after another. An error or a Ctrl-C between two of them left a model some of
whose units ran the plan and others not (issue 39): it still trains, as no plan says. So
`restored_on_failure(model)` keeps what those steps can change, for every module of the model:
its class, its attributes, the dicts and sets among them (parameters, buffers, submodules, hooks),
the tensor each parameter and buffer holds, and the configs the modules hold (`use_cache`). On any
exception, KeyboardInterrupt included, it puts them back and lets the exception go on.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch


@dataclass(frozen=True)
class _ModuleState:
    module: torch.nn.Module
    cls: type
    attributes: dict[str, Any]  # a shallow copy of the module's __dict__
    contents: dict[str, dict | set]  # a copy of each dict or set in it: parameters, buffers, submodules, hooks
    data: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (parameter or buffer, the tensor it held)


def _state_of(module: torch.nn.Module) -> _ModuleState:
    attributes = dict(module.__dict__)
    contents = {name: value.copy() for name, value in attributes.items() if isinstance(value, (dict, set))}
    tensors = [*module._parameters.values(), *module._buffers.values()]
    data = tuple((tensor, tensor.data) for tensor in tensors if tensor is not None)
    return _ModuleState(module, type(module), attributes, contents, data)


def _restore(state: _ModuleState) -> None:
    module = state.module
    if type(module) is not state.cls:
        module.__class__ = state.cls
    for name, content in state.contents.items():  # the same dict and set objects, as they were
        held = state.attributes[name]
        held.clear()
        held.update(content)
    module.__dict__.clear()
    module.__dict__.update(state.attributes)
    for tensor, data in state.data:
        if tensor.data.dtype != data.dtype or tensor.data.shape != data.shape or tensor.data_ptr() != data.data_ptr():
            tensor.data = data  # `.data = ...` replaced what it held (settle_first_forward's bias cast)


def _configs(model: torch.nn.Module) -> dict[int, tuple[Any, dict[str, Any]]]:
    """Each config object a module of `model` holds (transformers' `config`), with a copy of its attributes."""
    found = (getattr(module, "config", None) for module in model.modules())
    return {id(config): (config, dict(vars(config))) for config in found if hasattr(config, "__dict__")}


@contextlib.contextmanager
def restored_on_failure(model: torch.nn.Module) -> Iterator[None]:
    """`model` as it was on entry if the body raises anything (the exception is raised again)."""
    modules = [_state_of(module) for module in model.modules()]
    configs = _configs(model)
    try:
        yield
    except BaseException:
        for config, attributes in configs.values():
            vars(config).clear()
            vars(config).update(attributes)
        for state in modules:
            _restore(state)
        raise
