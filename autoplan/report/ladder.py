"""The toolbox ladder: the exercise people do by hand to fit a model, each rung planned, not guessed.

Starting from the model as written (fp32, every block keeps its activations, attention that saves its
T×T probabilities, AdamW in fp32), each rung adds one tool to the ones above it:

    baseline → + bf16 autocast → + activation checkpointing (autoplan's plan) → + fused attention (SDPA)
             → + 4-bit QLoRA → + 8-bit optimizer state

`plan_ladder(model, plan_model)` plans the rungs of a Hugging Face model (on the meta device: no
weights): three plans — eager attention, SDPA, and the QLoRA twin (`inputs.qlora_twin`) — each at the
same budget with the options of the plan the ladder is printed under (its precision per unit, offload),
so the rung with the model's own attention is that plan; the baseline and bf16 rungs are read from the
first plan's profile (no plan at all; every block kept in bf16), and the 8-bit optimizer rung from the
QLoRA plan with the state bytes of bitsandbytes' AdamW8bit in place of AdamW's (`adamw8bit_state_bytes`,
a formula here; `optimizer="adamw8bit"` plans it exactly). Every rung has a predicted peak and a
step time, and the ladder marks the first that fits; `Ladder.apply_code` gives the lines that take a person
there (transformers, peft, bitsandbytes and the autoplan call).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from autoplan.axes.precision import kind
from autoplan.errors import OptionError
from autoplan.inputs.hf_models import loader_class
from autoplan.inputs.qlora_twin import QLoraSettings, qlora_twin, require_qlora, with_attention
from autoplan.memory.model import phase_bytes, predict_peak, predict_step_time
from autoplan.plan import Plan, Precision
from autoplan.profile.profiler import Profile
from autoplan.report.advice import every_unit
from autoplan.report.optimizer_advice import adamw8bit_state_bytes, eight_bit_step_change_s
from autoplan.report.apply_code import apply_code
from autoplan.vocabulary.formatting import first_line

PlanModel = Callable[[torch.nn.Module], tuple[Plan, Profile]]  # plans a variant at the ladder's budget, with the plan's options


@dataclass(frozen=True)
class Rung:
    """One rung: everything above it plus one tool, with what the plan predicts there."""

    key: str  # baseline, bf16, checkpointing, sdpa, qlora, optimizer_8bit
    title: str
    peak_bytes: int
    step_time_s: float
    fits: bool
    how: str  # how the numbers were predicted
    code: str  # the lines this rung adds


@dataclass(frozen=True)
class Ladder:
    """The rungs in order, the budget they were planned at, and the first that fits (None: none does)."""

    rungs: tuple[Rung, ...]
    budget_bytes: int
    usable_bytes: int
    device: str
    first_fit: str | None
    apply_code: str  # the lines that reproduce the first rung that fits ("" when none fits: optimize() would refuse)

    def rung(self, key: str) -> Rung | None:
        return next((r for r in self.rungs if r.key == key), None)

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "usable_bytes": self.usable_bytes, "device": self.device,
                "first_fit": self.first_fit, "rungs": [asdict(r) for r in self.rungs], "apply_code": self.apply_code}


def plan_ladder(model: torch.nn.Module, plan_model: PlanModel, *, budget_text: str,
                settings: QLoraSettings = QLoraSettings(), say: Callable[[str], None] = lambda message: None) -> Ladder:
    """Plan every rung of the ladder for the Hugging Face `model` (built on the meta device).

    plan_model(variant) -> (Plan, Profile): plans a variant at the ladder's budget with the plan's own options.
    Needs bitsandbytes and peft (MissingExtraError otherwise).
    """
    require_qlora("the ladder's 4-bit QLoRA rung")
    loader = loader_class(type(model).__name__) or type(model).__name__  # what the snippets load CHECKPOINT with
    eager, sdpa = _attention_variants(model)
    say("ladder: planning with eager attention")
    eager_plan, eager_profile = plan_model(eager)
    low = eager_plan.target.low_precision
    settings = dataclasses.replace(settings, compute_dtype=low)  # the 4-bit matmuls run in the device's autocast dtype
    say("ladder: planning with fused attention (SDPA)")
    sdpa_plan, _ = plan_model(sdpa)
    say("ladder: planning the 4-bit QLoRA twin")
    twin = qlora_twin(sdpa, settings)
    qlora_plan, qlora_profile = plan_model(twin)
    trainable = [p.numel() for p in twin.parameters() if p.requires_grad]
    rungs = [
        *_precision_rungs(eager_plan, eager_profile, low, loader),
        _planned("checkpointing", "+ checkpointing (autoplan)", eager_plan,
                 "autoplan's plan with eager attention, its options as the plan above", apply_code(eager_plan, budget_text)),
        _planned("sdpa", "+ fused attention (SDPA)", sdpa_plan, "planned again with attn_implementation=\"sdpa\"",
                 f'model = {loader}.from_pretrained(CHECKPOINT, attn_implementation="sdpa")'),
        _planned("qlora", f"+ 4-bit QLoRA ({settings.quant_type.upper()}, r={settings.rank})", qlora_plan,
                 "planned on the meta-device QLoRA twin (packed 4-bit weights and quant state, LoRA adapters "
                 "trainable, the rest upcast to fp32 by prepare_model_for_kbit_training)", _qlora_code(settings, loader)),
        _eight_bit_rung(qlora_plan, qlora_profile, trainable),
    ]
    first = next((r.key for r in rungs if r.fits), None)
    plans = {"checkpointing": eager_plan, "sdpa": sdpa_plan, "qlora": qlora_plan, "optimizer_8bit": qlora_plan}
    return Ladder(tuple(rungs), eager_plan.request.budget_bytes, eager_plan.request.usable_bytes, eager_plan.target.device, first,
                  _apply(rungs, first, plans, budget_text, loader) if first else "")


def _attention_variants(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model with eager attention and with SDPA; one that cannot take both is an OptionError (exit 2)."""
    try:
        return with_attention(model, "eager"), with_attention(model, "sdpa")
    except (ValueError, AttributeError) as error:
        raise OptionError(f"the ladder compares eager attention with SDPA, and {type(model).__name__} cannot switch: "
                          f"{first_line(error)}") from error


