"""Attention as the target GPU runs it: the kernel CUDA would pick, its saved bytes and FLOPs, in a plan."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import autoplan
from typer.testing import CliRunner

from autoplan.cli.app import app
from autoplan.cli.exits import ExitCode
from autoplan.instruments.attention import AttentionKernel, TargetAttention, choose_kernel
from autoplan.profile.profiler import profile
from autoplan.trace.tracer import trace
from examples.gpt import build as build_gpt
from tests.cli_factories import mha_dropout
from tests.models import make_tiny_gpt_dropout

H100, RTX_4090, T4 = (9, 0), (8, 9), (7, 5)


def _qkv(dtype=torch.bfloat16, head_dim=64, kv_heads=4, q_len=128, k_len=128, grad=True):
    with FakeTensorMode():
        q = torch.empty(2, 4, q_len, head_dim, dtype=dtype, requires_grad=grad)
        k = torch.empty(2, kv_heads, k_len, head_dim, dtype=dtype, requires_grad=grad)
        return q, k, k.detach().clone().requires_grad_(grad)


@pytest.mark.parametrize(
    ("capability", "dtype", "head_dim", "masked", "expected"),
    [
        (H100, torch.bfloat16, 64, False, AttentionKernel.FLASH),
        (H100, torch.float32, 64, False, AttentionKernel.EFFICIENT),  # flash is fp16/bf16 only
        (H100, torch.bfloat16, 64, True, AttentionKernel.EFFICIENT),  # flash takes no mask
        (H100, torch.bfloat16, 256, False, AttentionKernel.FLASH),
        (RTX_4090, torch.bfloat16, 256, False, AttentionKernel.EFFICIENT),  # consumer cards: no flash backward over 192
        (T4, torch.float16, 64, False, AttentionKernel.EFFICIENT),  # no flash before sm80
        (T4, torch.bfloat16, 64, False, AttentionKernel.MATH),  # no bf16 kernel before sm80
        (H100, torch.bfloat16, 6, True, AttentionKernel.MATH),  # efficient needs 8-aligned half head dims
    ],
)
def test_the_kernel_is_the_cards_choice(capability, dtype, head_dim, masked, expected) -> None:
    q, k, v = _qkv(dtype, head_dim)
    mask = torch.ones(128, 128, dtype=torch.bool) if masked else None
    assert choose_kernel(capability, q, k, v, mask, is_causal=not masked) is expected


def test_disabled_backends_are_respected() -> None:
    q, k, v = _qkv()
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        assert choose_kernel(H100, q, k, v, None, True) is AttentionKernel.MATH


@pytest.mark.parametrize(("capability", "saved_tt"), [(H100, False), (T4, True)])
def test_fused_kernels_save_no_attention_matrix_even_with_dropout(capability, saved_tt) -> None:
    """CUDA's fused kernels keep the output and a log-sum-exp row, not T×T probabilities or a dropout mask."""
    q, k, v = _qkv(torch.bfloat16, kv_heads=4, q_len=256, k_len=256)
    shapes = []
    with FakeTensorMode(allow_non_fake_inputs=True), TargetAttention(capability):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        out.sum().backward()
    assert out.shape == q.shape and q.grad is not None and q.grad.shape == q.shape
    assert any(shape[-2:] == (256, 256) for shape in shapes) is saved_tt


def _attention_flops(batch: int, heads: int, length: int, head_dim: int) -> int:
    return 4 * batch * heads * length * length * head_dim  # Q·Kᵀ and P·V, 2 FLOPs a multiply-add


@pytest.mark.slow  # the whole pipeline
def test_gpu_plan_of_gpt2_with_dropout_counts_what_cuda_keeps() -> None:
    """GPT-2-style attention dropout sends the CPU to the math path (T×T kept); a GPU plan counts the fused kernel."""
    batch, heads, length = 2, 2, 256
    model, inputs = build_gpt(n_layer=2, n_embd=64, n_head=heads, block_size=length, vocab_size=64, batch_size=batch,
                              seq_len=length, dropout=0.1)
    cpu = autoplan.plan(model, "1GB", example_inputs=inputs, device="cpu")
    gpu = autoplan.plan(model, "1GB", example_inputs=inputs, device="h100-80gb", precision="fp32")
    assert not any("compute capability" in note for note in cpu.notes)
    assert any("compute capability 9.0" in note and "memory-efficient" in note for note in gpu.notes)
    # the same blocks kept in fp32 on both: the card keeps no T×T probabilities (nor dropout's mask and output)
    assert [unit.choice for unit in cpu.units] == [unit.choice for unit in gpu.units] == [autoplan.Choice("keep", "fp32")] * 2
    probabilities = batch * heads * length * length * 4
    assert all(c.saved_bytes - g.saved_bytes >= probabilities for c, g in zip(cpu.units, gpu.units))


