"""Forwards that read the batch (image grids, label checks, sequence bounds) or decide on random draws
(LayerDrop): the values the simulation takes from the real batch (`instruments.values`), the worst-case
draws the trace stage picks, and the plans that stand on them, measured against the real step."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

import autoplan
from autoplan.errors import PlanMismatchError, TraceError
from autoplan.instruments.fake import fake_tree, new_fake_mode
from autoplan.trace.tracer import trace
from tests.batch_reading import (FAMILIES, GENERATED, build_grid_tower, build_layerdrop, build_qwen2_vl, collate_image_text,
                                 qwen2_vl_batch)
from tests.handmade import assert_same_step, compare_with_plan, measured_step

# -- the values, on fake tensors ----------------------------------------------------------------


def test_reads_of_the_batch_are_answered_with_its_values():
    grid, labels = torch.tensor([[2, 3], [4, 5]]), torch.tensor([[1, -100, 7, -100]])
    mode = new_fake_mode()
    with mode:
        _, kwargs = fake_tree(((), {"grid": grid, "labels": labels}), mode)
        fake_grid, fake_labels = kwargs["grid"], kwargs["labels"]
        assert fake_grid.tolist() == [[2, 3], [4, 5]]
        assert int(fake_grid.prod(-1).sum()) == 26
        assert torch.repeat_interleave(torch.arange(2), fake_grid.prod(-1)).shape == (26,)
        assert torch.nonzero(fake_labels != -100).shape == (2, 2)
        unknown = torch.empty(1, 4, 8)  # a fake made here: no value
        assert unknown[fake_labels != -100].shape == (2, 8)  # a boolean mask with a value selects as many rows
        assert torch.tensor([fake_grid[0, 0], fake_grid[1, 1]]).tolist() == [2, 5]  # torch.tensor of fakes with values
    assert mode.values.batch_reads() == ("grid", "labels")


def test_a_value_computed_from_weights_is_still_unknown():
    mode = new_fake_mode()
    weight = torch.randn(4, 4)
    with mode:
        _, kwargs = fake_tree(((), {"ids": torch.tensor([1, 2])}), mode)
        fake_weight = mode.from_tensor(weight)
        with pytest.raises(DataDependentOutputException):
            bool((fake_weight[kwargs["ids"]].sum() > 0))


class WritesIntoItsBatch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, labels):
        labels.masked_fill_(labels == 3, -100)  # in place, on the batch
        kept = torch.nonzero(labels != -100).squeeze(1)
        for block in self.blocks:
            x = block(x).relu()
        return x[kept].square().mean()


def test_the_simulation_never_writes_into_the_users_batch():
    labels = torch.tensor([3, 1, 3, 2, 0, 3])
    plan = autoplan.plan(WritesIntoItsBatch(), "1GB", example_inputs=(torch.randn(6, 8), labels), device="cpu")
    assert labels.tolist() == [3, 1, 3, 2, 0, 3]
    assert plan.model.batch_values == ("argument 1",)


def test_a_forward_that_reads_a_meta_batch_says_which_value_and_how_to_give_one():
    model, (patches, grid) = build_grid_tower()
    with pytest.raises(TraceError) as error:
        autoplan.plan(model, "1GB", example_inputs=(patches.to("meta"), grid.to("meta")), device="cpu")
    message = str(error.value)
    assert "tolist" in message and "meta device" in message and "example_inputs" in message


# -- random control flow -------------------------------------------------------------------------


@pytest.mark.parametrize("skip_above", [False, True], ids=["rand < p skips", "rand > keep skips"])
def test_random_control_flow_is_traced_with_every_layer_running(skip_above):
    model, inputs = build_layerdrop(skip_above)
    traced = trace(model, inputs)
    assert traced.unit_names == tuple(f"blocks.{i}" for i in range(6)) and not traced.never_ran
    assert traced.draws == ("low" if skip_above else "high") and traced.random_reads == 6
    # torch.fx would have run torch.rand once, for real, and kept one random branch: refused
    assert any("random" in error for error in traced.trace_errors)


def _all_layers_running(model: torch.nn.Module) -> torch.nn.Module:
    twin = copy.deepcopy(model)
    twin.p = 0.0
    return twin


@pytest.mark.parametrize("skip_above", [False, True], ids=["rand < p skips", "rand > keep skips"])
def test_layerdrop_plans_for_the_worst_case_and_is_never_above_checkpointing_by_hand(skip_above):
    model, inputs = build_layerdrop(skip_above)
    by_hand = copy.deepcopy(_all_layers_running(model))
    for block in by_hand.blocks:
        block.forward = _checkpointed(block.forward)
    worst_by_hand = measured_step(by_hand, inputs).peak_bytes  # every layer running, each checkpointed
    plan = autoplan.plan(model, worst_by_hand, example_inputs=inputs, device="cpu", precision="fp32", reserve=0)
    assert plan.model.random_control_flow and any("worst case" in note for note in plan.notes)
    assert plan.outcome.feasible and plan.prediction.minimum_peak_bytes <= worst_by_hand
    planned = autoplan.apply(_all_layers_running(model), plan)
    assert measured_step(planned, inputs).peak_bytes == plan.prediction.peak_bytes  # the worst case, to the byte
    assert_same_step(model, plan, inputs)


def _checkpointed(forward):
    return lambda *args: torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False)


# -- plans, measured ---------------------------------------------------------------------------------


READ_THE_BATCH = [s for s in GENERATED if "rand" not in s.name] + list(FAMILIES)


@pytest.mark.parametrize("structure", READ_THE_BATCH, ids=lambda s: s.name)
def test_plans_fit_predict_the_measured_peak_and_are_never_above_checkpointing_by_hand(structure):
    if structure.needs_transformers:
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    np.random.seed(0)
    row = compare_with_plan(structure)  # planned at exactly the by-hand peak, no reserve, and measured
    assert row.floor_bytes <= row.by_hand.peak_bytes
    assert row.feasible and row.planned.peak_bytes <= row.by_hand.peak_bytes
    predicted = row.plan.prediction.peak_bytes
    assert row.planned.peak_bytes <= predicted <= row.planned.peak_bytes * 1.01, (predicted, row.planned.peak_bytes)
    assert row.plan.model.batch_values  # the plan says which inputs it read
    model, inputs = structure.build()
    assert_same_step(model, row.plan, inputs)


def test_vision_language_plans_both_towers_and_names_the_grid_it_was_made_for():
    pytest.importorskip("transformers")
    model, batch = build_qwen2_vl()
    plan = autoplan.plan(model, "1GB", example_inputs=batch, device="cpu")
    towers = {unit.name.split(".")[1] for unit in plan.decisions.units}
    assert towers == {"visual", "language_model"}
    assert dict(plan.model.fingerprint.values)["image_grid_thw"] == "[[1, 16, 16], [1, 8, 12]]"
    assert plan.to_dict()["fingerprint"]["values"]["image_grid_thw"] == "[[1, 16, 16], [1, 8, 12]]"
    assert "image_grid_thw" in plan.model.batch_values and any("image grids" in note for note in plan.notes)
    other_images = qwen2_vl_batch(grids=((1, 8, 12), (1, 16, 16)))  # the same shapes, the images in the other order
    with pytest.raises(PlanMismatchError, match="image_grid_thw"):
        autoplan.verify(model, plan, example_inputs=other_images)


def _image_text_examples(count: int) -> list[dict]:
    """Examples as a processor makes them: each with its own image patches and grid (the images differ in size)."""
    examples = []
    for index in range(count):
        grid = (1, 8, 12) if index % 2 else (1, 16, 16)
        batch = qwen2_vl_batch(grids=(grid,), text=40)
        examples.append({key: value[0] if key in ("input_ids", "mm_token_type_ids", "attention_mask", "labels") else value
                         for key, value in batch.items() if key != "use_cache"})
    return examples


def test_the_trainer_plans_and_trains_a_vision_language_model_from_its_collator(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from autoplan.hf import optimize_for_trainer
    from transformers import Trainer, TrainingArguments

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, _ = build_qwen2_vl()
    examples = _image_text_examples(4)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, remove_unused_columns=False)
    setup = optimize_for_trainer(model, args, "1GB", device="cpu", train_dataset=examples, data_collator=collate_image_text)
    assert setup.plan.outcome.feasible and "image_grid_thw" in setup.plan.model.batch_values
    assert {unit.name.split(".")[1] for unit in setup.plan.decisions.units} == {"visual", "language_model"}
    trainer = Trainer(model=model, args=setup.training_args, train_dataset=examples, data_collator=collate_image_text)
    result = trainer.train()
    assert result.global_step == 2 and np.isfinite(result.training_loss)
