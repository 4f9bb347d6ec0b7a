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
