"""Targets: what `autoplan plan TARGET` names, loaded into a model and one batch of example inputs.

    path/to/file.py:factory     a function in a file
    package.module:factory      a function in an importable module
    hf:gpt2 | hf:path/config.json   a Hugging Face preset or config, built on the meta device

A factory returns a model and its example inputs (`(model, inputs)`); it may take `batch_size`
and `seq_len` keyword arguments, which the CLI's options are passed to. Loading never prints or
exits; failures are `TargetError` subclasses (and `MissingExtraError`) that the CLI maps to exit codes.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map_only

from autoplan.errors import FactoryError, ModelConfigError, TargetNotFoundError, TargetUsageError, UnknownModelError
from autoplan.inputs import hf_models
from autoplan.vocabulary.formatting import first_line
from autoplan.vocabulary.signatures import accepts_argument
from autoplan.vocabulary.tensors import tensors_of
from autoplan.training.step_parts import parameter_count

HF_DEFAULT_BATCH = 1
HF_DEFAULT_SEQ = 1024


@dataclass(frozen=True)
class LoadedTarget:
    """What the command line's TARGET gives: the model, one batch, and how to build it again for a micro-batch."""

    spec: str  # as given on the command line
    model: torch.nn.Module
    example_inputs: Any
    batch_size: int | None  # the batch the inputs hold, when known
    seq_len: int | None  # their sequence length, when known
    parameter_count: int  # tied parameters once
    rebuild: Callable[[int], tuple[torch.nn.Module, Any]] | None  # micro-batch -> (model, inputs), for re-planning


def load_target(spec: str, *, batch_size: int | None = None, seq_len: int | None = None, meta: bool = True) -> LoadedTarget:
    """Load TARGET; `meta=False` builds hf: models with real (random) weights, to run them."""
    if spec.startswith("hf:"):
        return _load_hf(spec, spec[3:], batch_size, seq_len, meta)
    if ":" not in spec:
        raise TargetUsageError(f"target {spec!r} names no factory: write path/to/file.py:factory, package.module:factory or hf:CONFIG")
    where, _, name = spec.rpartition(":")
    module = _load_file(where) if where.endswith(".py") or "/" in where else _load_module(where)
    factory = getattr(module, name, None)
    if factory is not None and not callable(factory):
        raise TargetNotFoundError(f"{where}'s {name!r} is not a function (it is {type(factory).__name__}): name the function "
                                  "that returns (model, example_inputs)")
    if not callable(factory):
        raise TargetNotFoundError(f"{where} has no function {name!r}")
    return _call_factory(spec, factory, name, batch_size, seq_len)


def _load_file(path_text: str):
    path = Path(path_text)
    if path.is_dir():
        raise TargetNotFoundError(f"{path_text} is a folder: name the .py file in it, e.g. {path_text.rstrip('/')}/model.py:build")
    if not path.is_file():
        raise TargetNotFoundError(f"no such file: {path_text}")
    _import_paths(first=path.resolve().parent)
    unique = f"autoplan_target_{abs(hash(str(path.resolve())))}"
    loader = importlib.util.spec_from_file_location(unique, path)
    assert loader is not None and loader.loader is not None  # a .py file that exists has a source loader
    module = importlib.util.module_from_spec(loader)
    sys.modules[unique] = module  # dataclasses and pickling look their module up here
    try:
        loader.loader.exec_module(module)
    except SystemExit as error:
        raise FactoryError(_exited(f"importing {path_text}", error)) from error
    except Exception as error:
        raise FactoryError(f"importing {path_text} raised {type(error).__name__}: {first_line(error)}") from error
    return module


def _import_paths(first: Path | None = None) -> None:
    """Where the target's own imports come from, as `python path/to/file.py` would have it.

    The target file's folder goes first (its sibling modules import, from any working directory).
    The working directory goes last, after the standard library and installed packages: its
    packages import, but a `profile.py` or `copy.py` lying there shadows nothing autoplan or torch needs.
    """
    if first is not None and str(first) not in sys.path[:1]:
        sys.path.insert(0, str(first))
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.append(str(Path.cwd()))


def _exited(what: str, error: SystemExit) -> str:
    return (f"{what} called sys.exit({error.code!r}) (SystemExit; argparse exits like this): a target is imported and its "
            "factory called, so put the script's argument parsing and main code under `if __name__ == \"__main__\":`")


