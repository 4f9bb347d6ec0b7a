"""Attention costs FLOPs in the roofline (instruments.attention_flops): the CPU flash kernel forward and
backward against the math, grouped-query attention included; no matmul-like op of any zoo model or
Hugging Face family is charged 0 FLOP in a simulated training step; and a plan that recomputes
attention says what it costs.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoplan
from autoplan.inputs.devices import get_device
from autoplan.inputs.hf_paths import real_mask_decisions
from autoplan.instruments.fake import fake_copy, fake_tree, new_fake_mode
from autoplan.instruments.target import as_the_target_runs
from autoplan.instruments.tracker import LiveBytesTracker, op_roofline
from autoplan.training.step_parts import default_loss
from tests.families import FAMILIES
from tests.models import ALL_MODELS

B, HQ, HKV, T, D = 2, 8, 2, 64, 16


class _OpLog(LiveBytesTracker):
    """The tracker, also noting every op it sees with the FLOPs it charges."""

    def __init__(self, device) -> None:
        super().__init__(device)
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        flops = op_roofline(self.device, func, args, kwargs or {}, out, []).flops
        self.ops.append((func.name().split("::")[-1].split(".")[0], flops))  # "aten::mm.default" -> "mm"
        return out


def _traced_step(model: nn.Module, args: tuple, kwargs: dict, device: str = "cpu") -> _OpLog:
    """A fake forward and backward of `model` under the tracker."""
    mode = new_fake_mode()
    fake = fake_copy(model, mode)
    log = _OpLog(get_device(device))
    with real_mask_decisions((args, kwargs)), mode, log:
        fake_args, fake_kwargs = fake_tree((args, kwargs), mode)
        default_loss(fake(*fake_args, **fake_kwargs)).backward()
    return log


def _attention_step(heads_kv: int, **sdpa) -> dict[str, int]:
    log = _OpLog(get_device("cpu"))
    with new_fake_mode(), log:
        q = torch.randn(B, HQ, T, D, requires_grad=True)
        k, v = (torch.randn(B, heads_kv, T, D, requires_grad=True) for _ in range(2))
        F.scaled_dot_product_attention(q, k, v, **sdpa).sum().backward()
    return {name: flops for name, flops in log.ops if "attention" in name}


@pytest.mark.parametrize("heads_kv", [HQ, HKV], ids=["mha", "gqa"])
def test_cpu_flash_attention_counts_qk_and_pv_forward_and_five_matmuls_backward(heads_kv):
    gqa = {"enable_gqa": True} if heads_kv != HQ else {}
    counted = _attention_step(heads_kv, is_causal=True, **gqa)
    forward = 2 * (2 * B * HQ * T * T * D)  # QK^T and PV, each query head against its (shared) key/value head
    assert counted == {
        "_scaled_dot_product_flash_attention_for_cpu": forward,
        # the scores again, then dP = dO·V^T, dV = P^T·dO, dQ = dS·K, dK = dS^T·Q
        "_scaled_dot_product_flash_attention_for_cpu_backward": forward * 5 // 2,
    }


_MATMUL_LIKE = re.compile(r"^(mm|addmm|bmm|baddbmm|matmul|linear|convolution|_convolution|convolution_backward|_grouped_mm|_scaled_mm|einsum)_?$"
                          r"|attention")


def _uncounted_matmuls(log: _OpLog) -> list[str]:
    return sorted({name for name, flops in log.ops if flops == 0 and _MATMUL_LIKE.search(name)})


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_no_zoo_matmul_is_charged_zero_flops(name):
    model, inputs = ALL_MODELS[name]()
    log = _traced_step(model, inputs, {})
    assert any(flops for _, flops in log.ops)
    assert _uncounted_matmuls(log) == []


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.name in ("GPT-2", "Llama", "BERT", "Whisper")], ids=lambda f: f.name)
def test_no_family_matmul_is_charged_zero_flops_as_a_gpu_runs_it(family):
    """The CUDA kernels a GPU target's simulation stands in for are priced too (torch's own formulas)."""
    pytest.importorskip("transformers")
    model = family.build()
    with as_the_target_runs(get_device("h100-80gb")) as target:
        log = _traced_step(model, (), family.inputs(model), device="h100-80gb")
    assert target.attention.kernels, "the card's attention kernels ran"
    assert any("_scaled_dot_product_" in op and "cpu" not in op for op, _ in log.ops)
    assert _uncounted_matmuls(log) == []


@pytest.mark.parametrize("family", FAMILIES, ids=[family.name for family in FAMILIES])
def test_no_family_matmul_is_charged_zero_flops(family):
    pytest.importorskip("transformers")
    model = family.build()
    log = _traced_step(model, (), family.inputs(model))
    assert any("attention" in op or "bmm" in op for op, _ in log.ops), "every family runs attention"
    assert _uncounted_matmuls(log) == []


class _Attention(nn.Module):
    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(attended.transpose(1, 2).reshape(b, t, width))


class _AttentionStack(nn.Module):
    def __init__(self, block: type[nn.Module] = _Attention) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.slow  # the whole pipeline
def test_a_plan_that_recomputes_attention_counts_its_flops():
    torch.manual_seed(0)
    batch, tokens, width, heads = 2, 256, 64, 4
    plan = autoplan.plan(_AttentionStack(), "1GB", example_inputs=(torch.randn(batch, tokens, width),), device="cpu",
                         precision="fp32", checkpoint={"blocks.*": "full"})
    attention = 4 * batch * heads * tokens * tokens * (width // heads)
    qkv = 2 * batch * tokens * width * 3 * width
    units = [unit for unit in plan.decisions.units if unit.choice.mode == "full"]
    assert [unit.name for unit in units] == ["blocks.0", "blocks.1"]
    # full recomputes the projection and attention; checkpoint's early stop spares the output projection
    assert [unit.recompute_flops for unit in units] == [qkv + attention] * 2
    assert "0 FLOP" not in plan.report().split("units")[1].split("step time")[0]
    # a checkpointed unit that reruns only elementwise ops still costs time: its row does not read as free
    elementwise_only = dataclasses.replace(plan, decisions=dataclasses.replace(
        plan.decisions, units=tuple(dataclasses.replace(u, recompute_flops=0) for u in plan.decisions.units)))
    assert elementwise_only.report().count("no FLOPs") >= 1


def test_flex_attention_is_counted_when_it_reaches_the_tracker():
    """FlexAttention is a higher-order operator: the tracker and the fake mode take it and charge its FLOPs.

    Eager flex_attention calls it through torch.compile, which refuses to run under a dispatch mode such as
    the tracker; torch's debug switch calls it directly, as compiled code does.
    """
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    log = _OpLog(get_device("cpu"))
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch.setattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
        with new_fake_mode(), log:
            q, k, v = (torch.randn(B, HQ, T, D) for _ in range(3))
            out = flex.flex_attention(q, k, v)
    assert out.shape == (B, HQ, T, D)
    assert ("flex_attention", 4 * B * HQ * T * T * D) in log.ops


class _FlexBlock(_Attention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        b, t, width = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        return x + self.out(flex_attention(q, k, v).transpose(1, 2).reshape(b, t, width))


@pytest.mark.slow  # the whole pipeline
def test_training_flex_attention_on_cpu_fakes_is_a_clean_error_naming_the_cause():
    """torch refuses FlexAttention's backward on a CPU, and the simulation's fake tensors are CPU tensors."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    with warnings.catch_warnings(), pytest.raises(autoplan.errors.ProfileError, match="FlexAttention does not support backward on CPU"):
        warnings.simplefilter("ignore")
        autoplan.plan(_AttentionStack(_FlexBlock), "1GB", example_inputs=(torch.randn(2, 64, 64),), device="h100-80gb")


