"""Every op with matmul work is priced: attention kernels' FLOPs, on the zoo and the transformers families."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import autoplan
from autoplan.instruments.attention import TargetAttention
from autoplan.instruments.tracker import LiveBytesTracker, op_roofline
from autoplan.vocabulary.tensors import tensors_of
from tests import families
from tests.models import ALL_MODELS

# ops that multiply matrices: priced at 0 FLOP, they would make recomputing them look free
_MATMUL_LIKE = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward", "_grouped_mm", "attention")


def _is_matmul_like(func) -> bool:
    name = func.overloadpacket.__name__
    return name in _MATMUL_LIKE or "attention" in name


class _PricedOps(TorchDispatchMode):
    """Every matmul-like op run under it, with the FLOPs the roofline charges it."""

    def __init__(self, device) -> None:
        super().__init__()
        LiveBytesTracker(device)  # registers the FLOP formulas the tracker adds to torch's
        self.device, self.priced = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_matmul_like(func) and all(t.numel() for t in tensors_of(out)):
            touched = tensors_of((args, kwargs)) + tensors_of(out)
            self.priced.append((str(func), op_roofline(self.device, func, args, kwargs, out, touched).flops))
        return out


def _unpriced(model: torch.nn.Module, args, kwargs, device="cpu") -> tuple[list, list]:
    model.train()
    with _PricedOps(autoplan.get_device(device)) as ops:
        output = model(*args, **kwargs)
        loss = output.loss if hasattr(output, "loss") and output.loss is not None else (
            output.logits if hasattr(output, "logits") else output).float().pow(2).mean()
        loss.backward()
    return [name for name, flops in ops.priced if flops == 0], ops.priced


def test_cpu_flash_attention_is_priced_as_torch_prices_the_cuda_kernels() -> None:
    batch, heads, kv_heads, length, head_dim = 2, 8, 2, 64, 16
    q = torch.randn(batch, heads, length, head_dim, requires_grad=True)
    k = torch.randn(batch, kv_heads, length, head_dim, requires_grad=True)
    v = torch.randn(batch, kv_heads, length, head_dim, requires_grad=True)
    with _PricedOps(autoplan.get_device("cpu")) as ops:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    priced = dict(ops.priced)
    forward = 4 * batch * heads * length * length * head_dim  # Q·Kᵀ and P·V, 2 FLOPs a multiply-add
    assert priced["aten._scaled_dot_product_flash_attention_for_cpu.default"] == forward
    assert priced["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"] == forward * 5 // 2


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_no_matmul_of_the_zoo_costs_nothing(name: str) -> None:
    model, inputs = ALL_MODELS[name]()
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    unpriced, priced = _unpriced(model, args, kwargs)
    assert priced and not unpriced


@pytest.mark.parametrize("name", [family.name for family in families.FAMILIES])
def test_no_matmul_of_the_transformers_families_costs_nothing(name: str) -> None:
    pytest.importorskip("transformers")
    family = families.BY_NAME[name]
    model = family.build()
    unpriced, priced = _unpriced(model, (), family.inputs(model))
    assert any("attention" in op or "bmm" in op for op, _ in priced)  # attention ran, by a kernel or by matmuls
    assert not unpriced


def test_no_matmul_costs_nothing_as_a_gpu_runs_it() -> None:
    """The CUDA kernels a GPU target stands in for are priced too (torch's own formulas)."""
    pytest.importorskip("transformers")
    family = families.BY_NAME["Llama"]
    model = family.build()
    inputs = family.inputs(model)
    with FakeTensorMode(allow_non_fake_inputs=True), TargetAttention((9, 0)) as attention:  # no CUDA kernel runs on real CPU tensors
        unpriced, priced = _unpriced(model, (), inputs, device="h100-80gb")
    assert attention.kernels and not unpriced
    assert any("efficient_attention" in op or "flash_attention." in op for op, _ in priced)
