"""The training loop a plan is made for: what the person's step does that changes its memory.

A frozen value handed to `autoplan.plan(..., loop=...)`. The default is the loop of the
PyTorch tutorials and the transformers documentation: the model's outputs stay alive through
backward, one micro-batch per optimizer step, `zero_grad(set_to_none=True)`.
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZER_IMPLEMENTATIONS = ("auto", "foreach", "fused", "for-loop")


@dataclass(frozen=True)
class TrainingLoop:
    keep_outputs: bool = True  # the model's outputs (e.g. logits) stay alive through backward
    accumulation_steps: int = 1  # micro-batches per optimizer step
    zero_grad_set_to_none: bool = True  # zero_grad(set_to_none=False) keeps gradients alive through forward
    optimizer_impl: str = "auto"  # "auto" (torch's default for the device), "foreach", "fused", "for-loop"
    grad_scaler: bool = False  # fp16 autocast with torch.amp.GradScaler
    loss_in_model: bool | None = None  # the model computes the loss from labels (None: infer from the batch)

    def __post_init__(self) -> None:
        if not isinstance(self.accumulation_steps, int) or isinstance(self.accumulation_steps, bool) or self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be a whole number, at least 1; got {self.accumulation_steps!r}")
        if self.optimizer_impl not in OPTIMIZER_IMPLEMENTATIONS:
            raise ValueError(f"optimizer_impl must be one of {OPTIMIZER_IMPLEMENTATIONS}; got {self.optimizer_impl!r}")
