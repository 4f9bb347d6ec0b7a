"""The two loops written by hand of `tests/framework_loops/`: under accelerate's `Accelerator`, and nanoGPT's.

`accelerate` is the loop of accelerate's gradient-accumulation guide on a GPT-2; `nanogpt` is nanoGPT's
train.py loop on its own GPT (model.py, small), which this module also holds.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.framework_loops import (
    ACCUMULATION,
    BATCH,
    LEARNING_RATE,
    SEQ,
    STEPS,
    VOCAB,
    WIDTH,
    Case,
    Marker,
    seeded,
    stack_rows,
    token_rows,
)

# -- accelerate -----------------------------------------------------------------------------------------------


def accelerate_case() -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=2, n_head=4)
    model = seeded(lambda: GPT2LMHeadModel(config))
    rows = token_rows(STEPS * ACCUMULATION * BATCH, seed=1)
    loop_fields = dict(
        keep_outputs=True,  # `outputs = model(**batch)`: alive through backward and the step
        accumulation_steps=ACCUMULATION,
        loss_in_model=True,
        batches_ahead=1,  # the prepared DataLoaderShard holds the next batch while yielding this one
    )
    return Case("accelerate", model, stack_rows(rows[:BATCH]), loop_fields,
                lambda m, steps, counter: run_accelerate(m, steps, counter, rows))


def fresh_accelerator(**options: Any):
    """An Accelerator with these options: accelerate's process-wide state forgets the one made before it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True, **options)


def run_accelerate(model: nn.Module, steps: int, counter: Marker, rows: list) -> list[float]:
    """The loop of accelerate's gradient-accumulation guide: accumulate, backward, clip, step, schedule, zero."""
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(0)
    accelerator = fresh_accelerator(gradient_accumulation_steps=ACCUMULATION)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=steps)
    loader = DataLoader(rows, batch_size=BATCH, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    losses, micro_losses = [], []
    for index, batch in enumerate(loader):
        if index == steps * ACCUMULATION:
            break
        if index % ACCUMULATION == 0:
            counter.mark(f"step {index // ACCUMULATION + 1}")
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        micro_losses.append(loss.item())
        if accelerator.sync_gradients:
            losses.append(sum(micro_losses) / len(micro_losses))
            micro_losses = []
    counter.mark("end")
    accelerator.free_memory()
    return losses


# -- nanoGPT ----------------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # nanoGPT's flash path
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, time, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model.py, small: tied embedding and head; `(logits, loss)` with targets, the last logits without."""

    def __init__(self, vocab: int = VOCAB, block_size: int = SEQ, width: int = WIDTH, layers: int = 2, heads: int = 4):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block_size, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        positions = torch.arange(idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def configure_optimizers(self, weight_decay: float, learning_rate: float) -> torch.optim.Optimizer:
        """nanoGPT's: 2-D tensors decay, the rest do not; fused only on CUDA."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


def nanogpt_case() -> Case:
    model = seeded(GPT)
    data = torch.randint(0, VOCAB, (20_000,), generator=torch.Generator().manual_seed(2))  # train.bin, on the host
    example = tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3)) for _ in "xy")
    loop_fields = dict(
        keep_outputs=True,  # `logits, loss = model(X, Y)`: the logits live until the next forward returns
        accumulation_steps=ACCUMULATION,
        loss_in_model=False,  # a tuple: the loss is loss_fn's
        grad_scaler=False,  # GradScaler(enabled=False) (float32): it makes no tensors
        batches_ahead=1,  # `X, Y = get_batch()` right after the forward: the next batch beside the current one
    )
    return Case("nanogpt", model, example, loop_fields, lambda m, steps, counter: run_nanogpt(m, steps, counter, data),
                loss_fn=lambda output: output[1])


def run_nanogpt(model: nn.Module, steps: int, counter: Marker, data: torch.Tensor) -> list[float]:
    """train.py's loop: accumulate, prefetch after the forward, scaler, clip, step, zero_grad(set_to_none=True)."""
    generator = torch.Generator().manual_seed(0)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - SEQ - 1, (BATCH,), generator=generator)
        x = torch.stack([data[i:i + SEQ] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + SEQ] for i in ix])
        return x, y

    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=LEARNING_RATE)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # enabled only for float16
    model.train()
    losses = []
    X, Y = get_batch()  # the very first batch
    for step in range(steps):
        counter.mark(f"step {step + 1}")
        for _ in range(ACCUMULATION):
            logits, loss = model(X, Y)
            loss = loss / ACCUMULATION
            X, Y = get_batch()  # immediately, while the model's forward would run on the GPU
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * ACCUMULATION)  # train.py logs the last micro-step's loss
    counter.mark("end")
    return losses
