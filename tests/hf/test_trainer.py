"""The transformers Trainer integration: autoplan.hf.optimize_for_trainer and AutoplanCallback.

Tiny Llama models from configs (random weights, no downloads) and TrainingArguments on the CPU.
The example examples/hf_trainer.py runs here too, for two steps.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' Trainer needs it

import autoplan  # noqa: E402
from autoplan.errors import InfeasibleBudgetError  # noqa: E402
from autoplan.hf import AutoplanCallback, optimize_for_trainer, trainer_optimizer  # noqa: E402
from autoplan.units import ModuleUnit, Unit
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

SEQ = 32
VOCAB = 128


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def tiny_llama(layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def arguments(tmp_path, **changes) -> TrainingArguments:
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[], use_cpu=True,
                  save_strategy="no", disable_tqdm=True)
    return TrainingArguments(**(values | changes))


def dataset(examples: int, lengths: tuple[int, ...] = (SEQ,)) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for index in range(examples):
        tokens = torch.randint(0, VOCAB, (lengths[index % len(lengths)],), generator=generator)
        rows.append({"input_ids": tokens, "labels": tokens})
    return rows


@functools.cache
def lowest_and_no_plan_peaks(micro_batch: int) -> tuple[int, int]:
    """The lowest peak and the no-plan peak of the Trainer's step for a micro-batch (reserve 0, cpu)."""
    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=micro_batch, report_to=[], use_cpu=True)
    probe = optimize_for_trainer(tiny_llama(), args, "100%", device="cpu", reserve=0, seq_len=SEQ, apply=False)
    return probe.plan.prediction.minimum_peak_bytes, probe.plan.prediction.baseline_peak_bytes


# -- the argument changes -------------------------------------------------------------------

@pytest.mark.slow  # the whole pipeline
def test_checkpointing_is_turned_off_because_the_plan_checkpoints_per_layer(tmp_path) -> None:
    lowest, no_plan = lowest_and_no_plan_peaks(4)
    model = tiny_llama()
    args = arguments(tmp_path, activation_checkpointing=True)
    setup = optimize_for_trainer(model, args, (lowest + no_plan) // 2, device="cpu", reserve=0, seq_len=SEQ)

    assert setup.plan.outcome.feasible
    assert any(unit.choice.checkpointed for unit in setup.plan.decisions.units)  # a real trade-off: some layers recompute
    [change] = setup.changes
    assert (change.name, change.before, change.after) == ("activation_checkpointing", True, False)
    assert setup.training_args.activation_checkpointing is False
    assert setup.training_args.gradient_checkpointing is False  # transformers' deprecated alias follows
    assert args.activation_checkpointing is True  # the caller's arguments are left alone
    assert autoplan.planned_choices(model) == setup.plan.decisions.choices()  # applied in place
    assert model.config.use_cache is False  # a KV cache in training holds every layer's keys and values
    assert setup.loop.keep_outputs is False and setup.loop.accumulation_steps == 1


@pytest.mark.slow  # the whole pipeline
def test_the_checkpointing_change_counts_layers_not_segments(tmp_path) -> None:
    """Issue 27: a plan of 6 layers, two of them one checkpointed segment, said "checkpoints 5 of 5 layers"."""
    from autoplan.hf import _changes
    from autoplan.plan import Choice, UnitDecision

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             activation_checkpointing=True)
    plan = optimize_for_trainer(tiny_llama(6), args, "100%", device="cpu", reserve=0, seq_len=SEQ, apply=False).plan
    full, keep = Choice("full", "fp32"), Choice("keep", "fp32")
    units = (UnitDecision(Unit.from_name("model.layers.[0:2]"), full, 0, 0, 0.0, members=("model.layers.0", "model.layers.1")),
             *(UnitDecision(ModuleUnit(f"model.layers.{i}"), full if i < 5 else keep, 0, 0, 0.0) for i in range(2, 6)))
    [change] = _changes(args, dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, units=units)), plan, 4)
    assert change.name == "activation_checkpointing" and change.reason.startswith("the plan checkpoints 5 of 6 layers itself")


@pytest.mark.slow  # the whole pipeline
def test_a_batch_that_does_not_fit_is_split_into_accumulated_micro_batches(tmp_path) -> None:
    lowest_at_2, _ = lowest_and_no_plan_peaks(2)
    lowest_at_4, _ = lowest_and_no_plan_peaks(4)
    assert lowest_at_2 < lowest_at_4
    args = arguments(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3)
    setup = optimize_for_trainer(tiny_llama(), args, (lowest_at_2 + lowest_at_4) // 2, device="cpu", reserve=0,
                                 seq_len=SEQ)

    changes = {change.name: (change.before, change.after) for change in setup.changes}
    assert changes == {"per_device_train_batch_size": (4, 2), "gradient_accumulation_steps": (3, 6)}
    assert setup.training_args.per_device_train_batch_size * setup.training_args.gradient_accumulation_steps == 12
    assert setup.micro_batch_size == 2 and setup.loop.accumulation_steps == 6
    assert setup.plan.outcome.feasible


@pytest.mark.slow  # the whole pipeline
def test_nothing_fits_even_one_example_raises_with_the_plan(tmp_path) -> None:
    lowest_at_2, _ = lowest_and_no_plan_peaks(2)
    model = tiny_llama()
    with pytest.raises(InfeasibleBudgetError) as raised:
        optimize_for_trainer(model, arguments(tmp_path, per_device_train_batch_size=2), lowest_at_2 // 2, device="cpu",
                             reserve=0, seq_len=SEQ)
    assert not raised.value.plan.outcome.feasible
    assert autoplan.planned_choices(model) == {}  # nothing applied


