"""The advice's optimizer-state steps: 8-bit optimizer state and 4-bit QLoRA, from the optimizer the plan counted.

Both are formulas against the plan's counted state (bitsandbytes' AdamW8bit's own layout; NF4's bits per parameter),
said as such; `--optimizer adamw8bit` and `--ladder` plan them exactly. A step already taken is "chosen", and one
that does not apply to this model or optimizer says why rather than offering a formula made for another.
"""

from __future__ import annotations

from typing import Protocol

from autoplan.inputs.devices import Device
from autoplan.inputs.hf_models import loader_class
from autoplan.plan import Plan
from autoplan.profile.profiler import Profile
from autoplan.report.batch_steps import Step
from autoplan.vocabulary.formatting import format_bytes, format_count
from autoplan.vocabulary.tensors import rounded_bytes

QLORA_BITS_PER_PARAMETER = 4.127  # NF4 weights + double-quantised block constants (QLoRA paper, §3)
MIN_8BIT_SIZE = 4096  # bitsandbytes keeps the state of smaller tensors in fp32 (Optimizer8bit's min_8bit_size)
BLOCK_8BIT = 256  # elements per absmax block of its blockwise-quantized state
QMAP_BYTES = 2 * 256 * 4  # the two 256-entry fp32 quantization maps the optimizer keeps once
EIGHT_BIT_OPTIMIZERS = ("adamw8bit", "adam8bit", "paged-adamw8bit", "lion8bit")  # inputs.options.OPTIMIZERS' 8-bit ones


