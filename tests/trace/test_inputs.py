"""Inputs and outputs of any shape: keyword-only forwards, several and integer inputs, attention
masks, dict / tuple / dataclass outputs, Python control flow on shapes and config flags.

Each model plans at a budget between its lowest reachable peak and no plan, and the rewritten
model (every unit fp32, some recomputed) trains one AdamW step exactly like the original.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoplan
from tests.halfway import halfway_plan

VOCAB, WIDTH = 40, 32


class MaskedBlock(nn.Module):
    """Attention over the sequence with a padding mask, then an MLP; the mask is a keyword."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        bias = None if mask is None else (1.0 - mask[:, None, :].to(x.dtype)) * -1e4
        x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return x + self.mlp(x)


class KeywordOnlyDictOut(nn.Module):
    """forward(*, tokens, mask, segment): integer inputs, a mask, a dict out with the model's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.segment = nn.Embedding(2, WIDTH)
        self.blocks = nn.ModuleList([MaskedBlock() for _ in range(4)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, *, tokens: torch.Tensor, mask: torch.Tensor, segment: torch.Tensor) -> dict:
        x = self.embed(tokens) + self.segment(segment)
        if tokens.shape[1] > 8:  # control flow on a shape
            x = x * 0.5
        for block in self.blocks:
            x = block(x, mask=mask)
        logits = self.head(x)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), tokens.flatten())}


@dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


class ConfigFlagsDataclassOut(nn.Module):
    """Python branches on config flags; a dataclass out (not a registered pytree)."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([MaskedBlock() for _ in range(config.layers)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        x = self.embed(tokens)
        outputs = []
        for i, block in enumerate(self.blocks):
            if self.config.long_skip and i == len(self.blocks) - 1:
                x = x + outputs[0]  # the first block's output skips to the last block
            x = block(x)
            outputs.append(x)
        logits = self.head(x)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return Output(loss, logits)


class SeveralInputsTupleOut(nn.Module):
    """Two float inputs, a tuple out; no loss of its own (the default sums the float outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(2 * WIDTH, WIDTH)
        self.blocks = nn.ModuleList([MaskedBlock() for _ in range(4)])

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.mix(torch.cat([a, b], dim=-1))
        for block in self.blocks:
            x = block(x)
        return x.mean(dim=1), x


def _tokens(*shape: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(0))


def _keyword_only():
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:, 12:] = 0
    inputs = {"tokens": _tokens(4, 16), "mask": mask, "segment": torch.zeros(4, 16, dtype=torch.long)}
    return KeywordOnlyDictOut(), inputs, lambda out: out["loss"]


def _config_flags():
    model = ConfigFlagsDataclassOut(SimpleNamespace(layers=4, long_skip=True))
    tokens = _tokens(4, 16)
    return model, ((tokens,), {"labels": tokens}), lambda out: out.loss


def _several_inputs():
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 16, WIDTH, generator=generator), torch.randn(4, 16, WIDTH, generator=generator)
    return SeveralInputsTupleOut(), (a, b), lambda out: out[0].sum() + out[1].sum()


CASES: dict[str, Callable] = {
    "keyword-only, int inputs, mask, dict out": _keyword_only,
    "config flags, long skip, dataclass out": _config_flags,
    "several inputs, tuple out": _several_inputs,
}


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if len(inputs) == 2 and isinstance(inputs[1], dict):
        return model(*inputs[0], **inputs[1])
    return model(*inputs)


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("case", list(CASES))
def test_plans_and_trains_like_the_original(case: str) -> None:
    torch.manual_seed(0)
    model, inputs, loss_of = CASES[case]()
    plan = halfway_plan(model, "100%", example_inputs=inputs, device="cpu", precision="fp32", reserve=0)
    assert plan.outcome.feasible and plan.prediction.simulated_peak_bytes <= plan.request.usable_bytes
    assert any(u.choice.mode != "keep" for u in plan.decisions.units)
    assert abs(plan.prediction.peak_bytes - plan.prediction.simulated_peak_bytes) <= 0.05 * plan.prediction.simulated_peak_bytes

    rewritten = autoplan.apply(copy.deepcopy(model), plan)
    results = []
    for m in (model, rewritten):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        loss = loss_of(_call(m, inputs))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        optimizer.step()
        results.append((loss.detach(), grads, {n: p.detach().clone() for n, p in m.named_parameters()}))
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.slow  # the whole pipeline
def test_a_long_skip_from_the_config_flag_shows_in_the_unit_graph() -> None:
    tokens = _tokens(2, 8)
    with_skip = autoplan.plan(ConfigFlagsDataclassOut(SimpleNamespace(layers=3, long_skip=True)), "1GB", example_inputs=(tokens,), device="cpu")
    without = autoplan.plan(ConfigFlagsDataclassOut(SimpleNamespace(layers=3, long_skip=False)), "1GB", example_inputs=(tokens,), device="cpu")
    assert any("skip connection" in note for note in with_skip.notes)
    assert not any("skip connection" in note for note in without.notes)