def _load_module(name: str):
    _import_paths()
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and name.startswith(error.name):
            raise TargetNotFoundError(f"no module named {name!r}") from error
        raise FactoryError(f"importing {name} raised {type(error).__name__}: {first_line(error)}") from error
    except SystemExit as error:
        raise FactoryError(_exited(f"importing {name}", error)) from error
    except Exception as error:
        raise FactoryError(f"importing {name} raised {type(error).__name__}: {first_line(error)}") from error


def _default(factory: Callable, parameter: str) -> Any:
    try:
        found = inspect.signature(factory).parameters.get(parameter)
    except (TypeError, ValueError):
        return None
    return None if found is None or found.default is inspect.Parameter.empty else found.default


def _call_factory(spec: str, factory: Callable, name: str, batch_size: int | None, seq_len: int | None) -> LoadedTarget:
    sizes = {}
    for option, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if value is not None:
            if not accepts_argument(factory, option):
                flag = "--" + option.replace("_", "-")
                raise TargetUsageError(f"{name}() takes no {option} argument: drop {flag} or add the parameter")
            sizes[option] = value

    def build(**sizes_now) -> tuple[torch.nn.Module, Any]:
        try:
            result = factory(**sizes_now)
        except SystemExit as error:
            raise FactoryError(_exited(f"{name}()", error)) from error
        except Exception as error:
            raise FactoryError(f"{name}() raised {type(error).__name__}: {first_line(error)}") from error
        if isinstance(result, torch.nn.Module):
            raise FactoryError(f"{name}() returned a model but no example inputs: return (model, example_inputs)")
        if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
            got = f"{len(result)} items" if isinstance(result, (tuple, list)) and len(result) != 2 else type(result).__name__
            if isinstance(result, (tuple, list)) and len(result) == 2:
                got = f"({type(result[0]).__name__}, {type(result[1]).__name__})"
            raise FactoryError(f"{name}() must return (model, example_inputs); it returned {got}")
        return result[0], result[1]

    model, inputs = build(**sizes)
    batch = batch_size or _default(factory, "batch_size") or _leading_dim(inputs)
    seq = seq_len or _default(factory, "seq_len")
    rebuild = None
    if accepts_argument(factory, "batch_size"):
        rebuild = lambda micro: build(**(sizes | {"batch_size": micro}))  # noqa: E731
    elif batch:
        rebuild = lambda micro: (model, _slice_batch(inputs, batch, micro))  # noqa: E731
    return LoadedTarget(spec, model, inputs, batch, seq, parameter_count(model), rebuild)


def _load_hf(spec: str, config: str, batch_size: int | None, seq_len: int | None, meta: bool = True) -> LoadedTarget:
    try:
        model = hf_models.model_from_config(config, meta=meta)  # needs transformers: MissingExtraError without it
    except ModelConfigError as error:
        raise TargetNotFoundError(f"hf:{first_line(error)}") from error
    except (FileNotFoundError, KeyError, ValueError, OSError) as error:
        hint = "" if isinstance(error, UnknownModelError) else f" (presets: {', '.join(sorted(hf_models.PRESETS))}, or a path to config.json)"
        raise TargetNotFoundError(f"hf:{config}: {first_line(error)}{hint}") from error
    batch = batch_size or HF_DEFAULT_BATCH
    limit = hf_models.max_positions(model)
    seq = seq_len or (min(HF_DEFAULT_SEQ, limit[0]) if limit else HF_DEFAULT_SEQ)
    inputs = hf_models.example_inputs_for(model, batch, seq)  # a seq_len over the model's positions: OptionError
    rebuild = lambda micro: (model, hf_models.example_inputs_for(model, micro, seq))  # noqa: E731
    return LoadedTarget(spec, model, inputs, batch, seq, parameter_count(model), rebuild)


def _leading_dim(inputs: Any) -> int | None:
    tensors = [t for t in tensors_of(inputs) if t.dim() > 0]
    return int(tensors[0].shape[0]) if tensors else None


def _slice_batch(inputs: Any, batch: int, micro: int) -> Any:
    """The first `micro` rows of every input tensor whose leading dim is the batch."""
    return tree_map_only(torch.Tensor, lambda t: t[:micro] if t.dim() > 0 and t.shape[0] == batch else t, inputs)
