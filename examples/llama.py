"""A Llama-style decoder in plain PyTorch: RMSNorm, rotary attention with grouped KV heads, SwiGLU.

The workload for planning at scale and for the FSDP example: `LlamaConfig.preset("70b")` has the
shapes of Llama 3 70B (80 blocks of width 8192), and `build_on_meta` constructs it on the meta
device, so no weights are ever allocated. `build()` is the CLI's factory
(`autoplan plan examples/llama.py:build --budget 80GB --world-size auto`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 512  # tokens; sets the embedding and output head
    dim: int = 128  # residual stream width
    n_layers: int = 4  # repeated blocks (the units autoplan plans and FSDP shards)
    n_heads: int = 4  # query heads; must divide dim
    n_kv_heads: int = 2  # key/value heads (grouped-query attention); must divide n_heads
    ffn_dim: int = 384  # SwiGLU hidden width
    max_seq_len: int = 256  # longest sequence the rotary table covers
    tie_embeddings: bool = False  # output head shares the embedding matrix (Llama 3.2 1B does)

    @staticmethod
    def preset(name: str) -> "LlamaConfig":
        """Shapes of the published Llama 3 models (vocabulary 128256)."""
        presets = {
            "tiny": LlamaConfig(),
            "1b": LlamaConfig(128256, 2048, 16, 32, 8, 8192, 8192, tie_embeddings=True),
            "8b": LlamaConfig(128256, 4096, 32, 32, 8, 14336, 8192),
            "70b": LlamaConfig(128256, 8192, 80, 64, 8, 28672, 8192),
        }
        if name not in presets:
            raise ValueError(f"unknown Llama preset {name!r}; expected one of {sorted(presets)}")
        return presets[name]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(config.dim), Attention(config)
        self.ffn_norm, self.feed_forward = RMSNorm(config.dim), FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # the rotary table is derived, not learned: a non-persistent buffer, rebuilt on load
        self.register_buffer("rope", self._rope_table(config), persistent=False)

    @staticmethod
    def _rope_table(config: LlamaConfig) -> torch.Tensor:
        head_dim = config.dim // config.n_heads
        inverse = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(config.max_seq_len).float(), inverse)
        angles = torch.cat((angles, angles), dim=-1)
        return torch.stack((angles.cos(), angles.sin()))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy: the model returns its training loss."""
        table = self.rope.narrow(1, 0, tokens.shape[1])  # narrow, not a slice: torch.fx can trace it
        cos, sin = table[0], table[1]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def example_batch(config: LlamaConfig, batch_size: int, seq_len: int, device="cpu", seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=generator).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def build_on_meta(config: LlamaConfig, batch_size: int = 1, seq_len: int = 8192):
    """The model with no weights (meta device) and a batch to plan with: nothing is allocated."""
    if seq_len > config.max_seq_len:
        config = dataclasses.replace(config, max_seq_len=seq_len)
    with torch.device("meta"):
        model = Llama(config)
    return model, example_batch(config, batch_size, seq_len)


def build(preset: str = "tiny", batch_size: int = 4, seq_len: int = 64):
    """CLI factory: (model, example_inputs); tiny is built for real, the big presets on meta."""
    config = LlamaConfig.preset(preset)
    if preset != "tiny":
        return build_on_meta(config, batch_size, seq_len)
    torch.manual_seed(0)
    return Llama(config), example_batch(config, batch_size, seq_len)
