"""The real frameworks' training loops (eight cases), planned at their halfway budget and counted on real runs (the CPU allocator).

Each case of `tests/framework_loops/` is planned by the route a person takes (`measure.planned`: autoplan.Planner
with the case's TrainingLoop, or `optimize_for_trainer` for the two Trainers), rewritten, and trained for STEPS
optimizer steps by the framework's own loop; the same loop on a model built alike and not planned gives the losses
to match. The plan must checkpoint something (at halfway, a plan that keeps every unit is no test of the
rewrite), its prediction must hold (measured <= predicted) and be tight (measured >= 97% of it), and the rewrite
must not change the training (the losses equal the unplanned run's). `benchmarks/framework_loops.py` prints
the same numbers as a table.

A case whose library is not installed is skipped.
"""

from __future__ import annotations

import pytest

from tests.framework_loops import CASES, LIBRARIES, build
from tests.framework_loops.measure import ROOMY, Counted, Planned, counted, hushed, planned

TIGHT = 0.97  # measured >= TIGHT × predicted: a prediction far above the run would hold by being useless
LOSS_TOLERANCE = 1e-5


def failed_checks(decided: Planned, run: Counted, free: Counted) -> dict[str, str]:
    """Each check the planned run misses, with what it measured."""
    predicted, measured = decided.plan.prediction.peak_bytes, run.peak_bytes
    modes = [unit.choice.mode for unit in decided.plan.decisions.units]
    drift = max((abs(a - b) for a, b in zip(run.losses, free.losses)), default=float("inf"))
    failed = {}
    if not decided.plan.feasible:
        failed["feasible"] = f"the plan is not feasible at {decided.plan.request.budget_bytes:,} B"
    if all(mode == "keep" for mode in modes):
        failed["checkpoints"] = f"every unit kept: {modes}"
    if measured > predicted:
        failed["held"] = f"measured {measured:,} B > predicted {predicted:,} B (+{measured - predicted:,} B)"
    if measured < TIGHT * predicted:
        failed["tight"] = f"measured {measured:,} B < {TIGHT:.0%} of predicted {predicted:,} B"
    if len(run.losses) != len(free.losses) or not run.losses or drift > LOSS_TOLERANCE:
        failed["losses"] = f"planned {run.losses} vs unplanned {free.losses} (max diff {drift:.1e})"
    return failed


@pytest.mark.parametrize("name", CASES)
def test_planned_loop_holds_its_prediction_and_trains_alike(name):
    for library in LIBRARIES[name]:
        pytest.importorskip(library)
    with hushed():
        case = build(name)
    decided = planned(case)
    run = counted(case, case.model, **decided.run_options)
    with hushed():
        unplanned = build(name)  # the same seeds: the same weights and batches, never planned
    free = counted(unplanned, unplanned.model)
    failed = failed_checks(decided, run, free)
    assert not failed, "; ".join(f"{check}: {what}" for check, what in failed.items())


def test_the_cases_describe_their_loops():
    """Lightning zeroes the gradients before backward; the Trainer fetches the whole step (optimize_for_trainer's loop)."""
    for library in ("transformers", "accelerate", "lightning"):
        pytest.importorskip(library)
    from autoplan.hf import optimize_for_trainer

    with hushed():
        lightning, trainer = build("lightning"), build("trainer")
    assert lightning.loop.zero_grad_before_backward is True
    given = trainer.trainer
    with hushed():
        setup = optimize_for_trainer(trainer.model, given.args, ROOMY, apply=False, device="cpu", reserve=0,
                                     train_dataset=given.train_dataset, data_collator=given.data_collator)
    assert setup.loop.fetches_whole_step is True
