"""Every mistake a user can make is an `autoplan.errors` class with an exit code other than 1 (issue 25).

Exit 1 means "a bug of autoplan"; a bad option or input must say what to change instead. Two checks:
every class of `autoplan.errors` maps to a code of its own (`cli.exits.EXIT_CODES`), and each raise
site for a user's mistake, triggered directly (no planning), raises one of those classes, still a
ValueError or TypeError as before, so `except ValueError` in a caller's code keeps working.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import autoplan
import autoplan.errors as errors
from autoplan.cli.exits import ExitCode, exit_code_for
from autoplan.errors import LossError, OptionError, OptionTypeError, PlanMismatchError, SparseGradientError
from autoplan.units import GraphRun, Segment
from tests.cli.test_bad_input import CASES, HF_CASES

NEVER_RAISED = {errors.TargetError}  # the base of the target errors: each failure raises a subclass
ERROR_CLASSES = [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
                 if issubclass(cls, BaseException) and cls.__module__ == errors.__name__ and cls not in NEVER_RAISED]


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_every_error_class_has_an_exit_code_of_its_own(cls) -> None:
    error = cls.__new__(cls)  # no constructor call: some take a plan or sizes
    assert exit_code_for(error) not in (ExitCode.ERROR, ExitCode.FITS), cls


def test_the_cli_bad_input_table_has_no_exit_1() -> None:
    codes = {name: code for name, (_, code, _) in (CASES | HF_CASES).items()}
    assert ExitCode.ERROR not in codes.values(), codes
    assert {"integer output", "integer output (verify)"} <= set(codes)  # the loss one, once a ValueError


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _meta_mlp() -> torch.nn.Module:
    with torch.device("meta"):
        return _mlp()


def _loop(**fields):
    return lambda: autoplan.TrainingLoop(**fields)


def _call(module: str, name: str, *args, **kwargs):
    def call():
        namespace = __import__(module, fromlist=[name])
        return getattr(namespace, name)(*args, **kwargs)
    return call


# (what, the call, the class it raises, the builtin it still is, words of the message)
MISTAKES = {
    "loop: accumulation 0": (_loop(accumulation_steps=0), OptionError, ValueError, "accumulation_steps"),
    "loop: unknown implementation": (_loop(optimizer_impl="fast"), OptionError, ValueError, "optimizer_impl"),
    "loop: a string for a flag": (_loop(keep_outputs="yes"), OptionError, ValueError, "keep_outputs"),
    "loop: loss_in_model not a bool": (_loop(loss_in_model="yes"), OptionError, ValueError, "loss_in_model"),
    "loop: unknown field": (_call("autoplan.inputs.loop", "check_loop", {"steps": 2}), OptionTypeError, TypeError, "'steps'"),
    "loop: not a loop": (_call("autoplan.inputs.loop", "check_loop", 3), OptionTypeError, TypeError, "TrainingLoop"),
    "batch: none for a plain model": (_call("autoplan.inputs.batch", "training_batch", _mlp(), None, None, None),
                                      OptionError, ValueError, "example_inputs is required"),
    "batch: both inputs and sizes": (_call("autoplan.inputs.batch", "training_batch", _mlp(), (torch.randn(2, 4),), 2, None),
                                     OptionError, ValueError, "not both"),
    "batch: a number": (_call("autoplan.inputs.batch", "normalize_inputs", 3), OptionTypeError, TypeError, "got int"),
    "optimizer: unknown name": (_call("autoplan.training.step_parts", "optimizer_name", "adamw9"),
                                OptionError, ValueError, "adamw9"),
    "loss: integer output": (_call("autoplan.training.step_parts", "sum_of_outputs", torch.tensor([1, 2])),
                             LossError, ValueError, "no floating-point tensor"),
    "loss: loop says the model computes it": (lambda: autoplan_loss(True)(torch.randn(2)), LossError, ValueError, "no .loss"),
    # issue 39: torch's "grad can be implicitly created only for real scalar outputs" named neither the loss nor loss_fn=
    "loss: complex output": (_call("autoplan.training.step_parts", "sum_of_outputs", torch.randn(2, dtype=torch.complex64)),
                             LossError, ValueError, "output is complex (complex64), and the loss must be a real scalar"),
    "loss: complex": (_call("autoplan.training.step_parts", "real_scalar", torch.tensor(1 + 1j)), LossError, ValueError,
                      "the loss must be a real scalar to backpropagate, and it is a complex64 tensor of shape ()"),
    "loss: not a scalar": (_call("autoplan.training.step_parts", "real_scalar", torch.randn(3)), LossError, ValueError,
                           "it is a float32 tensor of shape (3,): return a real scalar loss from forward"),
    "sparse embedding": (_call("autoplan.planner", "_check_dense_gradients", torch.nn.Embedding(4, 2, sparse=True)),
                         SparseGradientError, ValueError, "Embedding has 1 embedding layer(s) with sparse gradients"),
    "precision: unknown": (lambda: _precision("int8", "h100"), OptionError, ValueError, "'int8'"),
    "precision: bf16 on a t4": (lambda: _precision("bf16", "t4"), OptionError, ValueError, "no bf16"),
    "profile: not a trace": (_call("autoplan.profile.profiler", "profile", object(), None), OptionTypeError, TypeError, "Traced"),
    "world size 0": (_call("autoplan.inputs.settings", "check_world_size", 0), OptionError, ValueError, "world_size"),
    "plan: a misspelled option": (_call("autoplan", "plan", _mlp(), "1GB", exmaple_inputs=(torch.randn(2, 4),)), OptionTypeError,
                                  TypeError, "did you mean 'example_inputs'"),
    "optimize: an unknown option": (_call("autoplan", "optimize", _mlp(), "1GB", zzz=1), OptionTypeError, TypeError,
                                    "optimize() got an unexpected keyword argument 'zzz'; the options are example_inputs"),
    "apply: not a plan": (_call("autoplan", "apply", _mlp(), "plan.json"), OptionTypeError, TypeError, "got str"),
    "apply: a meta model": (_call("autoplan.apply.rewrite", "refuse_meta", _meta_mlp()), OptionError, ValueError, "meta device"),
    "verify: not a plan": (_call("autoplan", "verify", _mlp(), None, example_inputs=(torch.randn(2, 4),)),
                           OptionTypeError, TypeError, "verify() takes a Plan"),
    "advise: not a plan": (_call("autoplan.report.advice", "advise", None, None), OptionTypeError, TypeError, "advise()"),
    "fsdp of a graph unit": (_call("autoplan.apply.sharding", "_unit_modules", _mlp(), GraphRun("a", "b")), OptionError, ValueError,
                             "units=["),
    "graph unit of another model": (_call("autoplan.planned.graph", "split_by_units", _mlp(), [GraphRun("x", "y")]),
                                    PlanMismatchError, ValueError, "'graph[x:y]'"),
    "segment of another model": (_call("autoplan.vocabulary.names", "segment_members",
                                       torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2)),
                                       Segment("0.0", "1")), PlanMismatchError, ValueError, "not two children of one module"),
    "measure a meta model": (_call("autoplan.planner", "_should_measure", "measure", _meta_mlp(), None), OptionError, ValueError,
                             "profile='roofline'"),
    "checkpoint mode unknown": (_call("autoplan.solve.search", "pinned_choices", ["a"], ("fp32",), None, {"a": "half"}),
                                OptionError, ValueError, "'half'"),
    "plot file suffix": (_call("autoplan.report.plot", "plot_memory", None, None, "plot.txt"), OptionError, ValueError, ".png"),
}


def autoplan_loss(loss_in_model: bool):
    from autoplan.training.step_parts import loss_function

    return loss_function(None, loss_in_model)


def _precision(precision: str, device: str):
    from autoplan.inputs.devices import get_device
    from autoplan.axes.precision import choices_for

    return choices_for(precision, get_device(device))


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_users_mistake_is_an_autoplan_error_with_an_exit_code(mistake: str) -> None:
    call, cls, builtin, says = MISTAKES[mistake]
    with pytest.raises(cls) as raised:
        call()
    assert isinstance(raised.value, builtin), "callers' `except ValueError/TypeError` must keep catching it"
    assert says in str(raised.value), str(raised.value)
    assert exit_code_for(raised.value) not in (ExitCode.ERROR, ExitCode.FITS)