def test_a_torch_whose_counter_rejects_grouped_query_shapes_counts_them_as_every_query_head(monkeypatch):
    """torch before 2.12 asserts key/value have the query's heads (seen on torch 2.11 on an H100: a transformers
    Llama with 8 key/value heads for 16 query heads failed to profile); the counter is given the query's heads."""
    import torch.utils.flop_counter as flop_counter
    from autoplan.instruments import attention_flops

    def strict(count):
        def checked(*shapes):
            *_, query, key, value = shapes
            assert query[1] == key[1] == value[1], "sdpa_flop_count: query/key/value shapes are incompatible"
            return count(*shapes)
        return checked

    whole = flop_counter.sdpa_flop_count((2, 8, 64, 16), (2, 8, 64, 16), (2, 8, 64, 16))
    whole_backward = flop_counter.sdpa_backward_flop_count((2, 8, 64, 16), (2, 8, 64, 16), (2, 8, 64, 16), (2, 8, 64, 16))
    monkeypatch.setattr(flop_counter, "sdpa_flop_count", strict(flop_counter.sdpa_flop_count))
    monkeypatch.setattr(flop_counter, "sdpa_backward_flop_count", strict(flop_counter.sdpa_backward_flop_count))
    attention_flops._count_grouped_query_attention()
    assert flop_counter.sdpa_flop_count((2, 8, 64, 16), (2, 2, 64, 16), (2, 2, 64, 16)) == whole
    assert flop_counter.sdpa_backward_flop_count((2, 8, 64, 16), (2, 8, 64, 16), (2, 2, 64, 16), (2, 2, 64, 16)) == whole_backward