def adamw8bit_state_bytes(numels: list[int]) -> int:
    """Bytes of bitsandbytes AdamW8bit's state for trainable tensors of these sizes (a formula, not a plan).

    Per tensor of n ≥ 4096 elements: two moments of n uint8 each plus an fp32 absmax per 256-element
    block; smaller tensors keep two fp32 moments (bitsandbytes' min_8bit_size); two 256-entry fp32
    maps shared by all (the step count is a Python int). Each tensor rounded as the allocator rounds it.
    """
    quantized = [n for n in numels if n >= MIN_8BIT_SIZE]
    total = 2 * rounded_bytes(QMAP_BYTES // 2) if quantized else 0
    for n in numels:
        if n >= MIN_8BIT_SIZE:
            total += 2 * (rounded_bytes(n) + rounded_bytes(4 * -(-n // BLOCK_8BIT)))
        else:
            total += 2 * rounded_bytes(4 * n)
    return total


def eight_bit_step_change_s(numels: list[int], bandwidth: float) -> float:
    """How much AdamW8bit's update changes optimizer.step()'s time against AdamW's, both memory-bound (roofline).

    Per element AdamW reads weight, gradient and two fp32 moments and writes weight and moments: 28 bytes;
    AdamW8bit moves the fp32 weight and gradient the same way (12 bytes), its two uint8 moments (4) and
    their fp32 absmax per 256 elements.
    """
    eight = sum(16 * n + 16 * -(-n // BLOCK_8BIT) for n in numels)
    return (eight - 28 * sum(numels)) / bandwidth


def optimizer_state_steps(plan: Plan, profile: Profile, parameter_count: int | None) -> list[Step]:
    static = profile.timeline.static
    return [eight_bit_step(profile.optimizer, static.optimizer, profile.device), qlora_step(plan, static, parameter_count)]


class StateParts(Protocol):
    """The bytes every step holds whatever the units choose: the simulated step's `StaticBytes`, or a counted plan's
    breakdown (`solve.states_bound`)."""

    @property
    def parameters(self) -> int: ...

    @property
    def gradients(self) -> int: ...

    @property
    def optimizer(self) -> int: ...


def eight_bit_step(optimizer: str, state: int, device: Device) -> Step:
    """8-bit state, from the optimizer the plan counted: already 8-bit is chosen; AdamW/Adam's two fp32 moments
    by formula; anything else has no 8-bit twin counted here (a formula for AdamW's state would be wrong for it)."""
    title, name = "8-bit optimizer state", optimizer.lower()
    if name in EIGHT_BIT_OPTIMIZERS:
        paged = " (paged: on a GPU its state lives in CUDA unified memory, off the card)" if name.startswith("paged") else ""
        return Step("optimizer_8bit", title, "chosen", f"planned with {optimizer}: its {format_bytes(state)} of state "
                    f"on the device are counted as bitsandbytes allocates them{paged}")
    if state == 0:
        return Step("optimizer_8bit", title, "n/a", f"{optimizer} keeps no state")
    if name.startswith("paged") and device.kind == "cuda":
        return Step("optimizer_8bit", title, "n/a", f"{optimizer} pages its state to CUDA unified memory: the card "
                    "holds none of it, and 8 bits would shrink host memory only")
    if name not in ("adamw", "adam"):
        return Step("optimizer_8bit", title, "n/a", f"{optimizer}'s state has no 8-bit twin planned here (adamw8bit, "
                    "adam8bit and lion8bit are: plan with --optimizer)")
    # AdamW's 8 bytes a trainable parameter (N = state / 8) become 2 and an fp32 absmax per 256 (adamw8bit_state_bytes)
    count = state // 8
    eight = 2 * count + 8 * -(-count // BLOCK_8BIT)
    change = eight_bit_step_change_s([count], device.memory_bandwidth)
    return Step("optimizer_8bit", title, "try",
                f"{optimizer}'s {format_bytes(state)} of fp32 state become {format_bytes(eight)} (2 bytes a "
                f"parameter and an fp32 absmax per {BLOCK_8BIT}; tensors under {MIN_8BIT_SIZE} elements stay fp32): saves "
                f"{format_bytes(state - eight)}; the update moves 16 bytes a parameter instead of 28 (roofline of both). "
                f"A formula here: plan with --optimizer {name}8bit (optimizer=\"{name}8bit\") to count it exactly",
                state - eight, change, f"import bitsandbytes as bnb; optimizer = bnb.optim.{'AdamW' if name == 'adamw' else 'Adam'}8bit(model.parameters())")


def qlora_step(plan: Plan, states: StateParts, parameter_count: int | None) -> Step:
    """4-bit QLoRA: a transformers checkpoint loaded in 4 bits with LoRA adapters; for any other model it does not apply."""
    title = "4-bit QLoRA (fine-tuning only)"
    if plan.model.name.startswith("PeftModel"):
        return Step("qlora", title, "n/a", f"{plan.model.name} trains peft adapters already; where its base is not 4-bit yet, "
                    "loading the base with BitsAndBytesConfig(load_in_4bit=True) is QLoRA's remaining step (--ladder plans it "
                    "from the base model)")
    if loader_class(plan.model.name) is None:
        return Step("qlora", title, "n/a", f"QLoRA loads a transformers checkpoint in 4 bits with peft's adapters; "
                    f"{plan.model.name} is not a model transformers loads (8-bit optimizer state and FSDP still apply)")
    count = parameter_count if parameter_count is not None else states.gradients // 4
    quantised = int(count * QLORA_BITS_PER_PARAMETER / 8)
    saves = states.parameters + states.gradients + states.optimizer - quantised
    return Step("qlora", title, "try" if saves > 0 else "n/a",
                f"frozen {format_count(count)} parameters in NF4 take about {format_bytes(quantised)} instead of "
                f"{format_bytes(states.parameters)} with {format_bytes(states.gradients + states.optimizer)} of gradients and optimizer "
                f"state: saves about {format_bytes(saves)} before the LoRA adapters (usually under 1% of the parameters). "
                "It trains adapters, not the model: for fine-tuning, not pre-training (--ladder plans it)",
                saves, None, _qlora_code(plan.model.name))


def _qlora_code(model_name: str) -> str:
    """Loading the planned model's checkpoint in 4 bits with its own auto class; none for a model transformers does not load."""
    loader = loader_class(model_name)
    if loader is None:
        return ""
    return (f"model = {loader}.from_pretrained(CHECKPOINT, quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
            "bnb_4bit_quant_type=\"nf4\"))\nmodel = peft.prepare_model_for_kbit_training(model)")
