"""A GPT-style decoder-only transformer in plain PyTorch (nanoGPT-like).

This is the reference workload for the memory planner: a realistic stack of
identical transformer blocks whose activations dominate training memory.
`build()` is the factory the CLI calls; it returns the model and example inputs.

The model is written to be traceable by `torch.fx.symbolic_trace`: no Python
control flow on tensor values, and the optional-loss branch lives in a leaf
function (see `_lm_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 512  # number of distinct tokens; sets wte/lm_head size
    block_size: int = 128  # maximum sequence length; sets wpe size and mask size
    n_layer: int = 4  # number of transformer blocks (the repeated unit)
    n_head: int = 4  # attention heads; must divide n_embd
    n_embd: int = 128  # residual stream width
    dropout: float = 0.0  # applied to embeddings, attention probs and residual branches
    bias: bool = True  # bias in Linear and LayerNorm layers
    attention: str = "sdpa"  # "sdpa" (fused kernel) or "eager" (materialises T x T probs)


@dataclass
class GPTOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None


@torch.fx.wrap
def _lm_loss(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
    # fx turns `targets` into a placeholder proxy, so `if targets is not None`
    # inside forward would always take the loss branch while tracing. Keeping
    # the branch in a wrapped leaf function makes the traced module work both
    # with and without targets.
    if targets is None:
        return None
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_head must divide n_embd"
        assert config.attention in ("sdpa", "eager"), f"unknown attention {config.attention!r}"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        # Plain Python numbers so fx never has to call math.sqrt on a proxy.
        self.head_dim = config.n_embd // config.n_head
        self.scale = self.head_dim**-0.5
        self.dropout = config.dropout
        self.attention = config.attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, nh, T, hd) so every head attends independently.
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)

        if self.attention == "sdpa":
            # self.training is a plain bool, so under fx the dropout probability
            # is baked into the graph for the mode the model was traced in.
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        else:
            # Deliberately materialise the (B, nh, T, T) probabilities: this is
            # the memory-hungry path the planner should see.
            # fx-friendly mask: a sliced buffer (real tensor, proxy index) and
            # torch.ones(T, T) (factory, no proxy dispatch) both fail to trace,
            # whereas new_ones on q becomes an ordinary call_method node.
            causal = q.new_ones(T, T, dtype=torch.bool).tril()
            att = (q @ k.transpose(-2, -1)) * self.scale
            att = att.masked_fill(~causal, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v

        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-norm: the residual stream itself is never normalised in place.
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one Parameter shared by input embedding and output
        # projection, so it must be counted (and planned) exactly once.
        self.lm_head.weight = self.transformer.wte.weight

        self.apply(self._init_weights)
        # GPT-2 scaling: keeps the residual stream variance from growing with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * config.n_layer) ** 0.5)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; tied weights count once. Optionally exclude wpe."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> GPTOutput:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        return GPTOutput(logits=logits, loss=_lm_loss(logits, targets))


def build(
    n_layer: int = 4,
    n_embd: int = 128,
    n_head: int = 4,
    block_size: int = 128,
    vocab_size: int = 512,
    batch_size: int = 4,
    seq_len: int = 128,
    dropout: float = 0.0,
    attention: str = "sdpa",
) -> tuple[GPT, tuple[torch.Tensor, ...]]:
    """Factory used by the CLI: a seeded model and its example inputs `(idx,)`."""
    assert seq_len <= block_size, "seq_len must not exceed block_size"
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=vocab_size,
        block_size=block_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        dropout=dropout,
        attention=attention,
    )
    model = GPT(config)
    idx = torch.randint(0, vocab_size, (batch_size, seq_len))
    return model, (idx,)