@pytest.mark.slow  # the whole pipeline
def test_bf16_arguments_plan_the_whole_forward_under_bf16_autocast(tmp_path) -> None:
    setup = optimize_for_trainer(tiny_llama(2), arguments(tmp_path, bf16=True), "100%", device="cpu", reserve=0,
                                 seq_len=SEQ, apply=False)
    assert setup.plan.decisions.rest_precision == "bf16"
    assert {unit.choice.precision for unit in setup.plan.decisions.units} == {"bf16"}
    assert setup.changes == ()


@pytest.mark.slow  # the whole pipeline
def test_sequence_length_comes_from_the_longest_examples_of_the_dataset(tmp_path) -> None:
    rows = dataset(8, lengths=(8, 24, 16))
    collated = []

    def pad(features):  # right-pad input_ids with 0 and labels with -100, as a tokenizer's padding collator does
        longest = max(len(f["input_ids"]) for f in features)
        batch = {key: torch.stack([torch.nn.functional.pad(f[key], (0, longest - len(f[key])), value=fill) for f in features])
                 for key, fill in (("input_ids", 0), ("labels", -100))}
        collated.append(batch)
        return batch

    setup = optimize_for_trainer(tiny_llama(2), arguments(tmp_path, per_device_train_batch_size=2), "100%", device="cpu",
                                 reserve=0, train_dataset=rows, data_collator=pad, apply=False)
    assert setup.plan.outcome.feasible
    assert collated[0]["input_ids"].shape == (2, 24)  # the two longest examples, not the first two (8 and 24)


@pytest.mark.slow  # the whole pipeline
def test_without_a_sequence_length_or_data_it_says_what_to_pass(tmp_path) -> None:
    with pytest.raises(ValueError, match="seq_len=.*train_dataset="):
        optimize_for_trainer(tiny_llama(2), arguments(tmp_path), "100%", device="cpu", apply=False)


# -- the Trainer's optimizer ----------------------------------------------------------------

@pytest.mark.parametrize(
    ("optim", "counted", "implementation"),
    [("adamw_torch_fused", "adamw", "fused"), ("adamw_torch", "adamw", "auto"), ("sgd", "sgd", "auto")],
)
def test_the_trainers_optimizer_is_counted(tmp_path, optim: str, counted: str, implementation: str) -> None:
    found = trainer_optimizer(arguments(tmp_path, optim=optim))
    assert (found.optimizer, found.implementation, found.note) == (counted, implementation, None)


def test_other_torch_optimizers_are_counted_from_an_instance(tmp_path) -> None:
    found = trainer_optimizer(arguments(tmp_path, optim="adagrad"))
    assert isinstance(found.optimizer, torch.optim.Adagrad)


@pytest.mark.parametrize("optim,bits,paged", [("adamw_bnb_8bit", 8, False), ("paged_adamw_8bit", 8, True),
                                               ("paged_adamw_32bit", 32, True), ("lion_8bit", 8, False)])
def test_bitsandbytes_optimizers_are_counted_as_the_trainer_builds_them(tmp_path, optim, bits, paged) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    found = trainer_optimizer(arguments(tmp_path, optim=optim))
    assert type(found.optimizer).__module__.startswith(bnb.__name__)
    assert found.optimizer.args.optim_bits == bits and found.optimizer.is_paged == paged and found.note is None


def test_8bit_optimizers_without_bitsandbytes_are_counted_as_32bit_adamw_and_say_so(tmp_path, monkeypatch) -> None:
    import transformers

    def missing(*_args, **_kwargs):
        raise ImportError("bitsandbytes is not installed")

    monkeypatch.setattr(transformers.Trainer, "get_optimizer_cls_and_kwargs", staticmethod(missing))
    found = trainer_optimizer(arguments(tmp_path, optim="adamw_bnb_8bit"))
    assert found.optimizer == "adamw" and "upper bound" in found.note


def test_an_optimizer_autoplan_cannot_count_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot count.*optimizer="):
        trainer_optimizer(arguments(tmp_path, optim="adafactor"))


# -- the callback and the example ------------------------------------------------------------

@pytest.mark.slow  # the whole pipeline
def test_callback_prints_the_plan_at_train_begin_and_measures_nothing_on_the_cpu(tmp_path) -> None:
    from transformers import TrainerControl, TrainerState

    setup = optimize_for_trainer(tiny_llama(2), arguments(tmp_path), "100%", device="cpu", reserve=0, seq_len=SEQ,
                                 apply=False)
    written: list[str] = []
    callback = AutoplanCallback(setup.plan, write=written.append)
    args, state, control = arguments(tmp_path), TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control)
    for step in range(3):
        callback.on_step_begin(args, state, control)
        state.global_step = step + 1
        callback.on_step_end(args, state, control)
    assert len(written) == 1 and written[0].startswith("FITS")
    assert callback.measured_peak_bytes is None


def test_the_trainer_example_trains_the_planned_model(tmp_path) -> None:
    from examples import hf_trainer

    written: list[str] = []
    run = hf_trainer.main(steps=2, output_dir=str(tmp_path), write=written.append)

    assert len(run.losses) == 2 and all(torch.isfinite(torch.tensor(run.losses)))
    assert [change.name for change in run.setup.changes] == ["activation_checkpointing"]
    assert any(unit.choice.checkpointed for unit in run.setup.plan.decisions.units)
    assert any(line.startswith("FITS") for line in written)  # the callback's report
    assert dataclasses.is_dataclass(run)
