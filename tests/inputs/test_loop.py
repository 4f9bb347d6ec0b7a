"""The training loop is an input of the plan, and the predicted peak holds in that loop.

Every prediction here is checked against real CPU training steps of the rewritten model, run as
the planned loop says (`autoplan.verify`: the live bytes of real tensors, counted by the tracker
the simulation uses). The claim, for the Hugging Face families of `tests/families.py`, the
plain-PyTorch zoo of `tests/models.py` and gradient accumulation: the measured peak is never above
the predicted one, and at most 3% below it. `benchmarks/loops.py` prints the same check as a table.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import autoplan
from autoplan import TrainingLoop
from tests import families
from tests.halfway import halfway_plan
from tests.models import ALL_MODELS

KEPT = TrainingLoop()  # outputs = model(**batch); outputs.loss.backward(): logits alive through backward
DROPPED = TrainingLoop(keep_outputs=False)  # model(**batch).loss.backward(): the output dropped first
TOLERANCE = 0.03  # the measured peak is at most this far below the prediction (and never above)


def assert_holds(result: autoplan.Verification) -> None:
    measured, predicted = result.measured_peak_bytes, result.predicted_peak_bytes
    assert measured <= predicted, f"under-predicted: measured {measured} > predicted {predicted}"
    assert measured >= (1 - TOLERANCE) * predicted, f"over-predicted by more than 3%: measured {measured}, predicted {predicted}"
    assert result.held


def family_plan(name: str, loop: TrainingLoop) -> autoplan.Plan:
    """The family's plan for `loop` at static memory + half the common loop's activations."""
    checked = families.planned(name)  # the common loop's plan, shared with tests/hf/test_models.py
    if loop == KEPT:
        return checked.plan
    model = families.BY_NAME[name].build()
    return autoplan.plan(model, checked.budget, batch_size=families.BATCH, seq_len=families.SEQ, device="cpu",
                         precision="fp32", reserve=0, loop=loop)


def verify_family(name: str, plan: autoplan.Plan) -> autoplan.Verification:
    family = families.BY_NAME[name]
    model = family.build()
    return autoplan.verify(model, plan, example_inputs=family.inputs(model), steps=2)


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("loop", [KEPT, DROPPED], ids=["outputs-kept", "outputs-dropped"])
@pytest.mark.parametrize("name", [f.name for f in families.FAMILIES])
def test_hf_family_peak_holds_in_the_planned_loop(name, loop):
    pytest.importorskip("transformers")
    plan = family_plan(name, loop)
    assert plan.outcome.feasible and plan.request.loop == loop
    assert any(u.choice.mode != "keep" for u in plan.decisions.units)  # the budget makes the plan checkpoint
    assert_holds(verify_family(name, plan))


def zoo_plan(name: str, loop: TrainingLoop):
    """A zoo model planned for `loop` halfway between its no-plan peak and the lowest it can reach."""
    model, inputs = ALL_MODELS[name]()
    repeat = 64 if name in ("flat", "mlp") else 4  # a batch whose activations matter
    inputs = tuple(t.repeat(repeat, *[1] * (t.dim() - 1)) for t in inputs)
    options = dict(example_inputs=inputs, device="cpu", precision="fp32", reserve=0, loop=loop)
    return model, inputs, halfway_plan(model, "4GB", **options)


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("loop", [KEPT, DROPPED], ids=["outputs-kept", "outputs-dropped"])
@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_zoo_peak_holds_in_the_planned_loop(name, loop):
    model, inputs, plan = zoo_plan(name, loop)
    assert plan.outcome.feasible and plan.request.loop == loop
    assert_holds(autoplan.verify(model, plan, example_inputs=inputs, steps=2))


ACCUMULATING = {"2": TrainingLoop(accumulation_steps=2), "4-dropped": TrainingLoop(accumulation_steps=4, keep_outputs=False)}


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("loop", ACCUMULATING.values(), ids=ACCUMULATING.keys())
@pytest.mark.parametrize("name", ["tiny_gpt", "small_resnet", "skipnet"])
def test_gradient_accumulation_peak_holds(name, loop):
    model, inputs, plan = zoo_plan(name, loop)
    assert plan.outcome.feasible and any(u.choice.mode != "keep" for u in plan.decisions.units)
    assert_holds(autoplan.verify(model, plan, example_inputs=inputs, steps=2))


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("loop", ACCUMULATING.values(), ids=ACCUMULATING.keys())
def test_hf_gradient_accumulation_peak_holds(loop):
    pytest.importorskip("transformers")
    plan = family_plan("Llama", loop)
    assert plan.outcome.feasible
    assert_holds(verify_family("Llama", plan))


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize(
    "loop",
    [TrainingLoop(optimizer_impl="foreach", grad_scaler=True), TrainingLoop(optimizer_impl="fused", zero_grad_set_to_none=False)],
    ids=["foreach-gradscaler", "fused-zeroed-gradients"],
)
def test_optimizer_implementation_grad_scaler_and_zero_grad_hold_for_real(loop):
    model, inputs, plan = zoo_plan("tiny_gpt", loop)
    result = autoplan.verify(model, plan, example_inputs=inputs, steps=2)
    assert result.loop == loop
    assert_holds(result)


def no_plan_peak(loop: TrainingLoop | None, name: str = "tiny_gpt", repeat: int = 1) -> int:
    model, inputs = ALL_MODELS[name]()
    inputs = tuple(t.repeat(repeat, *[1] * (t.dim() - 1)) for t in inputs)
    return autoplan.plan(model, "4GB", example_inputs=inputs, device="cpu", precision="fp32", reserve=0, loop=loop).prediction.baseline_peak_bytes


@pytest.mark.slow  # the whole pipeline
def test_each_loop_field_changes_the_predicted_peak_the_way_it_changes_memory():
    kept = no_plan_peak(KEPT)
    assert kept > no_plan_peak(DROPPED)  # the logits stay alive through backward
    # gradients alive through forward and backward: the earlier micro-batches', or zeroed rather than freed
    assert no_plan_peak(TrainingLoop(accumulation_steps=2)) > kept
    assert no_plan_peak(TrainingLoop(zero_grad_set_to_none=False)) > kept
    # a wide MLP on one sample peaks in optimizer.step(): foreach's temporaries are all parameters
    # at once, the for-loop's one parameter at a time, fused has none
    impl = {name: no_plan_peak(TrainingLoop(optimizer_impl=name), "mlp") for name in ("foreach", "for-loop", "fused")}
    assert impl["foreach"] > impl["for-loop"] > impl["fused"]


@pytest.mark.slow  # the whole pipeline
def test_the_plan_states_the_loop_it_assumed():
    loop = TrainingLoop(keep_outputs=False, accumulation_steps=4, optimizer_impl="fused")
    model, inputs = ALL_MODELS["tiny_gpt"]()
    plan = autoplan.plan(model, "4GB", example_inputs=inputs, device="cpu", loop=loop)
    assert plan.request.loop == loop
    assert json.loads(plan.to_json())["loop"] == dataclasses.asdict(loop)
    report = plan.report()
    assert "4 micro-batches per optimizer step" in report and "outputs dropped before backward" in report
    assert "adamw optimizer, fused implementation" in " ".join(report.split())
    assert autoplan.plan(model, "4GB", example_inputs=inputs, device="cpu").request.loop == TrainingLoop()  # the common loop


def test_the_loop_line_says_the_optimizer_and_its_implementation_apart():
    # issue 39: "auto optimizer" read as if autoplan had chosen the optimizer; auto is the implementation (foreach/fused)
    assert TrainingLoop().describe("adamw").endswith(", adamw optimizer, torch's default implementation")
    assert TrainingLoop(optimizer_impl="foreach").describe("sgd").endswith(", sgd optimizer, foreach implementation")


@pytest.mark.slow  # the whole pipeline
def test_bad_loops_are_clear_errors():
    with pytest.raises(ValueError, match="accumulation_steps"):
        TrainingLoop(accumulation_steps=0)
    with pytest.raises(ValueError, match="optimizer_impl"):
        TrainingLoop(optimizer_impl="apex")
    with pytest.raises(ValueError, match="keep_outputs"):
        TrainingLoop(keep_outputs="yes")
    model, inputs = ALL_MODELS["mlp"]()  # returns a tensor: no .loss
    with pytest.raises(TypeError, match="TrainingLoop"):
        autoplan.plan(model, "4GB", example_inputs=inputs, device="cpu", loop="dropped")
    with pytest.raises(TypeError, match="no field 'keep_output'"):  # a mapping of fields (plan.request.arguments's form) is checked
        autoplan.plan(model, "4GB", example_inputs=inputs, device="cpu", loop={"keep_output": False})
    with pytest.raises(ValueError, match="loss_in_model=True"):
        autoplan.plan(model, "4GB", example_inputs=inputs, device="cpu", loop=TrainingLoop(loss_in_model=True))


@pytest.mark.slow  # the whole pipeline
def test_cli_loop_options_reach_the_plan_and_verify_runs_that_loop(tmp_path):
    from typer.testing import CliRunner

    from autoplan.cli.app import app

    path = tmp_path / "verify.json"
    result = CliRunner().invoke(app, [
        "verify", "tests/cli_factories.py:tiny_gpt", "--budget", "200MB", "--on", "cpu", "--steps", "2", "--drop-outputs",
        "--accumulation-steps", "2", "--optimizer-impl", "foreach", "--json", str(path),
    ])
    assert result.exit_code == 0, result.output
    document = json.loads(path.read_text())
    expected = dataclasses.asdict(TrainingLoop(keep_outputs=False, accumulation_steps=2, optimizer_impl="foreach"))
    assert document["plan"]["loop"] == expected and document["verification"]["loop"] == expected
    verification = document["verification"]
    assert -TOLERANCE <= verification["peak_error"] <= 0


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("loop", [KEPT, TrainingLoop(keep_outputs=False, accumulation_steps=2)], ids=["kept", "dropped-accumulated"])
def test_a_loop_shape_is_simulated_and_measured_by_the_same_runner(monkeypatch, loop):
    """A change to the step's one runner (here: the loop also holding a 1 MiB tensor from each
    micro-batch on) moves the plan's prediction and the real steps' measurement alike."""
    import torch

    from autoplan.training.runner import LoopRunner

    model, inputs = ALL_MODELS["tiny_gpt"]()
    plan = autoplan.plan(model, "1GB", example_inputs=inputs, device="cpu", precision="fp32", reserve=0, loop=loop)
    measured = autoplan.verify(model, plan, example_inputs=inputs).measured_peak_bytes
    micro_batch = LoopRunner.micro_batch

    def holding_more(self, args, kwargs, record_loss=None, **keywords):
        self.extra = None
        self.extra = torch.empty(2**18)  # alive through the step and into the next forward
        micro_batch(self, args, kwargs, record_loss, **keywords)

    monkeypatch.setattr(LoopRunner, "micro_batch", holding_more)
    holding = autoplan.plan(model, "1GB", example_inputs=inputs, device="cpu", precision="fp32", reserve=0, loop=loop)
    assert holding.prediction.simulated_peak_bytes == plan.prediction.simulated_peak_bytes + 2**20
    assert autoplan.verify(model, holding, example_inputs=inputs).measured_peak_bytes == measured + 2**20
