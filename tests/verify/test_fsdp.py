"""measure_rank_peak, the per-rank count the FSDP tests compare plans with: on one process it counts what
autoplan.verify counts, the loop's outputs of the last step included."""

from __future__ import annotations

import torch

import autoplan
from autoplan.verify.fsdp import measure_rank_peak


class _WideHead(torch.nn.Module):
    """Outputs far larger than its loss: what the loop keeps of a step (a language model's logits) is most of the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
        self.head = torch.nn.Linear(64, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_counts_the_outputs_the_loop_still_holds_from_the_last_step() -> None:
    torch.manual_seed(0)
    model, batch = _WideHead(), torch.randn(128, 64)
    loss_fn = lambda output: output.square().mean()  # noqa: E731
    plan = autoplan.plan(model, "1GB", example_inputs=(batch,), loss_fn=loss_fn, device="cpu", reserve=0, profile="roofline",
                         precision="fp32")
    optimizer = torch.optim.AdamW(model.parameters())
    measured = measure_rank_peak(model, ((batch,), {}), optimizer, steps=3, loss_fn=loss_fn, loop=plan.request.loop)
    verified = autoplan.verify(model, plan, example_inputs=(batch,), loss_fn=loss_fn, steps=3)
    # the outputs (2 MiB) alive at each step's mark were left out of what it said was held, and their free then taken
    # off the count a second time: the peak came out 2 MiB low
    assert measured.peak_bytes == verified.measured_peak_bytes == plan.prediction.peak_bytes
    assert len(measured.losses) == 3 and measured.losses[-1] < measured.losses[0]
