"""Factories the CLI tests plan: `autoplan plan tests/cli_factories.py:tiny_gpt ...`.

Each returns (model, example_inputs) like examples/gpt.py's build(); some are broken on purpose.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from examples.gpt import GPT, GPTConfig, build  # noqa: E402


def tiny_gpt(batch_size: int = 4, seq_len: int = 32, attention: str = "eager"):
    """Two blocks, eager attention (materialised T×T probabilities)."""
    return build(n_layer=2, n_embd=32, n_head=2, block_size=64, vocab_size=64,
                 batch_size=batch_size, seq_len=seq_len, attention=attention)


def small_gpt(batch_size: int = 4, seq_len: int = 128):
    """Two blocks whose activations (tens of MB) outweigh the caching allocator's 2 MiB and 20 MiB segments."""
    return build(n_layer=2, n_embd=128, n_head=4, block_size=128, vocab_size=256,
                 batch_size=batch_size, seq_len=seq_len, attention="eager")


def tiny_gpt_sdpa(batch_size: int = 4, seq_len: int = 32):
    return tiny_gpt(batch_size, seq_len, attention="sdpa")


def wide_gpt_on_meta():
    """About 1B parameters on the meta device: too big for one small GPU, planned without memory."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=4, n_embd=4096, n_head=32, block_size=256, vocab_size=50257))
    return model, (torch.zeros(2, 256, dtype=torch.long, device="meta"),)


def no_sizes():
    """Takes neither batch_size nor seq_len."""
    model, inputs = tiny_gpt()
    return model, inputs


def raises():
    raise RuntimeError("the dataset is not downloaded")


def model_only():
    return nn.Linear(4, 4)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class _DataDependent(nn.Module):
    """Python control flow on a tensor's value: neither fx nor torch.export can trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if x.sum() > 0 else -block(x)
        return x


def untraceable():
    return _DataDependent(), (torch.randn(2, 8),)


def tiny_mlp(batch_size: int = 2):
    """The fastest target to plan: two repeated blocks of one 8-wide layer."""
    model = _TwoBlocks()
    return model, (torch.randn(batch_size, 8),)


class _TwoBlocks(nn.Module):
    def __init__(self, n_blocks: int = 2, used: int | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(n_blocks)])
        self.used = n_blocks if used is None else used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in list(self.blocks)[: self.used]:
            x = torch.relu(block(x))
        return x


class _Argmax(nn.Module):
    """Returns class indices: nothing of its output can be backpropagated."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x.argmax(dim=-1)


class _FailsInBackward(torch.autograd.Function):
    """Traces and runs forward; its backward raises an error of several kilobytes on one line, as torch's
    metadata mismatches do."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("shapes differ: " + ", ".join(f"tensor {i}: (8, 8)" for i in range(400)) + " END-OF-MESSAGE")


class _LongError(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return _FailsInBackward.apply(x)


def long_error():
    return _LongError(), (torch.randn(2, 8),)


def integer_output():
    """A model whose output has no floating-point tensor: a training step has no loss to backpropagate."""
    return _Argmax(), (torch.randn(2, 8),)


class _ComplexLoss(nn.Module):
    """A complex-valued model (a filter on complex signals) whose .loss is complex: torch's backward wants a real scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8, dtype=torch.complex64) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> dict:
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return {"loss": x.sum(), "signal": x}


def complex_loss():
    """Issue 39: a complex input (and loss) gave torch's "grad can be implicitly created only for real scalar outputs"."""
    return _ComplexLoss(), (torch.randn(2, 8, dtype=torch.complex64),)


class _SparseEmbedding(nn.Module):
    """Token ids through an embedding with sparse gradients (for SGD or SparseAdam), then two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(32, 8, sparse=True)
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)
        for block in self.blocks:
            x = torch.relu(block(x))
        return x.sum()


def sparse_embedding():
    """Issue 39: nn.Embedding(sparse=True) failed with "Cannot access storage of SparseTensorImpl" and no hint."""
    return _SparseEmbedding(), (torch.randint(0, 32, (2, 4)),)


def unused_block():
    """Three repeated blocks, of which forward runs two: blocks.2 is defined but never called."""
    return _TwoBlocks(n_blocks=3, used=2), (torch.randn(2, 8),)


class _BranchingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:  # a branch on a tensor's value, inside a unit: fx traces past it (a leaf), fake tensors cannot
            return y
        return -y


class _BranchInBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_BranchingBlock(), _BranchingBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def branch_in_block():
    return _BranchInBlock(), (torch.randn(2, 8),)


def exits():
    """A factory that ends the process (a script's main() reused as a factory)."""
    sys.exit(0)


def eager_moe():
    """A mixture of experts whose routing decides shapes (tests/structures.py)."""
    from tests.structures import build_eager_moe

    return build_eager_moe()


class _Residual(nn.Module):
    def __init__(self, fn: nn.Module) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x) + x


def convmixer(batch_size: int = 4, dim: int = 16, depth: int = 8):
    """ConvMixer as its paper writes it: one flat nn.Sequential of a stem (conv, GELU, BatchNorm),
    `depth` identical residual blocks, and a pooling/flatten/linear head, all plain children."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, dim, kernel_size=2, stride=2), nn.GELU(), nn.BatchNorm2d(dim),
        *[nn.Sequential(
            _Residual(nn.Sequential(nn.Conv2d(dim, dim, 3, groups=dim, padding="same"), nn.GELU(), nn.BatchNorm2d(dim))),
            nn.Conv2d(dim, dim, kernel_size=1), nn.GELU(), nn.BatchNorm2d(dim)) for _ in range(depth)],
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(dim, 10))
    return model, (torch.randn(batch_size, 3, 16, 16),)


class _Slow(nn.Module):
    """A block whose forward takes a while in Python: planning runs it many times (trace, profile, simulate)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return torch.relu(self.fc(x))


def slow_mlp(batch_size: int = 2):
    """Seconds of planning; announces on stderr when the factory is called (planning starts)."""
    print("factory called", file=sys.__stderr__, flush=True)
    return nn.Sequential(_Slow(), _Slow(), _Slow()), (torch.randn(batch_size, 8),)


class _AttentionBlock(nn.Module):
    """nn.MultiheadAttention with attention dropout, an MLP, LayerNorms: a block people write by hand."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class _AttentionStack(nn.Module):
    def __init__(self, d: int, heads: int, n_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_AttentionBlock(d, heads) for _ in range(n_blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.mean()


def mha_dropout(batch_size: int = 4, seq_len: int = 32, d: int = 32, heads: int = 4):
    """Three blocks of nn.MultiheadAttention(dropout=0.1, batch_first=True) on a (batch, seq, d) input."""
    torch.manual_seed(0)
    return _AttentionStack(d, heads, 3), (torch.randn(batch_size, seq_len, d),)


def compiled_mlp(batch_size: int = 2):
    """A factory returning `torch.compile(model)`, as a training script does: an OptimizedModule, whose bool()
    asks the wrapped module for its len(). backend="eager": Dynamo captures the forward and runs it as written,
    no code generated (verify's real steps call it as a training script would; planning does not)."""
    return torch.compile(_TwoBlocks(), backend="eager"), (torch.randn(batch_size, 8),)
