"""autoplan.frameworks reads accelerate's Accelerator and Lightning's Trainer into the TrainingLoop they run."""

from __future__ import annotations

import pytest

from autoplan import TrainingLoop
from autoplan.errors import OptionTypeError
from autoplan.frameworks import accelerate_loop, accelerate_precision, host_batches_ahead, lightning_loop


def fresh_accelerator(**options):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # accelerate keeps one state a process: each test makes its own
    GradientState._reset_state()
    return Accelerator(cpu=True, **options)


def test_accelerate_loop_reads_accumulation_and_precision():
    pytest.importorskip("accelerate")
    accelerator = fresh_accelerator(gradient_accumulation_steps=4, mixed_precision="bf16")
    loop = accelerate_loop(accelerator, device="cpu")
    assert loop == TrainingLoop(accumulation_steps=4, batches_ahead=1)
    assert accelerate_precision(accelerator) == "bf16"
    assert accelerate_loop(accelerator, device="h100", keep_outputs=False).batches_ahead == 0  # read ahead on the host
    assert accelerate_precision(fresh_accelerator()) == "fp32"
    assert accelerate_loop(fresh_accelerator()).batches_ahead == 1  # its own device, the CPU, holds the batch ahead


def test_accelerate_loop_refuses_what_is_not_an_accelerator():
    with pytest.raises(OptionTypeError, match="accelerate_loop takes an accelerate.Accelerator; got dict"):
        accelerate_loop({})


def test_lightning_loop_zeroes_before_backward_and_reads_accumulation():
    lightning = pytest.importorskip("lightning")
    trainer = lightning.Trainer(accelerator="cpu", accumulate_grad_batches=3, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    loop = lightning_loop(trainer, device="cpu")
    assert loop == TrainingLoop(keep_outputs=False, accumulation_steps=3, zero_grad_before_backward=True, batches_ahead=1)
    assert lightning_loop(device="a100-80gb").accumulation_steps == 1 and host_batches_ahead("a100-80gb") == 0
    with pytest.raises(OptionTypeError, match="lightning_loop takes a lightning.Trainer"):
        lightning_loop(object())


def train_lightning(model, batches, callbacks):
    """Lightning's own loop, 4 steps of AdamW on `model` wrapped in a LightningModule; each step's loss."""
    import lightning
    import torch

    class Wrapped(lightning.LightningModule):
        def __init__(self, inner):
            super().__init__()
            self.model = inner

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    wrapped = Wrapped(model)
    wrapped.losses = []
    trainer = lightning.Trainer(accelerator="cpu", max_steps=len(batches), logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(wrapped, torch.utils.data.DataLoader(batches, batch_size=None))
    return wrapped.losses


@pytest.mark.slow  # a transformers model planned and trained by Lightning, twice
def test_the_lightning_callback_plans_the_inner_model_before_the_first_step_as_planned_by_hand():
    """The callback's plan is the one `plan(model, ..., loop=lightning_loop(trainer))` makes on the first batch (whose
    peak tests/end_to_end/test_framework_loops.py measures in Lightning's own loop), applied before the first
    forward: training equals the unplanned run's. (Counting the run here would nest torch's profiler: planning
    measures CPU kernels' scratch with it, so the count is made there, planned before the run.)"""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    import autoplan
    from autoplan.frameworks import lightning_callback, lightning_loop
    from tests import families
    from tests.halfway import halfway_budget

    family = families.BY_NAME["Llama"]
    batches = [dict(family.inputs(family.build())) for _ in range(4)]
    expected = train_lightning(family.build(), batches, [])
    options = dict(device="cpu", precision="fp32", reserve=0)
    planner = autoplan.Planner(family.build(), example_inputs=batches[0], loop=lightning_loop(device="cpu"), **options)
    by_hand = planner.plan(halfway_budget(planner.plan("1GB")))
    planning = lightning_callback(by_hand.request.budget_bytes, **options)
    losses = train_lightning(family.build(), batches, [planning])
    plan = planning.plan
    assert plan.request.loop == lightning_loop(device="cpu") and plan.request.loop.zero_grad_before_backward
    assert [unit.choice for unit in plan.decisions.units] == [unit.choice for unit in by_hand.decisions.units]
    assert plan.prediction.peak_bytes == by_hand.prediction.peak_bytes
    assert any(unit.choice.mode != "keep" for unit in plan.decisions.units)
    assert losses == pytest.approx(expected, abs=1e-5)


def test_the_lightning_callback_names_a_missing_module():
    lightning = pytest.importorskip("lightning")
    from autoplan.frameworks import lightning_callback

    callback = lightning_callback("1GB", module="net")
    with pytest.raises(OptionTypeError, match="pl_module.net"):
        callback.on_train_batch_start(None, lightning.LightningModule(), {}, 0)


def test_optimize_trainer_refuses_what_is_not_a_built_trainer():
    from autoplan.frameworks import optimize_trainer

    with pytest.raises(OptionTypeError, match="optimize_trainer takes a built transformers Trainer or trl SFTTrainer; got str"):
        optimize_trainer("trainer", "1GB")
