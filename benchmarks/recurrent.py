"""Where recurrent stacks are still predicted high: the figures docs/how-it-works.md quotes.

Three cases, CPU, fp32, AdamW, outputs alive through backward (live tensor bytes of training step 2):
1. two bidirectional GRUs each followed by a Linear, written `y = rnn(x)[0]; x = proj(y)`: a plan of
   graph-run units, all `keep`, against the same model unplanned (its Python local `y` holds the
   GRU's output longer than the rewrite's torch.fx code does);
2. residual stacks of bidirectional GRU / LSTM modules (`x = x + proj(rnn(x)[0])`), all `keep`;
3. a conv + bidirectional GRU model: autoplan's floor against checkpointing each block by hand.

    python benchmarks/recurrent.py
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402
from tests.handmade import compare_with_plan, measured_step  # noqa: E402
from tests.structures import Structure  # noqa: E402


class HeldLocal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnns = nn.ModuleList([nn.GRU(24, 24, batch_first=True, bidirectional=True) for _ in range(2)])
        self.proj = nn.ModuleList([nn.Linear(48, 24) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for rnn, proj in zip(self.rnns, self.proj):
            y = rnn(x)[0]
            x = proj(y)
        return x.pow(2).mean()


class ResidualStack(nn.Module):
    def __init__(self, layer: type[nn.Module], **options) -> None:
        super().__init__()
        self.rnns = nn.ModuleList([layer(24, 24, batch_first=True, bidirectional=True, **options) for _ in range(3)])
        self.proj = nn.ModuleList([nn.Linear(48, 24) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for rnn, proj in zip(self.rnns, self.proj):
            x = x + proj(rnn(x)[0])
        return x.pow(2).mean()


class ConvGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Sequential(nn.Conv1d(16, 16, 5, padding=2), nn.BatchNorm1d(16), nn.ReLU()) for _ in range(3)])
        self.gru = nn.GRU(16, 32, num_layers=2, batch_first=True, bidirectional=True)
        self.ctc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = x + conv(x)
        return self.ctc(self.gru(x.transpose(1, 2))[0]).log_softmax(-1)


def keep_row(name: str, model: nn.Module, x: torch.Tensor) -> str:
    plan = autoplan.plan(model, "1GB", example_inputs=(x,), device="cpu", precision="fp32", reserve=0,
                         checkpoint={"*": "keep"}, menu_size=0)
    planned = measured_step(autoplan.apply(copy.deepcopy(model), plan), (x,)).peak_bytes
    original = measured_step(copy.deepcopy(model), (x,)).peak_bytes
    units = "graph runs" if plan.decisions.units[0].name.startswith("graph[") else "modules"
    return (f"| {name} | {units} | {plan.prediction.peak_bytes:,} | {plan.prediction.simulated_peak_bytes:,} | {planned:,} | "
            f"{original:,} |")


def main() -> None:
    warnings.simplefilter("ignore")
    print(f"machine: {describe_machine()}; CPU, fp32, AdamW, outputs alive through backward\n")
    print("| model, every unit keep | units | predicted (B) | simulated (B) | rewritten, measured (B) | original, measured (B) |")
    print("|---|---|---:|---:|---:|---:|")
    for name, build in (("2 bidirectional GRUs, local y", HeldLocal),
                        ("3 residual bidirectional 2-layer GRUs", lambda: ResidualStack(nn.GRU, num_layers=2)),
                        ("3 residual bidirectional LSTMs", lambda: ResidualStack(nn.LSTM))):
        torch.manual_seed(0)
        print(keep_row(name, build(), torch.randn(3, 20, 24)), flush=True)

    def conv_gru():
        torch.manual_seed(0)
        return ConvGRU(), torch.randn(4, 16, 40, generator=torch.Generator().manual_seed(3))

    row = compare_with_plan(Structure("conv + bidirectional GRU", conv_gru, lambda m: [*m.convs, m.gru]))
    print(f"\nconv + bidirectional GRU: checkpointing each block by hand {row.by_hand.peak_bytes:,} B, autoplan's floor "
          f"{row.floor_bytes:,} B ({row.floor_bytes / row.by_hand.peak_bytes:.4f}×), a plan at the by-hand peak: "
          f"{'fits' if row.feasible else 'none'}")


if __name__ == "__main__":
    main()
