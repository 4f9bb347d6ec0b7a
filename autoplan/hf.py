"""Hugging Face, the public side: models from presets or configs, and planning the `Trainer`'s step.

    model = autoplan.hf.model_from_config("llama-3-70b")            # on the meta device: no memory
    inputs = autoplan.hf.example_inputs_for(model, batch_size=1, seq_len=2048)

    setup = autoplan.hf.optimize_for_trainer(model, training_args, "24GB", train_dataset=dataset)
    trainer = Trainer(model=model, args=setup.training_args, train_dataset=dataset,
                      callbacks=[autoplan.hf.AutoplanCallback(setup.plan)])

`optimize_for_trainer` takes the `TrainingArguments` a person already has and plans the step the
Trainer runs with them: it drops the model's outputs before backward, steps the optimizer `optim`
names, runs the forward under autocast when `bf16`/`fp16` is set, and accumulates
`gradient_accumulation_steps` micro-batches. It rewrites the model in place and returns the
arguments to change (`activation_checkpointing=False`: the plan checkpoints per layer; a smaller
`per_device_train_batch_size` with more accumulation steps when the batch does not fit).
trl's `SFTConfig` (a TrainingArguments) plans SFTTrainer's step: `max_length` tokens per example,
packed batches flattened into one row as trl's collator flattens them, trl's fused LM head, and
bf16 adapters on a quantized base (`autoplan.inputs.hf_trl`).
transformers (and accelerate, for the Trainer) are optional extras: `pip install autoplan[hf]`;
the model-building code lives in `autoplan.inputs.hf_models`, the callback in
`autoplan.report.trainer` (it only reports).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from autoplan import api
from autoplan.errors import InfeasibleBudgetError, OptionError, OptionTypeError
from autoplan.inputs.hf_models import (
    DEFAULT_SEQ_LEN_CAP,
    PRESETS,
    default_seq_len,
    example_inputs_for,
    is_hf_model,
    model_from_config,
    require_transformers,
    stop_training_cache,
    training_inputs,
)
from autoplan.inputs.hf_trl import (
    cast_adapters_to_bf16,
    casts_adapters_to_bf16,
    flattens_batch,
    fused_lm_head,
    is_sft_config,
    sft_batch,
)
from autoplan.inputs.hf_trainer import trainer_loop, with_token_count
from autoplan.inputs.loop import TrainingLoop
from autoplan.plan import Plan
from autoplan.report import trainer as trainer_report
from autoplan.vocabulary.formatting import format_bytes
from autoplan.vocabulary.signatures import accepts_argument


def __getattr__(name: str) -> Any:
    # AutoplanCallback subclasses transformers' TrainerCallback: made on first use, so that importing
    # autoplan.hf neither needs transformers nor pays for importing its Trainer.
    if name == "AutoplanCallback":
        return trainer_report.callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_SEQ_LEN_CAP", "PRESETS", "ArgumentChange", "AutoplanCallback", "TrainerOptimizer", "TrainerPlan",
    "default_seq_len", "example_inputs_for", "is_hf_model", "model_from_config", "optimize_for_trainer",
    "trainer_optimizer", "training_inputs",
]

# transformers 5.x renamed gradient_checkpointing to activation_checkpointing (the old name is an alias)
CHECKPOINTING_ARGUMENTS = ("activation_checkpointing", "gradient_checkpointing")
SCANNED_EXAMPLES = 1024  # the dataset's first examples searched for the longest ones


@dataclass(frozen=True)
class ArgumentChange:
    """One `TrainingArguments` field the plan needs changed, and why."""

    name: str
    before: Any
    after: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {self.before!r} -> {self.after!r} ({self.reason})"


@dataclass(frozen=True)
class TrainerOptimizer:
    """The optimizer the Trainer builds from `optim`, as the plan counts it."""

    optimizer: str | torch.optim.Optimizer  # autoplan's name ("adamw", "sgd", ...) or an instance of the class
    implementation: str  # TrainingLoop.optimizer_impl: "fused" when the Trainer fuses it, else "auto"
    note: str | None = None  # said when the count is an approximation


@dataclass(frozen=True)
class TrainerPlan:
    """What `optimize_for_trainer` decided: the plan (applied unless apply=False) and the arguments to train with."""

    plan: Plan
    changes: tuple[ArgumentChange, ...]  # fields of the caller's TrainingArguments the plan needs changed
    training_args: Any  # a copy of the caller's TrainingArguments with the changes made
    loop: TrainingLoop  # the Trainer's training step, as planned
    micro_batch_size: int  # the per-device micro-batch planned for
    notes: tuple[str, ...] = ()  # approximations, and what was changed on the model itself
    example_inputs: Any = None  # the micro-batch planned for, as forward's keyword arguments (for autoplan.verify)


def trainer_optimizer(args: Any, model: torch.nn.Module | None = None) -> TrainerOptimizer:
    """The optimizer `Trainer` builds from `args.optim`, as autoplan counts it.

    AdamW, Adam and SGD map to autoplan's own names (fused when the Trainer fuses); other torch.optim
    classes (Adagrad, RMSprop) are counted from an instance built with the Trainer's arguments;
    bitsandbytes' optimizers (adamw_bnb_8bit, paged_adamw_8bit, lion_8bit, ...) are counted from an
    instance built the same way (8-bit state, paging); other 8-bit and 4-bit optimizers (torchao's)
    as 32-bit AdamW, an upper bound on their state.
    """
    name = str(getattr(args.optim, "value", args.optim))
    try:
        cls, kwargs = require_transformers().Trainer.get_optimizer_cls_and_kwargs(args, model)
    except (ImportError, ValueError) as error:
        if "8bit" in name or "4bit" in name:
            return TrainerOptimizer("adamw", "auto", f"optim={name!r} is counted as 32-bit AdamW state (two fp32 tensors "
                                    "per parameter): an upper bound on its quantised state")
        raise OptionError(f"TrainingArguments(optim={name!r}): {error}") from None
    if isinstance(cls, type) and cls.__module__.startswith("bitsandbytes"):
        return TrainerOptimizer(cls([torch.nn.Parameter(torch.zeros(1))], **kwargs), "auto")
    if "8bit" in name or "4bit" in name:
        return TrainerOptimizer("adamw", "auto", f"optim={name!r} is counted as 32-bit AdamW state (two fp32 tensors "
                                "per parameter): an upper bound on its quantised state")
    implementation = "fused" if kwargs.get("fused") else "auto"
    if cls in (torch.optim.AdamW, torch.optim.Adam):
        return TrainerOptimizer("adamw" if cls is torch.optim.AdamW else "adam", implementation)
    if cls is torch.optim.SGD:
        return TrainerOptimizer("sgd-momentum" if kwargs.get("momentum") else "sgd", implementation)
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls.__module__.startswith("torch.optim"):
        return TrainerOptimizer(cls([torch.nn.Parameter(torch.zeros(1))], **kwargs), implementation)
    raise OptionError(
        f"TrainingArguments(optim={name!r}) builds {cls.__name__}, whose state autoplan cannot count: it plans the "
        "torch.optim optimizers (adamw_torch, adamw_torch_fused, sgd, adagrad, rmsprop) and counts 8-bit and 4-bit "
        "ones as 32-bit AdamW. Pass optimizer= (autoplan's name or an instance) to plan with another"
    )


def _check_trainer_args(args: Any) -> None:
    """TrainingArguments (or a subclass) for one GPU per process, else a one-line error."""
    if not all(hasattr(args, name) for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "optim")):
        raise OptionTypeError(f"optimize_for_trainer takes transformers' TrainingArguments (or trl's SFTConfig, a subclass); "
                              f"got {type(args).__name__}")
    if getattr(args, "fsdp", None) or getattr(args, "deepspeed", None):
        raise OptionError("optimize_for_trainer plans one GPU per process; for FSDP plan with autoplan.optimize(..., "
                          "world_size=N) in your own loop. DeepSpeed is not planned")


def optimize_for_trainer(
    model: torch.nn.Module,
    args: Any,
    budget: str | int,
    *,
    device: str | None = None,
    seq_len: int | None = None,
    train_dataset: Any = None,
    data_collator: Callable[[list], Any] | None = None,
    reserve: str | int | None = None,
    units: list[str] | None = None,
    optimizer: str | torch.optim.Optimizer | None = None,
    apply: bool = True,
    progress: Callable[[str], None] | None = None,
) -> TrainerPlan:
    """Plan the Trainer's training step for `budget`, rewrite `model` in place, and say which arguments change.

    args: the `TrainingArguments` you train with: `per_device_train_batch_size`,
        `gradient_accumulation_steps`, `bf16`/`fp16` and `optim` are planned for; trl's `SFTConfig`
        also plans SFTTrainer's batches (`max_length`, `packing`, `padding_free`) and forward.
    seq_len: the sequence length to plan for; default `args.max_length` (trl's configs), else the
        longest of the first SCANNED_EXAMPLES examples of `train_dataset` after `data_collator`
        (transformers' default_data_collator when None). One of them is needed.
    device, reserve, units: as for `autoplan.plan`. optimizer: overrides what `args.optim` names.
    apply: False decides without rewriting (a model on the meta device can only be planned).

    When the per-device batch does not fit even with every layer checkpointed, the largest micro-batch
    that divides it and fits is planned, with accumulation steps raised to keep the batch. Raises
    InfeasibleBudgetError (with `.plan`) when not even one example fits.
    """
    _check_trainer_args(args)
    counted = trainer_optimizer(args, model) if optimizer is None else TrainerOptimizer(optimizer, "auto")
    batches = _batches(model, args, seq_len, train_dataset, data_collator)
    batch_size, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    precision = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"

    def plan_micro_batch(size: int) -> tuple[Plan, TrainingLoop]:
        micro_batches = accumulation * batch_size // size
        inputs = with_token_count(model, batches.make(size), micro_batches)
        loop = trainer_loop(micro_batches, counted.implementation, precision, "labels" in inputs, device)
        decided = api.plan(model, budget, example_inputs=inputs, device=device, optimizer=counted.optimizer,
                       precision=precision, reserve=reserve, units=units, loop=loop, progress=progress)
        return decided, loop

    model_notes: list[str] = []
    with _as_the_trainer_runs_it(model, args, keep=apply, notes=model_notes):
        whole, loop = plan_micro_batch(batch_size)
        micro, decided = batch_size, whole
        if not whole.outcome.feasible and batch_size > 1:
            micro, decided, loop = _largest_fitting_micro_batch(batch_size, plan_micro_batch)
        if not decided.outcome.feasible:
            raise InfeasibleBudgetError(decided, f"not even a micro-batch of 1 fits: {_over(decided)}")
    notes = [note for note in (counted.note, batches.note) if note] + model_notes
    if apply:
        notes.extend(_prepare_model(model))
        api.apply(model, decided)
    changes = _changes(args, decided, whole, micro)
    training_args = dataclasses.replace(args, **{change.name: change.after for change in changes}) if changes else args
    example = with_token_count(model, batches.make(micro), loop.accumulation_steps)
    return TrainerPlan(decided, changes, training_args, loop, micro, tuple(notes), example)


@dataclass(frozen=True)
class Batches:
    """How the Trainer's batches are made for planning: `make(size)` gives one of `size` examples."""

    make: Callable[[int], dict[str, Any]]
    note: str | None = None  # what the sequence length was taken from, when it is an assumption


@contextlib.contextmanager
def _as_the_trainer_runs_it(model: torch.nn.Module, args: Any, *, keep: bool, notes: list[str]):
    """While planning, the model as trl's SFTTrainer will run it (nothing changes for transformers' Trainer).

    The fused LM head is patched in only while planning (SFTTrainer patches it itself); adapters of a
    quantized base are cast to bf16 as SFTTrainer casts them, and cast back unless `keep` and planning
    succeeded, so a failed or apply=False call leaves the model as it was.
    """
    if not is_sft_config(args):
        yield
        return
    cast = cast_adapters_to_bf16(model) if casts_adapters_to_bf16(model) else []
    try:
        with fused_lm_head(model):
            yield
    except BaseException:
        keep = False
        raise
    finally:
        for parameter, data in cast if not keep else ():
            parameter.data = data
    if cast:
        done = "cast to bf16" if keep else "planned in bf16 (and left as they were)"
        notes.append(f"{len(cast)} trainable parameters (the adapters) {done}, as SFTTrainer casts them on a quantized "
                     "base: their gradients and optimizer state are bf16 too")


def _batches(model, args, seq_len, train_dataset, data_collator) -> Batches:
    """Batches of a given size as the Trainer feeds the model: from the data, or built from the config."""
    if is_sft_config(args):
        return _sft_batches(model, args, seq_len)
    seq_len = seq_len or getattr(args, "max_length", None)  # trl's other configs have one too
    if seq_len is not None:
        return Batches(lambda size: example_inputs_for(model, size, int(seq_len)))
    if train_dataset is None:
        raise OptionError("optimize_for_trainer needs the sequence length it plans for: pass seq_len= (the longest "
                          "sequence a batch holds) or train_dataset= (with data_collator= when the Trainer gets one)")
    examples = list(itertools.islice(iter(train_dataset) if not hasattr(train_dataset, "__getitem__") else
                                     (train_dataset[i] for i in range(len(train_dataset))), SCANNED_EXAMPLES))
    if not examples:
        raise OptionError("train_dataset is empty: there is no batch to plan for")
    examples.sort(key=_length, reverse=True)  # the longest examples make the batch that peaks highest
    collate = data_collator or require_transformers().default_data_collator

    def make(size: int) -> dict[str, Any]:
        batch = dict(collate(examples[:size]))
        # the Trainer drops columns forward does not take (remove_unused_columns)
        return {key: value for key, value in batch.items() if accepts_argument(model.forward, key)}

    note = None
    if len(examples) == SCANNED_EXAMPLES:
        note = (f"planned for the longest of the first {SCANNED_EXAMPLES} examples ({_length(examples[0])} tokens); "
                "pass seq_len= if longer ones come later")
    return Batches(make, note)


def _sft_batches(model, args, seq_len) -> Batches:
    """SFTTrainer's batches: `max_length` tokens per example (or `seq_len=`), laid out as trl's collator lays them."""
    seq_len = seq_len or args.max_length
    if seq_len is None:
        raise OptionError("SFTConfig(max_length=None) does not bound the sequences: pass seq_len= (the longest tokenized "
                          "example) or set max_length")
    if flattens_batch(args):
        note = (f"SFTConfig(packing={args.packing}, padding_free={args.padding_free}): each micro-batch is planned as "
                f"one row of batch × {seq_len} tokens, as trl's padding-free collator flattens it")
    else:
        note = (f"planned for sequences of {seq_len} tokens (SFTConfig's max_length, to which trl truncates); batches "
                "of shorter examples peak lower")
    return Batches(lambda size: sft_batch(model, args, size, int(seq_len)), note)


def _length(example: Any) -> int:
    """The length of an example's input_ids (0 when it has none)."""
    tokens = example.get("input_ids") if isinstance(example, dict) else None
    try:
        return len(tokens) if tokens is not None else 0
    except TypeError:
        return 0


def _largest_fitting_micro_batch(batch_size: int, plan_micro_batch) -> tuple[int, Plan, TrainingLoop]:
    """Bisect the divisors of the batch below it for the largest micro-batch whose plan fits.

    A smaller micro-batch never peaks higher, so the divisors that fit are a prefix of them. When
    none fits, the plan for a micro-batch of 1 comes back (it does not fit).
    """
    divisors = [d for d in range(1, batch_size) if batch_size % d == 0]
    fitting: tuple[int, Plan, TrainingLoop] | None = None
    smallest: tuple[int, Plan, TrainingLoop] | None = None
    low, high = 0, len(divisors) - 1
    while low <= high:
        middle = (low + high) // 2
        decided, loop = plan_micro_batch(divisors[middle])
        if decided.outcome.feasible:
            fitting, low = (divisors[middle], decided, loop), middle + 1
        else:
            smallest, high = (divisors[middle], decided, loop), middle - 1
    result = fitting or smallest
    assert result is not None, "a batch of 2 or more has the divisor 1"
    return result


def _over(decided: Plan) -> str:
    return (f"the lowest peak is {format_bytes(decided.prediction.minimum_peak_bytes)}, over the {format_bytes(decided.request.usable_bytes)} "
            f"usable; it needs a {format_bytes(decided.prediction.minimum_budget_bytes)} budget")


def _prepare_model(model: torch.nn.Module) -> list[str]:
    """What the Trainer's step needs of the model that the arguments do not say: no KV cache in training."""
    if stop_training_cache(model):  # a cache holds every layer's keys and values until the step ends; planned without
        return ["model.config.use_cache set to False: a KV cache in training holds every layer's keys and values"]
    return []


def _changes(args: Any, decided: Plan, whole: Plan, micro: int) -> tuple[ArgumentChange, ...]:
    """The TrainingArguments fields the plan needs changed."""
    changes = []
    name = next((n for n in CHECKPOINTING_ARGUMENTS if hasattr(args, n)), None)
    if name is not None and getattr(args, name):
        layers = decided.decisions.unit_choices()  # a segment's layers one by one: a segment of 2 is 2 layers, not 1
        checkpointed = sum(choice.checkpointed for choice in layers.values())
        changes.append(ArgumentChange(name, True, False, f"the plan checkpoints {checkpointed} of {len(layers)} "
                                      "layers itself; transformers would checkpoint every one"))
    batch_size, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if micro != batch_size:
        steps = accumulation * batch_size // micro
        changes.append(ArgumentChange("per_device_train_batch_size", batch_size, micro,
                                      f"a batch of {batch_size} does not fit even with every layer checkpointed: {_over(whole)}"))
        changes.append(ArgumentChange("gradient_accumulation_steps", accumulation, steps,
                                      f"{steps} micro-batches of {micro} per optimizer step keep the batch of "
                                      f"{batch_size * accumulation} per device"))
    return tuple(changes)
