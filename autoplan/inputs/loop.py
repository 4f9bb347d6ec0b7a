"""The training loop a plan is made for: what the person's step does that changes its memory.

A frozen value handed to `autoplan.plan(..., loop=...)`. The default is the loop of the
PyTorch tutorials and the transformers documentation: the model's outputs stay alive through
backward, one micro-batch per optimizer step, `zero_grad(set_to_none=True)`:

    for batch in loader:
        outputs = model(**batch)            # alive until the next step's forward returns
        loss = outputs.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

What each field changes in memory (docs/loops.md has the measurements):
- keep_outputs: True, the outputs (logits) stay alive through backward, the optimizer step and
  the next step's forward (the loop's variable is reassigned only when that forward returns);
  False (`loss = loss_fn(model(batch))`), they die once the loss is computed, unless the loss
  saved them for backward.
- accumulation_steps N > 1: every micro-batch after the first runs forward and backward with all
  gradients alive; the loss is divided by N. The example batch is one micro-batch.
- zero_grad_set_to_none=False: gradients are zeroed, not freed, so they are alive through the
  next forward and backward too.
- optimizer_impl: the temporaries of `optimizer.step()`: "foreach" (torch's CUDA default) makes
  them for all parameters at once, "for-loop" (its CPU default) one parameter at a time, "fused"
  none; "auto" is torch's default for the device planned for.
- grad_scaler: the scaled loss, the scale and the unscale before the step (a few scalars).
- loss_in_model: True, the loss is the output's `.loss` (an error if there is none); False, it is
  `loss_fn(output)` (default: the sum of the floating-point outputs); None, the output's `.loss`
  when there is one (or the one scalar of a tuple output, nanoGPT's `(logits, loss)`), else `loss_fn`.
- zero_grad_before_backward: `zero_grad` runs between the forward and backward (Lightning's
  automatic optimization), not after `optimizer.step()`: the last step's gradients are alive through
  the forward and the loss, and freed only as backward begins.
- fetches_whole_step: every micro-batch of an optimizer step is on the device before its first
  forward (the Trainer's `get_batch_samples`), not one at a time.
- batches_ahead N: N more batches fetched ahead of the one training (nanoGPT fetches the next batch
  while the current one trains: 1).
- kept_on_device_bytes: what the loop keeps on the device beside the model and its batch: frozen
  encoders (a diffusion loop's VAE and text encoder), an EMA copy, latents and noise.
  `TrainingLoop().keeping(vae, text_encoder, ema)` counts modules and tensors for it.
- outer_autocast "bf16"/"fp16": the loop's own `with torch.autocast(...)` around the forward and the
  loss (the recipe of the PyTorch AMP docs). Every unit then runs in that precision (the plan's
  precision is it), and the loss is computed under autocast too (a cross-entropy in fp32).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from autoplan.errors import OptionError, OptionTypeError
from autoplan.vocabulary.formatting import format_bytes

OPTIMIZER_IMPLEMENTATIONS = ("auto", "foreach", "fused", "for-loop")
OUTER_AUTOCASTS = (None, "bf16", "fp16")


@dataclass(frozen=True)
class TrainingLoop:
    keep_outputs: bool = True  # the model's outputs (e.g. logits) stay alive through backward
    accumulation_steps: int = 1  # micro-batches per optimizer step
    zero_grad_set_to_none: bool = True  # zero_grad(set_to_none=False) keeps gradients alive through forward
    optimizer_impl: str = "auto"  # "auto" (torch's default for the device), "foreach", "fused", "for-loop"
    grad_scaler: bool = False  # fp16 autocast with torch.amp.GradScaler
    loss_in_model: bool | None = None  # the model computes the loss from labels (None: infer from the batch)
    zero_grad_before_backward: bool = False  # Lightning: zero_grad between forward and backward, not after the step
    fetches_whole_step: bool = False  # the Trainer: all of a step's micro-batches on the device before its first forward
    batches_ahead: int = 0  # batches fetched ahead of the one training (nanoGPT's prefetch: 1)
    kept_on_device_bytes: int = 0  # the loop's own device memory beside the model: frozen encoders, EMA copy, latents
    outer_autocast: str | None = None  # "bf16"/"fp16": the loop's own autocast around the forward and the loss

    def __post_init__(self) -> None:
        for name, least in (("accumulation_steps", 1), ("batches_ahead", 0), ("kept_on_device_bytes", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise OptionError(f"{name} must be a whole number, at least {least}; got {value!r}")
        if self.optimizer_impl not in OPTIMIZER_IMPLEMENTATIONS:
            raise OptionError(f"optimizer_impl must be one of {OPTIMIZER_IMPLEMENTATIONS}; got {self.optimizer_impl!r}")
        for name in ("keep_outputs", "zero_grad_set_to_none", "grad_scaler", "zero_grad_before_backward", "fetches_whole_step"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if self.outer_autocast not in OUTER_AUTOCASTS:
            raise OptionError(f"outer_autocast must be one of {OUTER_AUTOCASTS}; got {self.outer_autocast!r}")
        if not (self.loss_in_model is None or isinstance(self.loss_in_model, bool)):
            raise OptionError(f"loss_in_model must be True, False or None; got {self.loss_in_model!r}")

    @property
    def gradients_alive_in_forward(self) -> bool:
        """Whether the steady-state forward runs with every gradient already allocated."""
        return self.accumulation_steps > 1 or not self.zero_grad_set_to_none or self.zero_grad_before_backward

    @property
    def batches_on_device(self) -> int:
        """Micro-batches on the device through the step: the one training, and those fetched ahead."""
        return (self.accumulation_steps if self.fetches_whole_step else 1) + self.batches_ahead

    def zeroes_before_backward(self, first_micro_batch: bool) -> bool:
        """Whether zero_grad runs before this micro-batch's backward: Lightning zeroes at the first of a step's micro-batches."""
        return self.zero_grad_before_backward and first_micro_batch

    def keeping(self, *held: object) -> TrainingLoop:
        """This loop, also keeping `held` on the device through the step: modules (their parameters and buffers), tensors,
        and lists, tuples and dicts of them, each storage once, rounded up as the CUDA caching allocator rounds (512 B)."""
        return dataclasses.replace(self, kept_on_device_bytes=self.kept_on_device_bytes + device_bytes(*held))

    def accumulating(self, micro_batches: int) -> TrainingLoop:
        """This loop with each batch split into `micro_batches` micro-batches (gradient accumulation)."""
        return dataclasses.replace(self, accumulation_steps=self.accumulation_steps * micro_batches)

    def optimizer_implementation(self, device_kind: str) -> str:
        """"foreach", "fused" or "for-loop": "auto" resolved to torch's default for `device_kind`."""
        if self.optimizer_impl != "auto":
            return self.optimizer_impl
        return "foreach" if device_kind == "cuda" else "for-loop"

    def describe(self, optimizer: str = "the") -> str:
        """One line for the report: the loop as its code would say it; `optimizer`: the one planned for ("adamw")."""
        parts = ["outputs kept through backward" if self.keep_outputs else "outputs dropped before backward"]
        if self.accumulation_steps > 1:
            parts.append(f"{self.accumulation_steps} micro-batches per optimizer step")
        parts.append("zero_grad(set_to_none=True)" if self.zero_grad_set_to_none else "zero_grad(set_to_none=False)")
        # the implementation, not the optimizer: "auto optimizer" read as if the optimizer had been chosen for the person
        implementation = "torch's default" if self.optimizer_impl == "auto" else self.optimizer_impl
        parts.append(f"{optimizer} optimizer, {implementation} implementation")
        if self.grad_scaler:
            parts.append("GradScaler")
        if self.loss_in_model is not None:
            parts.append("loss from the model's labels" if self.loss_in_model else "loss computed outside the model")
        if self.zero_grad_before_backward:
            parts.append("zero_grad before backward (last step's gradients alive through the forward)")
        if self.batches_on_device > 1:
            ahead = "every micro-batch of the step fetched before its forward" if self.fetches_whole_step else "fetched ahead"
            parts.append(f"{self.batches_on_device} micro-batches on the device ({ahead})")
        if self.kept_on_device_bytes:
            parts.append(f"{format_bytes(self.kept_on_device_bytes)} kept on the device beside the model")
        if self.outer_autocast:
            parts.append(f"forward and loss under the loop's autocast ({self.outer_autocast})")
        return ", ".join(parts)


