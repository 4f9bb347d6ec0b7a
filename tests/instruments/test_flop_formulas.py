"""autoplan's FLOP formulas live in torch's flop registry only while autoplan measures
(`instruments.flop_formulas`): a user's own FlopCounterMode counts a step the same before and after
`autoplan.plan`, torch's global state is as planning found it, entries nest, a formula someone else
registered survives, and an interrupt inside still restores the registry.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.flop_counter as flop_counter
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import autoplan
from autoplan.inputs.devices import get_device
from autoplan.instruments.flop_formulas import autoplan_flop_formulas
from autoplan.instruments.tracker import LiveBytesTracker

CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # the kernel SDPA runs on this CPU


class _Attention(nn.Module):
    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(attended.transpose(1, 2).reshape(b, t, width))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Attention() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _users_count(model: nn.Module, x: torch.Tensor) -> dict:
    """What a user's own FlopCounterMode reads for one training step, op by op."""
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return dict(counter.get_flop_counts()["Global"])


def _torch_global_state() -> dict:
    """The process-wide torch state planning could change: the flop registry and its shape counters, the
    dispatcher's kernels of the ops a GPU target's simulation overrides, flags, default dtype, autocast's cache."""
    overridden = ("aten::scaled_dot_product_attention", "aten::dropout", "aten::layer_norm", "aten::softmax.int")
    return {
        "flop_registry": dict(flop_registry),
        "sdpa counters": (flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count),
        "dispatcher": {op: torch._C._dispatch_dump(op) for op in overridden},
        "default dtype": torch.get_default_dtype(),
        "autocast cache": torch.is_autocast_cache_enabled(),
        "grad": torch.is_grad_enabled(),
        "matmul precision": torch.get_float32_matmul_precision(),
        "tf32": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32),
        "sdp kernels": (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                        torch.backends.cuda.math_sdp_enabled()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("device", ["cpu", "h100-80gb"])
def test_a_users_flop_counter_counts_a_step_the_same_before_and_after_planning(device):
    """Before, planning left its attention formulas in torch's registry: the step below counted
    5,505,024 FLOPs before `autoplan.plan` and 12,845,056 after."""
    torch.manual_seed(0)
    model, x = _Stack(), torch.randn(2, 64, 32)
    before, state = _users_count(model, x), _torch_global_state()
    plan = autoplan.plan(model, "1GB", example_inputs=(x,), device=device, checkpoint={"blocks.*": "full"})
    assert _users_count(model, x) == before
    assert _torch_global_state() == state
    # while autoplan measured, the attention it recomputes was counted: its own figures still price it
    assert all(unit.recompute_flops > 2 * 2 * 64 * 32 * 3 * 32 for unit in plan.decisions.units if unit.choice.mode == "full")


def test_the_formulas_are_there_only_while_entered_and_entries_nest():
    q = k = v = torch.randn(1, 2, 16, 8)
    registry = dict(flop_registry)
    with autoplan_flop_formulas():
        with autoplan_flop_formulas():
            with FlopCounterMode(display=False) as counter:
                F.scaled_dot_product_attention(q, k, v)
        assert counter.get_flop_counts()["Global"][CPU_FLASH] == 4 * 2 * 16 * 16 * 8
        assert CPU_FLASH in flop_registry, "the inner exit leaves the outer entry's formulas"
    assert dict(flop_registry) == registry


def test_a_tracker_puts_the_registry_back_even_when_interrupted():
    registry = dict(flop_registry)
    with pytest.raises(KeyboardInterrupt), LiveBytesTracker(get_device("cpu")) as tracker:
        q = k = v = torch.randn(1, 2, 16, 8)
        F.scaled_dot_product_attention(q, k, v)
        assert tracker.phases()[-1].flops > 0
        raise KeyboardInterrupt
    assert dict(flop_registry) == registry


def test_a_formula_registered_by_someone_else_is_kept(monkeypatch):
    def theirs(*args, out_val=None, **kwargs) -> int:
        return 7

    monkeypatch.setitem(flop_registry, CPU_FLASH, theirs)
    with autoplan_flop_formulas():
        assert flop_registry[CPU_FLASH] is theirs
    assert flop_registry[CPU_FLASH] is theirs