@pytest.mark.slow  # the whole pipeline
def test_attention_is_priced_in_a_gpu_profile_and_recompute_is_not_free() -> None:
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
    model = nn.Sequential(layer, nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True))
    x = torch.randn(2, 256, 64)
    traced = trace(model, (x,))
    measured = profile(traced, autoplan.get_device("h100-80gb"), precisions=("bf16",), rest_precision="fp32")
    unit = measured.units[0]
    keep, full = unit.options[autoplan.Choice("keep", "bf16")], unit.options[autoplan.Choice("full", "bf16")]
    assert keep.attention_bytes == 0  # nn.MultiheadAttention with dropout: the fused kernel on the card
    assert keep.fwd_flops >= _attention_flops(2, 4, 256, 16)
    assert full.bwd_flops - keep.bwd_flops >= _attention_flops(2, 4, 256, 16)  # recomputing attention costs its FLOPs
    assert "compute capability 9.0" in measured.timeline.target_kernels


@pytest.mark.slow  # the whole pipeline
def test_checkpointed_units_recompute_attention_as_the_card_runs_it() -> None:
    """The checkpoint's recomputation in backward runs the same kernel as the forward (else torch refuses the replay)."""
    model, inputs = make_tiny_gpt_dropout()
    every_block = {name: "full" for name in ("transformer.h.0", "transformer.h.1")}
    plan = autoplan.plan(model, "1GB", example_inputs=inputs, device="h100-80gb", checkpoint=every_block)
    assert {decision.choice.mode for decision in plan.decisions.units} == {"full"}
    assert plan.prediction.peak_bytes > 0


def _autocast_dtypes() -> dict[str, torch.dtype]:
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = x.bfloat16()
        dtypes = {"layer_norm": F.layer_norm(low, (8,)).dtype, "softmax": torch.softmax(low, -1).dtype,
                  "log_softmax": F.log_softmax(low, -1).dtype, "rsqrt": low.rsqrt().dtype, "sum": low.sum().dtype,
                  "mm": (x @ x.t()).dtype, "gelu": F.gelu(low).dtype}
        F.layer_norm(x, (8,)).sum().backward()  # autograd through the stood-in kernels
    assert x.grad is not None
    return dtypes


def test_cuda_autocast_rules_while_entered_and_the_cpus_after() -> None:
    """CUDA autocast runs norms, softmax and reductions in fp32; the CPU's in bf16. Matmuls are bf16 on both."""
    from autoplan.instruments.cuda_autocast import CudaAutocastRules

    cpu_rules = _autocast_dtypes()
    with CudaAutocastRules():
        cuda_rules = _autocast_dtypes()
    assert cuda_rules == {"layer_norm": torch.float32, "softmax": torch.float32, "log_softmax": torch.float32,
                          "rsqrt": torch.float32, "sum": torch.float32, "mm": torch.bfloat16, "gelu": torch.bfloat16}
    assert set(cpu_rules.values()) == {torch.bfloat16}
    assert _autocast_dtypes() == cpu_rules  # removed on exit


def test_sdpa_is_the_cpus_again_after_a_gpu_simulation() -> None:
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with FakeTensorMode(allow_non_fake_inputs=True), TargetAttention(H100) as attention:
        F.scaled_dot_product_attention(*_qkv(torch.float32), is_causal=True)
    assert list(attention.kernels) == [AttentionKernel.EFFICIENT]
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True), expected)


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("device", ["cpu", "h100-80gb"])
def test_multihead_attention_with_dropout_checkpointed_trains_like_the_original(device: str) -> None:
    """Issue 27 item 1: blocks of nn.MultiheadAttention(dropout=0.1) checkpointed in fp32 plan (no
    CheckpointError on recompute) and train like the original: same loss and gradients, the same
    dropout masks drawn again on recompute."""
    model, inputs = mha_dropout()
    every_block = {f"blocks.{i}": "full" for i in range(3)}
    plan = autoplan.plan(model, "1GB", example_inputs=inputs, device=device, precision="fp32", checkpoint=every_block)
    assert {unit.choice for unit in plan.decisions.units} == {autoplan.Choice("full", "fp32")}
    planned = autoplan.apply(copy.deepcopy(model), plan)
    losses = []
    for net in (model, planned):
        torch.manual_seed(1)
        loss = net(*inputs)
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[1], losses[0])
    for (name, a), b in zip(model.named_parameters(), planned.parameters()):
        assert torch.equal(b.grad, a.grad), name


@pytest.mark.slow  # the whole pipeline
def test_multihead_attention_with_dropout_plans_from_the_command_line() -> None:
    model, inputs = mha_dropout()
    lowest = autoplan.plan(model, "1GB", example_inputs=inputs, device="h100", reserve=0).prediction.minimum_budget_bytes
    # the floor budget: every block recomputes something, attention with its dropout included
    result = CliRunner().invoke(app, ["plan", "tests/cli_factories.py:mha_dropout", "--budget", f"{lowest}B",
                                      "--device", "h100", "--reserve", "0"])
    assert result.exit_code == ExitCode.FITS, result.output
