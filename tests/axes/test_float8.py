"""float8 as a precision of a unit (axes/precisions/float8.py): while the unit runs, its linears are torchao's
Float8Linear on the same parameters, the rest of it under bf16 autocast; priced at the card's float8 rate."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.axes.precision import check_setting, choices_for, flops_for, kind, rest_precision
from autoplan.axes.precisions.float8 import float8_linears
from autoplan.errors import OptionError
from autoplan.inputs.devices import get_device

torchao_float8 = pytest.importorskip("torchao.float8")
logging.getLogger("torchao").setLevel(logging.ERROR)  # its CUDA kernels do not load on a CPU-only torch: said at import


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64, bias=False)
        self.odd = torch.nn.Linear(64, 10)  # 10 outputs: not a float8 matmul's shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x)))) + self.odd(x).sum(-1, keepdim=True)


class _ScaledMatmuls(TorchDispatchMode):
    """Counts the matmuls on torchao's float8 tensors (each a `_scaled_mm` inside the tensor's own dispatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.mm.default and all(
            isinstance(arg, torchao_float8.float8_training_tensor.Float8TrainingTensor) for arg in args)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["float8", "float8-rowwise"])
def test_a_float8_unit_runs_its_eligible_linears_in_float8_and_is_itself_again_after(name):
    block = _Block()
    assert float8_linears(block) == [block.up, block.down]
    x, dtypes = torch.randn(4, 8, 64), {}
    for linear in (block.up, block.odd):
        linear.register_forward_hook(lambda module, args, out: dtypes.update({module.out_features: out.dtype}))
    with _ScaledMatmuls() as matmuls, kind(name).running(block, "cpu"):
        block(x).sum().backward()
    assert matmuls.count == 2 * 3  # two linears: the forward's product and the backward's two
    assert dtypes == {128: torch.bfloat16, 10: torch.bfloat16}  # float8 out in bf16; the rest under bf16 autocast
    assert "forward" not in block.up.__dict__ and "forward" not in block.down.__dict__
    with _ScaledMatmuls() as matmuls:
        assert block(x).dtype == torch.float32
    assert matmuls.count == 0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_float8_unit_computes_as_torchao_s_float8_linears_under_bf16_autocast(recipe):
    """The reference: torchao's convert_to_float8_training of the same block, its float8 linears fed bf16 as
    torchao does under a GPU's autocast; outputs and every gradient equal."""
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(4, 8, 64)
    config = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    reference = torchao_float8.convert_to_float8_training(copy.deepcopy(block), config=config,
                                                          module_filter_fn=lambda module, fqn: fqn in ("up", "down"))
    for linear in (reference.up, reference.down):
        linear.register_forward_pre_hook(lambda module, args: (args[0].to(torch.bfloat16),))
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        expected = reference(x)
    expected.float().square().mean().backward()
    with kind("float8" if recipe == "tensorwise" else "float8-rowwise").running(block, "cpu"):
        out = block(x)
    out.float().square().mean().backward()
    assert torch.equal(out, expected)
    for (name, got), want in zip(block.named_parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad), name


def test_float8_is_priced_at_the_card_s_float8_rate_and_run_where_the_card_has_it():
    h100, a100, cpu = get_device("h100-80gb"), get_device("a100-80gb"), get_device("cpu")
    assert flops_for(h100, torch.float8_e4m3fn) == flops_for(h100, torch.float8_e5m2) == h100.peak_flops["float8"] == 1978.9e12
    assert flops_for(cpu, torch.float8_e4m3fn) == cpu.peak_flops["fp32"]  # the CPU upcasts inside its matmul
    assert choices_for("auto-float8", h100) == ("fp32", "bf16", "float8")
    assert choices_for("float8", cpu) == ("float8",)
    assert rest_precision("float8") == rest_precision("auto-float8") == "fp32" and rest_precision("bf16") == "bf16"
    with pytest.raises(OptionError, match=r"precision 'float8' \(--precision float8\): a100-80gb has no float8 tensor cores"):
        check_setting("float8", a100)
    with pytest.raises(OptionError, match="a100-80gb has no float8 tensor cores"):
        check_setting("auto-float8", a100)
    assert get_device("custom:memory=24GiB,fp32_tflops=80,bf16_tflops=160,float8_tflops=320,bandwidth=1TB/s").peak_flops[
        "float8"] == 320e12
