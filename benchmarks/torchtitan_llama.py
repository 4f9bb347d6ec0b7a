"""torchtitan's Llama as its published memory runs ran it, rebuilt here from the run's description (no download).

torchtitan publishes peak memory for its own plain-PyTorch Llama, not a transformers model, so the runs are
planned on that architecture: token embedding, blocks of RMSNorm (computed in fp32, cast back) + attention
(separate wq/wk/wv/wo, complex rotary embedding from a precomputed `freqs_cis` buffer, grouped KV heads
repeated, `F.scaled_dot_product_attention(is_causal=True)`) + RMSNorm + SwiGLU (w1, w3, w2), a final RMSNorm
and an untied output Linear. Two snapshots differ where memory can tell:

- `"2024-03"`: torchtrain at its PR 165 (FSDP2 landed, March 2024): the rotary buffer is `2 × max_seq_len`
  (32768) rows and lives in an `embeddings` module with the token embedding, the blocks run on
  `(batch × seq, dim)` rows, the model returns `output(h).float()` and the loop keeps it (`pred`) through
  backward.
- `"2024-12"`: torchtitan at 9dec370 (December 2024, its performance page's versions table): the rotary
  buffer is `seq_len` rows, the blocks run on `(batch, seq, dim)`, the model returns the Linear's output and
  the loop computes `cross_entropy(pred.flatten(0, 1).float(), labels)`, deleting `pred` before backward.

`build(shape, snapshot, batch, seq)` returns the model on the meta device, a batch, the run's loss and whether its
loop keeps the output; tests/torchtitan_worker.py builds a small one for real and shards it as torchtitan does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim_multiplier: float | None
    multiple_of: int
    max_seq_len: int

    @property
    def hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# torchtrain's "7B" flavour with the Llama 2 tokenizer (32,000 words), and torchtitan's Llama 3 "8B" (128,256)
LLAMA2_7B = LlamaShape(4096, 32, 32, 32, 32000, None, 256, 32768)
LLAMA3_8B = LlamaShape(4096, 32, 32, 8, 128256, 1.3, 1024, 8192)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary_table(head_dim: int, rows: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(rows), freqs).float()
    return torch.polar(torch.ones_like(angles), angles)  # complex64


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    table = table[: x.shape[1]].view(1, x.shape[1], 1, pairs.shape[-1])
    return torch.view_as_real(pairs * table).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = shape.n_heads, shape.n_kv_heads, shape.dim // shape.n_heads
        self.wq = nn.Linear(shape.dim, shape.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(shape.dim, shape.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(shape.dim, shape.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(shape.n_heads * self.head_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = rotate(q, table), rotate(k, table)
        repeats = self.n_heads // self.n_kv_heads
        if repeats > 1:  # torchtitan's repeat_kv: unsqueeze, expand, reshape
            k = k.unsqueeze(3).expand(batch, seq, self.n_kv_heads, repeats, self.head_dim).reshape(batch, seq, -1, self.head_dim)
            v = v.unsqueeze(3).expand(batch, seq, self.n_kv_heads, repeats, self.head_dim).reshape(batch, seq, -1, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(*x.shape[:-1], -1))


class FeedForward(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.w1 = nn.Linear(shape.dim, shape.hidden_dim, bias=False)
        self.w2 = nn.Linear(shape.hidden_dim, shape.dim, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.attention, self.feed_forward = Attention(shape), FeedForward(shape)
        self.attention_norm, self.ffn_norm = RMSNorm(shape.dim), RMSNorm(shape.dim)

    def forward(self, x: torch.Tensor, table: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table, batch, seq)
        return h + self.feed_forward(self.ffn_norm(h))


class Embeddings(nn.Module):
    """torchtrain's March-2024 `RotaryEmbedding`: the token embedding and the rotary buffer in one module."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.dim)
        self.register_buffer("freqs_cis", rotary_table(shape.dim // shape.n_heads, 2 * shape.max_seq_len), persistent=False)


class Transformer(nn.Module):
    def __init__(self, shape: LlamaShape, snapshot: str):
        super().__init__()
        self.shape, self.flat_rows = shape, snapshot == "2024-03"
        if self.flat_rows:
            self.embeddings = Embeddings(shape)
        else:
            self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.dim)
            self.register_buffer("freqs_cis", rotary_table(shape.dim // shape.n_heads, shape.max_seq_len, 500000.0))
        self.layers = nn.ModuleList(TransformerBlock(shape) for _ in range(shape.n_layers))
        self.norm = RMSNorm(shape.dim)
        self.output = nn.Linear(shape.dim, shape.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, seq = tokens.shape
        if self.flat_rows:
            h, table = self.embeddings.tok_embeddings(tokens).view(-1, self.shape.dim), self.embeddings.freqs_cis
        else:
            h, table = self.tok_embeddings(tokens), self.freqs_cis
        for layer in self.layers:
            h = layer(h, table, batch, seq)
        h = self.norm(h)
        if self.flat_rows:
            return self.output(h.view(batch, seq, self.shape.dim)).float()
        return self.output(h)


def loss_for(snapshot: str, labels: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The snapshot's loss of the model's output against `labels` (2024-12 casts the logits to fp32 there)."""
    if snapshot == "2024-03":
        return lambda pred: F.cross_entropy(pred.flatten(0, 1), labels.to(pred.device).flatten(0, 1))
    return lambda pred: F.cross_entropy(pred.flatten(0, 1).float(), labels.to(pred.device).flatten(0, 1))


def keeps_output(snapshot: str) -> bool:
    """Whether the snapshot's loop holds the model's output through backward (2024-03's `pred`; 2024-12 deletes it)."""
    return snapshot == "2024-03"


def build(shape: LlamaShape, snapshot: str, batch: int, seq: int) -> tuple[nn.Module, torch.Tensor, Callable, bool]:
    """The model on the meta device, one batch of token ids, the run's loss (`output -> scalar`), and whether its
    loop keeps the output through backward."""
    if snapshot not in ("2024-03", "2024-12"):
        raise ValueError(f"snapshot is '2024-03' or '2024-12', not {snapshot!r}")
    with torch.device("meta"):
        model = Transformer(shape, snapshot).train()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab_size, (batch, seq), generator=generator)
    labels = torch.randint(0, shape.vocab_size, (batch, seq), generator=generator)
    return model, tokens, loss_for(snapshot, labels), keeps_output(snapshot)
