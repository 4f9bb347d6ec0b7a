"""A framework case planned at its halfway budget and its real run counted: one copy, for the benchmark and the tests.

`planned(case)` plans `case` at the budget halfway between its lowest peak and its peak with no plan (found by
a plan at the ROOMY budget) and applies the plan to `case.model`; the Trainers' cases go through
`autoplan.hf.optimize_for_trainer`, which describes the Trainer's loop itself. `counted(case, model)` trains
`model` by the case's loop for STEPS optimizer steps, counted by the CPU allocator's own reports
(`autoplan/verify/allocator.py`): the peak is the highest of steps 2.. (step 1 makes the optimizer's state).
`benchmarks/framework_loops.py` prints the table of these; `tests/end_to_end/test_framework_loops.py` asserts on them.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any, Iterator

import torch

import autoplan
from autoplan.verify.allocator import AllocatorCount
from autoplan.vocabulary.descriptors import silenced
from tests.framework_loops import BASE_FIELDS, STEPS, Case
from tests.halfway import halfway_budget

ROOMY = "4GB"  # a budget every case fits: the plan there gives the peak with no plan and the lowest peak


@dataclass(frozen=True)
class Counted:
    """One counted run: the highest peak of steps 2.., each step's loss, and what the count could not see."""

    peak_bytes: int
    losses: list[float]
    unreported_frees: int  # storages alive before counting and freed during it (their frees are never reported)


@dataclass(frozen=True)
class Planned:
    """A case's plan, applied to its model, and what its run needs besides (the Trainer's arguments)."""

    plan: autoplan.Plan
    loop: autoplan.TrainingLoop
    run_options: dict[str, Any]


def planned(case: Case, base: bool = False) -> Planned:
    """Plan `case` at its halfway budget and apply the plan to `case.model`; `base`: with BASE_FIELDS only."""
    if case.trainer is not None:
        return planned_trainer(case)
    loop = case.loop_with(BASE_FIELDS if base else None)
    options = dict(example_inputs=case.example_inputs, device="cpu", precision="fp32", reserve=0, loop=loop)
    if case.loss_fn is not None:
        options["loss_fn"] = case.loss_fn
    planner = autoplan.Planner(case.model, **options)
    plan = planner.plan(halfway_budget(planner.plan(ROOMY)))
    autoplan.apply(case.model, plan)
    return Planned(plan, loop, {})


def planned_trainer(case: Case) -> Planned:
    """The Trainer's route: optimize_for_trainer plans the loop it knows the Trainer runs, and applies the plan."""
    from autoplan.hf import optimize_for_trainer

    given = case.trainer
    options = dict(device="cpu", reserve=0, train_dataset=given.train_dataset, data_collator=given.data_collator)
    probe = optimize_for_trainer(case.model, given.args, ROOMY, apply=False, **options)
    setup = optimize_for_trainer(case.model, given.args, halfway_budget(probe.plan), **options)
    return Planned(setup.plan, setup.loop, {"args": setup.training_args})


def counted(case: Case, model: torch.nn.Module, **run_options: Any) -> Counted:
    """Train `model` by the case's loop for STEPS steps, counted from what the model and the case hold."""
    with hushed(), AllocatorCount(resident=(model, case.resident)) as count:
        losses = case.run(model, STEPS, count, **run_options)
    steady = {f"step {i}" for i in range(2, STEPS + 1)}
    peak = max(stretch.peak_bytes for stretch in count.stretches() if stretch.label in steady)
    return Counted(peak, losses, count.unreported_frees)


@contextlib.contextmanager
def hushed() -> Iterator[None]:
    """What the frameworks print while they build and train (the Trainers' log lines, Lightning's notices, progress
    bars, c10's profiler warnings on the process's stderr): the table is the output. Errors still raise."""
    printed = io.StringIO()
    with silenced(1), silenced(2), contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        yield
