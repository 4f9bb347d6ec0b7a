"""Tiny model zoo for the planner's tests.

Each `make_<name>()` returns `(model, example_inputs)` built under a fixed seed,
so two calls give identical weights and inputs. Every model is small enough to
construct and run in milliseconds, is traceable by `torch.fx.symbolic_trace`,
and returns either a tensor or an object with `.logits` / `.loss`. The models
are chosen to cover distinct planner situations; `ALL_MODELS` lists them all.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

# Let `examples.gpt` resolve even when pytest is started without the repo root on sys.path.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from examples.gpt import build as build_gpt  # noqa: E402

SEED = 0


# --- MLP: plain nn.Sequential, no repeated custom block class -----------------
# Exercises the planner's fallback partitioning when no repeated unit exists.


def make_mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(SEED)
    dims = [32, 64, 64, 64, 64, 64, 10]  # 6 Linear layers
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(nn.Linear(d_in, d_out))
        if i < len(dims) - 2:  # no activation on the output layer
            layers.append(nn.GELU())
    return nn.Sequential(*layers), (torch.randn(8, 32),)


# --- ResidualMLP: a stack of identical residual blocks ------------------------


class MLPBlock(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class ResidualMLP(nn.Module):
    def __init__(self, width: int = 32, hidden: int = 64, n_blocks: int = 4, n_out: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList([MLPBlock(width, hidden) for _ in range(n_blocks)])
        self.head = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_residual_mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(SEED)
    return ResidualMLP(), (torch.randn(8, 32),)


# --- tiny GPTs: the real example model at toy size ----------------------------

_TINY_GPT = dict(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64, batch_size=2, seq_len=16)


def make_tiny_gpt() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return build_gpt(**_TINY_GPT)


def make_tiny_gpt_eager() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    # Materialises the T x T attention probabilities, unlike the fused sdpa path.
    return build_gpt(**_TINY_GPT, attention="eager")


def make_tiny_gpt_dropout() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    # Dropout makes recomputation RNG-sensitive: replays must restore RNG state.
    return build_gpt(**_TINY_GPT, dropout=0.1)


# --- SmallResNet: BatchNorm, in-place ReLU, downsample shortcuts --------------


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        # One in-place ReLU module called twice, as torchvision does: the fx
        # graph then holds two call_module nodes with the same target.
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


class SmallResNet(nn.Module):
    def __init__(self, widths: tuple[int, int] = (8, 16), n_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        self.layer1 = nn.Sequential(BasicBlock(widths[0], widths[0]), BasicBlock(widths[0], widths[0]))
        self.layer2 = nn.Sequential(BasicBlock(widths[0], widths[1], stride=2), BasicBlock(widths[1], widths[1]))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[1], n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def make_small_resnet() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(SEED)
    return SmallResNet(), (torch.randn(4, 3, 16, 16),)


# --- SkipNet: U-Net-like, long skips keep tensors live across several units ---


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class SkipNet(nn.Module):
    def __init__(self, c: int = 8):
        super().__init__()
        self.e1 = ConvBlock(3, c)  # 16x16
        self.e2 = ConvBlock(c, 2 * c)  # 8x8
        self.e3 = ConvBlock(2 * c, 4 * c)  # 4x4, bottleneck
        self.d3 = ConvBlock(4 * c, 2 * c)  # 4x4
        self.d2 = ConvBlock(4 * c, c)  # 8x8, input is cat(up(d3), e2)
        self.d1 = ConvBlock(2 * c, c)  # 16x16, input is cat(up(d2), e1)
        self.head = nn.Conv2d(c, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.e1(x)
        s2 = self.e2(F.avg_pool2d(s1, 2))
        y = self.e3(F.avg_pool2d(s2, 2))
        y = self.d3(y)
        # s2 and s1 are consumed only here, several units after they were made.
        y = self.d2(torch.cat([F.interpolate(y, scale_factor=2, mode="nearest"), s2], dim=1))
        y = self.d1(torch.cat([F.interpolate(y, scale_factor=2, mode="nearest"), s1], dim=1))
        return self.head(y)


def make_skipnet() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(SEED)
    return SkipNet(), (torch.randn(2, 3, 16, 16),)


# --- LoRA: frozen base weights, trainable low-rank adapters -------------------
# Activations are still needed for the input gradients, but most weights get none.


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, d_in) * d_in**-0.5)
        # Real LoRA starts B at zero; a small nonzero B keeps the adapter path
        # visible in outputs and gives A nonzero gradients in tests.
        self.lora_B = nn.Parameter(torch.randn(d_out, rank) * 0.01)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


class LoRABlock(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = LoRALinear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = LoRALinear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class LoRANet(nn.Module):
    """Frozen base model (LayerNorms and head included); only lora_A/lora_B train."""

    def __init__(self, width: int = 32, hidden: int = 64, n_blocks: int = 3, n_out: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList([LoRABlock(width, hidden) for _ in range(n_blocks)])
        self.head = nn.Linear(width, n_out)
        for name, p in self.named_parameters():
            if "lora_" not in name:
                p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_lora() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(SEED)
    return LoRANet(), (torch.randn(4, 32),)


# --- A flat model: distinct layers, no repeated block, no Sequential -----------
# Its units are runs of graph nodes between articulation points (autoplan/planned/graph.py); it
# uses a parameter directly in forward and has a residual inside one run.


class FlatNet(nn.Module):
    def __init__(self, d_in: int = 16, width: int = 64, n_out: int = 4):
        super().__init__()
        self.fc_in = nn.Linear(d_in, width)
        self.norm = nn.LayerNorm(width)
        self.gain = nn.Parameter(torch.ones(width))
        self.fc_mid = nn.Linear(width, width)
        self.fc_wide = nn.Linear(width, 2 * width)
        self.drop = nn.Dropout(0.1)
        self.fc_out = nn.Linear(2 * width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc_in(x))
        h = self.norm(h) * self.gain
        h = h + F.relu(self.fc_mid(h))
        h = self.drop(torch.tanh(self.fc_wide(h)))
        return self.fc_out(h)


def make_flat() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(SEED)
    return FlatNet(), (torch.randn(8, 16),)


ALL_MODELS: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "mlp": make_mlp,
    "residual_mlp": make_residual_mlp,
    "tiny_gpt": make_tiny_gpt,
    "tiny_gpt_eager": make_tiny_gpt_eager,
    "tiny_gpt_dropout": make_tiny_gpt_dropout,
    "small_resnet": make_small_resnet,
    "skipnet": make_skipnet,
    "lora": make_lora,
    "flat": make_flat,
}
