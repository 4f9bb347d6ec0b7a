"""instruments.rnn: a fake oneDNN LSTM layer keeps the workspace the real one keeps for backward."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import autoplan
from autoplan.instruments.fake import fake_copy, new_fake_mode
from autoplan.instruments.rnn import MKLDNN_RNN_LAYER
from tests.handmade import measured_step
from tests.structures import build_stacked_lstm

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="nn.LSTM runs oneDNN's kernel only with it")


class _Workspaces(TorchDispatchMode):
    """The bytes of every oneDNN recurrent layer's workspace made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is MKLDNN_RNN_LAYER:
            self.sizes.append(0 if out[3] is None else out[3].untyped_storage().nbytes())
        return out


def _workspaces(layer: nn.Module, shape: tuple[int, ...], fake: bool, grad: bool = True) -> list[int]:
    mode = new_fake_mode() if fake else None
    layer = fake_copy(layer, mode) if mode is not None else layer
    with mode or contextlib.nullcontext(), torch.set_grad_enabled(grad), _Workspaces() as seen:
        layer(torch.randn(*shape, requires_grad=grad))
    return seen.sizes


@pytest.mark.parametrize("layer", [
    nn.LSTM(32, 32, batch_first=True),
    nn.LSTM(24, 40, num_layers=2),
    nn.LSTM(16, 24, bidirectional=True, batch_first=True),
], ids=["lstm", "lstm-2-layers", "lstm-bidirectional"])
def test_a_fake_recurrent_layer_keeps_the_workspace_the_real_one_keeps(layer) -> None:
    real = _workspaces(layer, (4, 48, layer.input_size), fake=False)
    assert real and all(size > 0 for size in real)  # torch's own fake kernel makes them all 0 bytes
    assert _workspaces(layer, (4, 48, layer.input_size), fake=True) == real


def test_with_grad_off_neither_keeps_one() -> None:
    """checkpoint's first forward runs without grad: the real kernel makes no workspace, nor does the fake."""
    layer = nn.LSTM(32, 32)
    assert _workspaces(layer, (10, 2, 32), fake=False, grad=False) == [0]
    assert _workspaces(layer, (10, 2, 32), fake=True, grad=False) == [0]


@pytest.mark.slow  # the whole pipeline, twice
@pytest.mark.parametrize("mode", ["keep", "full"])
def test_a_stacked_lstm_is_predicted_to_the_byte(mode) -> None:
    """Before, its plan predicted 739,328 bytes for a step that measured 2,295,808: four workspaces missing."""
    model, x = build_stacked_lstm()
    batch = (x,)
    plan = autoplan.plan(model, "1GB", example_inputs=batch, device="cpu", precision="fp32", reserve=0, checkpoint={"*": mode})
    assert measured_step(autoplan.apply(copy.deepcopy(model), plan), batch).peak_bytes == plan.prediction.peak_bytes


def test_an_lstm_layers_flops_are_its_matmuls_forward_and_twice_that_backward() -> None:
    """torch's flop counter had no formula for the kernel: recomputing an LSTM was priced as free."""
    from torch.utils.flop_counter import FlopCounterMode

    from autoplan.instruments.flop_formulas import autoplan_flop_formulas

    layer, x = nn.LSTM(32, 64, batch_first=True), torch.randn(4, 48, 32)
    with autoplan_flop_formulas(), FlopCounterMode(display=False) as counter:
        layer(x)[0].sum().backward()
    counts = counter.get_flop_counts()["Global"]
    forward = 2 * (4 * 48) * (4 * 64) * (32 + 64)  # every step: 4 gates' input and recurrent projections
    assert counts[torch.ops.aten.mkldnn_rnn_layer] == forward
    assert counts[torch.ops.aten.mkldnn_rnn_layer_backward] == 2 * forward
