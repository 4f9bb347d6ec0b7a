"""trl's SFTTrainer: an SFTConfig planned by autoplan.hf.optimize_for_trainer, and a QLoRA run trained with the plan.

Tiny Llamas from configs (random weights, no downloads), the word-level tokenizer and 4-bit base of
examples/sft_qlora.py, SFTConfigs on the CPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

import autoplan  # noqa: E402
from autoplan.hf import optimize_for_trainer  # noqa: E402
from examples import sft_qlora  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

MAX_LENGTH, BATCH = 32, 4


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=BATCH * MAX_LENGTH, pad_token_id=0))


def config(tmp_path, **changes):
    return sft_qlora.sft_config(str(tmp_path), 2, **({"max_length": MAX_LENGTH, "per_device_train_batch_size": BATCH,
                                                      "packing": False} | changes))


def planned(tmp_path, model=None, **changes):
    return optimize_for_trainer(model or tiny_llama(), config(tmp_path, **changes), "1GB", device="cpu", reserve=0,
                                apply=False)


def test_max_length_is_the_planned_sequence_length_without_packing(tmp_path) -> None:
    setup = planned(tmp_path, max_length=24)
    inputs = setup.example_inputs
    assert inputs["input_ids"].shape == (BATCH, 24)
    assert inputs["attention_mask"].shape == (BATCH, 24)
    assert inputs["fused_lm_head"] is True and inputs["use_cache"] is False  # the call SFTTrainer makes
    assert any("max_length" in note for note in setup.notes)


def test_packing_plans_one_flattened_row_as_trls_collator_makes_it(tmp_path) -> None:
    setup = planned(tmp_path, packing=True)
    inputs = setup.example_inputs
    assert inputs["input_ids"].shape == (1, BATCH * MAX_LENGTH)
    assert "attention_mask" not in inputs
    assert inputs["position_ids"][0, ::MAX_LENGTH].tolist() == [0] * BATCH  # a document starts every max_length
    unpacked = planned(tmp_path, packing=False)
    # one row of 128 tokens attends over a 128 × 128 mask: not the same step as 4 rows of 32
    assert setup.plan.prediction.peak_bytes != unpacked.plan.prediction.peak_bytes


def test_wrapped_packing_keeps_the_batch_dimension(tmp_path) -> None:
    inputs = planned(tmp_path, packing=True, packing_strategy="wrapped").example_inputs
    assert inputs["input_ids"].shape == (BATCH, MAX_LENGTH)


def test_without_max_length_it_asks_for_the_sequence_length(tmp_path) -> None:
    with pytest.raises(ValueError, match="max_length=None.*seq_len="):
        planned(tmp_path, max_length=None)


@pytest.mark.parametrize(("changes", "precision"), [({}, "bf16"), ({"bf16": False}, "fp32")])
def test_bf16_is_planned_as_sfttrainer_runs_it(tmp_path, changes, precision) -> None:
    setup = planned(tmp_path, **changes)  # trl's default is bf16=True
    assert setup.plan.decisions.rest_precision == precision
    assert {unit.choice.precision for unit in setup.plan.decisions.units} == {precision}


@pytest.mark.slow  # the whole pipeline
def test_trls_gradient_checkpointing_is_turned_off_because_the_plan_checkpoints(tmp_path) -> None:
    args = config(tmp_path)
    assert args.gradient_checkpointing is True  # trl's default
    setup = optimize_for_trainer(tiny_llama(), args, "1GB", device="cpu", reserve=0, apply=False)
    assert [(c.name, c.before, c.after) for c in setup.changes] == [("activation_checkpointing", True, False)]
    assert setup.training_args.gradient_checkpointing is False and setup.training_args.activation_checkpointing is False
    assert type(setup.training_args) is type(args) and setup.training_args.packing == args.packing
    assert args.gradient_checkpointing is True  # the caller's config is left alone


@pytest.mark.slow  # the whole pipeline
def test_arguments_it_cannot_read_are_a_clear_error() -> None:
    with pytest.raises(TypeError, match="TrainingArguments.*SFTConfig.*got dict"):
        optimize_for_trainer(tiny_llama(), {"max_length": 32}, "1GB", device="cpu", apply=False)


def test_planning_leaves_the_model_as_it_was(tmp_path) -> None:
    model = sft_qlora.qlora_llama(64, layers=2, width=32)
    setup = planned(tmp_path, model=model)
    assert any("bf16" in note for note in setup.notes)  # planned with the adapters as SFTTrainer casts them
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}  # apply=False: cast back
    assert "forward" not in model.get_base_model().__dict__  # trl's fused head was patched in only while planning


def test_sfttrainer_trains_the_planned_4bit_model_like_the_unplanned_one(tmp_path) -> None:
    from datasets import Dataset
    from trl import SFTTrainer

    written: list[str] = []
    run = sft_qlora.main(steps=2, output_dir=str(tmp_path / "planned"), write=written.append)
    assert any(unit.choice.checkpointed for unit in run.setup.plan.decisions.units)  # a real trade-off
    assert run.verification.measured_peak_bytes == run.setup.plan.prediction.peak_bytes  # the trainer's step, exact
    assert any(line.startswith("FITS") for line in written)

    texts = sft_qlora.sentences()
    tokenizer = sft_qlora.word_tokenizer(texts)
    args = sft_qlora.sft_config(str(tmp_path / "unplanned"), 2, gradient_checkpointing=False)
    trainer = SFTTrainer(model=sft_qlora.qlora_llama(len(tokenizer)), args=args,
                         train_dataset=Dataset.from_dict({"text": texts}), processing_class=tokenizer)
    trainer.train()
    unplanned = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    assert len(run.losses) == 2 and all(torch.isfinite(torch.tensor(run.losses)))
    # recomputation under bf16 autocast repeats the same ops on the same inputs: equal to the logged precision
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(unplanned), rtol=0, atol=1e-4)
    assert autoplan.planned_choices(trainer.model) == {}


def sft_with_peft_config(tmp_path, plan: bool):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTTrainer

    from autoplan.frameworks import optimize_trainer

    texts = sft_qlora.sentences()
    tokenizer = sft_qlora.word_tokenizer(texts)
    base = sft_qlora.quantized_llama(len(tokenizer))
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=base, args=sft_qlora.sft_config(str(tmp_path), 3), train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tokenizer, peft_config=lora)
    setup = verification = None
    if plan:
        probe = optimize_trainer(trainer, "1GB", device="cpu", reserve=0, apply=False)
        roomy = probe.plan.prediction
        setup = optimize_trainer(trainer, (roomy.minimum_peak_bytes + roomy.peak_bytes) // 2, device="cpu", reserve=0)
        verification = autoplan.verify(trainer.model, setup.plan, example_inputs=setup.example_inputs)
    trainer.train()
    return setup, verification, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.slow  # two QLoRA runs of SFTTrainer
def test_an_sfttrainer_that_made_its_peft_model_is_planned_after_it_is_built(tmp_path) -> None:
    """SFTTrainer(model, peft_config=...) makes the peft model itself: optimize_trainer plans the trainer once built."""
    _, _, expected = sft_with_peft_config(tmp_path / "unplanned", plan=False)
    setup, verification, losses = sft_with_peft_config(tmp_path / "planned", plan=True)
    assert any(unit.choice.checkpointed for unit in setup.plan.decisions.units)  # a real trade-off
    assert verification.measured_peak_bytes == setup.plan.prediction.peak_bytes  # the trainer's step, exact
    assert losses == pytest.approx(expected, abs=1e-4)