def _precision_rungs(plan: Plan, profile: Profile, low: Precision, loader: str) -> list[Rung]:
    usable = plan.request.usable_bytes
    reference = profile.reference
    base_time = profile.reference_step_time_s or reference.step_time_s
    baseline = Rung("baseline", "baseline (fp32, eager attention)", reference.peak_bytes, base_time,
                    reference.peak_bytes <= usable, "simulated step with no plan: every block keeps its activations, nothing "
                    "under autocast", f'model = {loader}.from_pretrained(CHECKPOINT, attn_implementation="eager")')
    kept = every_unit(profile, "keep", low)
    peak = predict_peak(profile, kept).bytes if kept else profile.timeline.peak_bytes
    time = predict_step_time(profile, kept) if kept else profile.timeline.step_time_s
    scaler = "\nscaler = torch.amp.GradScaler()" if kind(low).grad_scaler else ""
    lowered = Rung(low, f"+ {low} autocast", peak, time, peak <= usable,
                   f"the same profile with every block kept in {low} (fp32 master weights and AdamW state)",
                   f"with torch.autocast(\"cuda\", dtype=torch.{kind(low).dtype_name}): "
                   f"loss = model(**batch).loss{scaler}")
    return [baseline, lowered]


def _planned(key: str, title: str, plan: Plan, how: str, code: str) -> Rung:
    return Rung(key, title, plan.prediction.peak_bytes, plan.prediction.step_time_s, plan.outcome.feasible, how, code)


def _qlora_code(settings: QLoraSettings, loader: str) -> str:
    return "\n".join([
        f"model = {loader}.from_pretrained(CHECKPOINT, attn_implementation=\"sdpa\",",
        f"    quantization_config=BitsAndBytesConfig({settings.bits_and_bytes_arguments()}))",
        "model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # autoplan checkpoints",
        f"model = get_peft_model(model, LoraConfig({settings.lora_arguments()}))",
    ])


def _eight_bit_rung(plan: Plan, profile: Profile, trainable: list[int]) -> Rung:
    """The QLoRA plan's choices with AdamW8bit's state instead of AdamW's (a formula: bitsandbytes optimizers are not planned).

    Every phase holds the optimizer state, so each drops by the difference; optimizer.step() keeps its
    static bytes only, as the 8-bit update runs in place, tensor by tensor. Its time: the QLoRA step
    with the optimizer's traffic changed from AdamW's to AdamW8bit's (`eight_bit_step_change_s`).
    """
    saved = profile.timeline.static.optimizer - adamw8bit_state_bytes(trainable)
    phases = phase_bytes(profile, plan.decisions.choices())
    peak = max((p.static_bytes if p.kind == "step" else p.live_bytes) - saved for p in phases)
    time = plan.prediction.step_time_s + eight_bit_step_change_s(trainable, profile.device.memory_bandwidth)
    how = ("the QLoRA plan's choices with bitsandbytes AdamW8bit's state (2 bytes a parameter + an fp32 absmax per 256; "
           "fp32 under 4096 elements) in place of AdamW's fp32 state: a formula, not a plan")
    code = "optimizer = bnb.optim.AdamW8bit([p for p in model.parameters() if p.requires_grad])"
    return Rung("optimizer_8bit", "+ 8-bit optimizer (AdamW8bit)", peak, time, peak <= plan.request.usable_bytes, how, code)


def _apply(rungs: list[Rung], first: str, plans: dict[str, Plan], budget_text: str, loader: str) -> str:
    """The lines up to the first rung that fits: imports, load, autoplan, optimizer."""
    chosen = rungs[: [r.key for r in rungs].index(first) + 1]
    taken = {r.key for r in chosen}
    lines = ["import torch", "import autoplan", f"from transformers import {loader}" + (", BitsAndBytesConfig" if "qlora" in taken else "")]
    if "qlora" in taken:
        lines.append("from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training")
    if "optimizer_8bit" in taken:
        lines.append("import bitsandbytes as bnb")
    lines.append(next(r.code for r in reversed(chosen) if r.key in ("baseline", "sdpa", "qlora")))  # how to load it
    planned = [r.key for r in chosen if r.key in plans]
    if planned:  # autoplan's call replaces autocast by hand: it puts the blocks in their precision
        lines.append(apply_code(plans[planned[-1]], budget_text))
    elif len(chosen) > 1:
        lines.append(chosen[1].code)
    lines.append(chosen[-1].code if "optimizer_8bit" in taken else
                 "optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])")
    return "\n".join(lines)
