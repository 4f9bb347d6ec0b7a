"""The loop fields frameworks need (issue 37), each checked in a loop written by hand in that shape.

Every loop here is written out in the test, not run by autoplan's `LoopRunner`, and counted by the
CPU allocator's own reports (`verify.allocator.AllocatorCount`, steps 2 to 4), so a field that
simulated one thing while the framework does another would show. Each field's test also shows that
the plan made without the field does not hold in that loop (or says why it cannot fail otherwise).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoplan
from autoplan import TrainingLoop
from autoplan.training.step_parts import default_loss
from autoplan.verify.allocator import AllocatorCount
from tests.halfway import halfway_plan

TOLERANCE = 0.03  # measured at most this far below the prediction, never above
STEPS = 4


class Stack(nn.Module):
    """Residual MLP blocks on float inputs: the batch is a few percent of the peak, as with images."""

    def __init__(self, width: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def build(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return Stack(), torch.randn(256, 64)


def planned(loop: TrainingLoop, **options) -> tuple[autoplan.Plan, nn.Module, torch.Tensor]:
    model, batch = build()
    plan = halfway_plan(model, example_inputs=(batch,), device="cpu", precision="fp32", reserve=0, loop=loop, **options)
    assert any(unit.choice.mode != "keep" for unit in plan.decisions.units)
    autoplan.apply(model, plan)
    return plan, model, batch


def planned_without_batch(loop: TrainingLoop, **options) -> tuple[autoplan.Plan, nn.Module]:
    """For a loop that makes its own batches: the example batch is not kept alive beside them."""
    plan, model, _ = planned(loop, **options)
    return plan, model


def counted(step, resident) -> int:
    """The peak of steps 2.. of `step()` (the first makes the optimizer state), by the CPU allocator's count."""
    with AllocatorCount(resident=resident) as count:
        for index in range(STEPS):
            if index == 1:
                count.mark("steady")
            step(index)
    return max(stretch.peak_bytes for stretch in count.stretches()[1:])


def assert_holds(measured: int, plan: autoplan.Plan) -> None:
    predicted = plan.prediction.peak_bytes
    assert measured <= predicted, f"under-predicted: measured {measured:,} > predicted {predicted:,}"
    assert measured >= (1 - TOLERANCE) * predicted, f"over-predicted by more than 3%: {measured:,} of {predicted:,}"


def lightning_order(model: nn.Module, batch: torch.Tensor) -> int:
    """Lightning's automatic optimization: training_step, then zero_grad, then backward, then the step."""
    optimizer = torch.optim.AdamW(model.parameters())

    def step(_):
        loss = model(batch).sum()  # training_step returns the loss; the output is dropped
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return counted(step, (model, batch, optimizer))


def test_zero_grad_before_backward_holds_in_lightnings_order():
    lightning = TrainingLoop(keep_outputs=False, zero_grad_before_backward=True)
    plan, model, batch = planned(lightning)
    assert_holds(lightning_order(model, batch), plan)
    assert "zero_grad before backward" in plan.report()
    # without the field the last step's gradients are missing from the forward: that plan does not hold there
    plain, model, batch = planned(TrainingLoop(keep_outputs=False))
    assert lightning_order(model, batch) > plain.prediction.peak_bytes


BATCH_BYTES = 256 * 64 * 4


def get_batch() -> torch.Tensor:
    return torch.randn(256, 64)


def fetch_ahead(model: nn.Module) -> int:
    """nanoGPT's loop: the next batch is fetched right after the forward, while the current one trains."""
    optimizer = torch.optim.AdamW(model.parameters())
    held: dict[str, torch.Tensor] = {}

    def step(index):
        if index == 0:
            held["x"] = get_batch()
        loss = model(held["x"]).sum()
        held["x"] = get_batch()  # the next batch, fetched while this one's graph still holds it
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return counted(step, (model, optimizer))