def device_bytes(*held: object) -> int:
    """Bytes that modules (what the model would hold: parameters, buffers, quantization state) and tensors hold, each
    storage once, rounded up to 512 B blocks."""
    import torch  # here: the loop's fields are read before torch is loaded (the command line's checks)

    from autoplan.instruments.quantized import resident_tensors
    from autoplan.vocabulary.tensors import unique_storage_bytes

    tensors: list = []
    pending = list(held)
    while pending:
        thing = pending.pop()
        if isinstance(thing, torch.nn.Module):  # parameters, buffers, and a quantized module's state
            tensors.extend(resident_tensors(thing))
        elif isinstance(thing, torch.Tensor):
            tensors.append(thing)
        elif isinstance(thing, (list, tuple, dict)):  # an EMA's shadow_params, a batch
            pending.extend(thing.values() if isinstance(thing, dict) else thing)
        else:
            raise OptionTypeError(f"keeping() counts modules and tensors (and lists, tuples and dicts of them); "
                                  f"got {type(thing).__name__}")
    return unique_storage_bytes(tensors)


def check_loop(loop: object) -> TrainingLoop:
    """`loop` as a TrainingLoop (None: the common loop; a mapping: those fields changed), or a TypeError saying what to pass."""
    if loop is None:
        return TrainingLoop()
    if isinstance(loop, Mapping):  # the fields that differ from the common loop, as plan.request.arguments records them
        unknown = sorted(set(loop) - {field.name for field in dataclasses.fields(TrainingLoop)})
        if unknown:
            raise OptionTypeError(f"loop has no field {unknown[0]!r}; its fields are {[f.name for f in dataclasses.fields(TrainingLoop)]}")
        return TrainingLoop(**loop)
    if not isinstance(loop, TrainingLoop):
        raise OptionTypeError(
            f"loop must be an autoplan.TrainingLoop, e.g. TrainingLoop(keep_outputs=False, accumulation_steps=4); "
            f"got {type(loop).__name__}"
        )
    return loop


def changed_fields(loop: TrainingLoop) -> dict[str, object]:
    """The fields of `loop` that differ from the common loop: what `check_loop` needs to make it again."""
    return {field.name: getattr(loop, field.name) for field in dataclasses.fields(loop) if getattr(loop, field.name) != field.default}
