"""A GPU target counts the copies CUDA's matmuls make of operands cuBLAS cannot read in place
(instruments.cuda_matmul): an expanded gradient reaching the output Linear, a strided slice."""

from __future__ import annotations

import torch

import autoplan
from autoplan.instruments import cuda_matmul
from autoplan.instruments.cuda_matmul import operand_copy_bytes
from autoplan.instruments.fake import new_fake_mode
from autoplan.instruments.tracker import LiveBytesTracker

aten = torch.ops.aten


def test_plain_and_transposed_matrices_are_read_in_place():
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    assert operand_copy_bytes(aten.mm.default, (a, b), {}) == 0
    assert operand_copy_bytes(aten.mm.default, (b.t(), a.t()), {}) == 0
    assert operand_copy_bytes(aten.bmm.default, (torch.randn(4, 8, 16), torch.randn(4, 16, 8).transpose(1, 2).transpose(1, 2)), {}) == 0
    assert operand_copy_bytes(aten.add.Tensor, (a, a), {}) == 0  # not a matmul


def test_expanded_and_gapped_operands_are_copied():
    expanded = torch.ones(()).expand(64, 32)
    gapped = torch.randn(64, 64)[:, ::2]
    b = torch.randn(32, 48)
    assert operand_copy_bytes(aten.mm.default, (expanded, b), {}) == 64 * 32 * 4
    assert operand_copy_bytes(aten.addmm.default, (torch.zeros(48), gapped, b), {}) == 64 * 32 * 4
    assert operand_copy_bytes(aten.mm.default, (expanded, expanded.t()), {}) == 2 * 64 * 32 * 4


def test_a_sum_loss_on_a_gpu_target_holds_a_copy_of_the_logits_gradient(monkeypatch):
    """The gradient of `logits.sum()` is an expanded tensor; the head's backward matmuls copy it (seen on an H100:
    a GPT holding one logits-sized block more in backward than the simulation did)."""
    def peak(device: str) -> int:
        with new_fake_mode() as mode:
            x = mode.from_tensor(torch.randn(512, 64)).requires_grad_()
            weight = mode.from_tensor(torch.randn(20000, 64)).requires_grad_()
            with LiveBytesTracker(autoplan.get_device(device)) as tracker:
                logits = x @ weight.t()  # kept through backward, as a loop that holds its outputs keeps them
                logits.sum().backward()
        return tracker.phases()[0].peak_bytes

    counted = peak("h100-80gb")
    monkeypatch.setattr(cuda_matmul, "_OPERANDS", {})
    assert counted - peak("h100-80gb") == 512 * 20000 * 4  # one copy at a time: each matmul frees its own