def test_batches_ahead_holds_with_a_batch_fetched_during_the_step():
    plan, model = planned_without_batch(TrainingLoop(keep_outputs=False, batches_ahead=1))
    assert plan.prediction.breakdown.loop_held == BATCH_BYTES
    assert_holds(fetch_ahead(model), plan)
    plain, model = planned_without_batch(TrainingLoop(keep_outputs=False))
    assert fetch_ahead(model) > plain.prediction.peak_bytes


def whole_step_fetched(model: nn.Module, micro_batches: int) -> int:
    """The Trainer's loop: every micro-batch of the step fetched (get_batch_samples), then each trained in turn."""
    optimizer = torch.optim.AdamW(model.parameters())

    def step(_):
        fetched = [get_batch() for _ in range(micro_batches)]
        for micro in fetched:
            (model(micro).sum() / micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return counted(step, (model, optimizer))


def test_fetches_whole_step_holds_every_micro_batch_of_the_step():
    trainer = TrainingLoop(keep_outputs=False, accumulation_steps=3, fetches_whole_step=True)
    assert trainer.batches_on_device == 3 and trainer.accumulating(2).batches_on_device == 6
    plan, model = planned_without_batch(trainer)
    assert plan.prediction.breakdown.loop_held == 2 * BATCH_BYTES
    assert_holds(whole_step_fetched(model, 3), plan)
    plain, model = planned_without_batch(TrainingLoop(keep_outputs=False, accumulation_steps=3))
    assert whole_step_fetched(model, 3) > plain.prediction.peak_bytes


def with_frozen_encoder(model: nn.Module, encoder: nn.Module, raw: torch.Tensor, target: torch.Tensor) -> int:
    """A diffusion-style step: a frozen encoder on the device makes the model's input, the loss compares with a target."""
    optimizer = torch.optim.AdamW(model.parameters())

    def step(_):
        with torch.no_grad():
            latents = encoder(raw)
        loss = nn.functional.mse_loss(model(latents), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return counted(step, (model, encoder, raw, target, optimizer))


def test_kept_on_device_counts_frozen_modules_and_the_loops_tensors():
    torch.manual_seed(1)
    encoder = nn.Linear(32, 64).requires_grad_(False)
    ema = copy.deepcopy(Stack())  # an EMA copy: held, never trained
    raw, target = torch.randn(256, 32), torch.randn(256, 64)
    loop = TrainingLoop(keep_outputs=False).keeping(encoder, ema, raw, target)
    assert loop.kept_on_device_bytes == sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in
                                            [*encoder.parameters(), *ema.parameters(), raw, target])

    def loss_fn(output):  # the target is the loop's, so its bytes are already counted as kept
        return nn.functional.mse_loss(output, target)

    plan, model = planned_without_batch(loop, loss_fn=loss_fn)
    assert plan.prediction.breakdown.loop_held == loop.kept_on_device_bytes
    assert "held by the loop" in plan.report()
    assert_holds(with_frozen_encoder(model, encoder, raw, target) + ema_bytes(ema), plan)
    plain, model = planned_without_batch(TrainingLoop(keep_outputs=False), loss_fn=loss_fn)
    assert with_frozen_encoder(model, encoder, raw, target) + ema_bytes(ema) > plain.prediction.peak_bytes


def ema_bytes(ema: nn.Module) -> int:
    """The EMA copy was made before counting began, and the step does not touch it: held all along."""
    return sum(-(-p.untyped_storage().nbytes() // 512) * 512 for p in ema.parameters())


class TupleLoss(nn.Module):
    """nanoGPT's forward: `(logits, loss)` when targets are given."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = Stack(), nn.Linear(64, 512)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.body(x))
        return logits, nn.functional.cross_entropy(logits, targets)


def test_a_tuple_output_with_one_scalar_trains_on_that_scalar():
    logits, loss = torch.randn(4, 8), torch.tensor(1.5)
    assert default_loss((logits, loss)) is loss
    assert default_loss([logits, loss]) is loss
    two = default_loss((logits, loss, torch.tensor(2.0)))  # a loss and a metric: not guessed, the outputs are summed
    assert two.item() == pytest.approx(logits.sum().item() + 3.5)

    torch.manual_seed(0)
    model, x, targets = TupleLoss(), torch.randn(256, 64), torch.randint(0, 512, (256,))
    # `logits, loss = model(X, Y)` keeps the logits alive through backward: the outputs are kept
    plan = halfway_plan(model, example_inputs=(x, targets), device="cpu", precision="fp32", reserve=0, loop=TrainingLoop())
    assert not any("sum" in note for note in plan.notes)  # the loss was found, not summed for want of one
    autoplan.apply(model, plan)
    optimizer = torch.optim.AdamW(model.parameters())

    def step(_):
        logits, loss = model(x, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    assert_holds(counted(step, (model, x, targets, optimizer)), plan)


def test_the_new_fields_are_checked_and_described():
    with pytest.raises(autoplan.errors.OptionError, match="batches_ahead must be a whole number"):
        TrainingLoop(batches_ahead=-1)
    with pytest.raises(autoplan.errors.OptionError, match="kept_on_device_bytes"):
        TrainingLoop(kept_on_device_bytes=1.5)
    with pytest.raises(autoplan.errors.OptionError, match="zero_grad_before_backward must be True or False"):
        TrainingLoop(zero_grad_before_backward="yes")
    with pytest.raises(autoplan.errors.OptionTypeError, match="keeping\\(\\) counts modules and tensors"):
        TrainingLoop().keeping("vae")
    tensors = [torch.zeros(1000), torch.zeros(10)]
    assert TrainingLoop().keeping(tensors, {"ids": tensors[0]}).kept_on_device_bytes == 4096 + 512  # a storage once
    text = TrainingLoop(accumulation_steps=2, fetches_whole_step=True, batches_ahead=1).describe()
    assert "3 micro-batches on the device" in text


def amp_recipe(model: nn.Module, plan: autoplan.Plan, batch: dict, labels: torch.Tensor, criterion) -> int:
    """`plan` applied to `model`, trained by the PyTorch AMP recipe; the peak of steps 2.. by the CPU allocator."""
    autoplan.apply(model, plan)
    optimizer = torch.optim.AdamW(model.parameters())

    def step(_):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(**batch)
            loss = criterion(out.logits.flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return counted(step, (model, batch, labels, optimizer))


@pytest.mark.slow  # a transformers model planned and trained
def test_the_amp_recipe_around_a_planned_model_is_predicted_within_one_percent():
    """`with torch.autocast(...): out = model(**batch); loss = criterion(...)`, then backward outside it: the loop of
    the PyTorch AMP docs (the seeds' recipe), around the planned model, counted by the CPU allocator."""
    pytest.importorskip("transformers")
    from tests import families

    family = families.BY_NAME["Llama"]
    model = family.build()
    batch = dict(family.inputs(model))
    labels = batch.pop("labels")
    criterion = nn.CrossEntropyLoss()

    def loss_fn(output):
        return criterion(output.logits.flatten(0, 1), labels.flatten())

    loop = TrainingLoop(outer_autocast="bf16")
    plan = halfway_plan(model, example_inputs=batch, device="cpu", reserve=0, loop=loop, loss_fn=loss_fn)
    assert {unit.choice.precision for unit in plan.decisions.units} == {"bf16"}  # the loop's autocast decides it
    assert any(unit.choice.mode != "keep" for unit in plan.decisions.units)
    measured = amp_recipe(model, plan, batch, labels, criterion)
    predicted = plan.prediction.peak_bytes
    assert predicted * 0.99 <= measured <= predicted
    # planned bf16 without the loop's autocast, the loss ran on bf16 logits: the recipe's fp32 loss peaks above that plan
    model = family.build()
    plain = halfway_plan(model, example_inputs=batch, device="cpu", reserve=0, precision="bf16", loss_fn=loss_fn)
    assert amp_recipe(model, plain, batch, labels, criterion) > plain.prediction.peak_bytes
    with pytest.raises(autoplan.errors.OptionError, match="a loop under its own autocast \\(bf16\\)"):
        autoplan.plan(family.build(), "1GB", example_inputs=batch, device="cpu", precision="fp32", loop=loop)
