"""Dropout on a GPU target saves CUDA's 1-byte mask (instruments.cuda_dropout), and every op the H100 was
measured on (benchmarks/results/h100_2026-11-27/saved.json, `python benchmarks/gpu_truth.py --parts saved`)
saves in the simulation what the card saved, or more where a CUDA kernel is known to save less."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from autoplan.inputs.devices import get_device
from autoplan.instruments.cuda_dropout import cuda_dropout
from autoplan.instruments.target import as_the_target_runs
from benchmarks.gpu_parts import op_cases, saved_by

MEASURED = json.loads((Path(__file__).parents[2] / "benchmarks/results/h100_2026-11-27/saved.json").read_text())
SAVES_LESS_ON_CUDA = {"rms_norm"}  # torch 2.11's fused CUDA kernel keeps only the 1/rms statistics


def _saved_dtypes(run) -> list[tuple[torch.dtype, int]]:
    found = []

    def pack(tensor):
        found.append((tensor.dtype, tensor.numel()))
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return found


def test_dropout_on_a_gpu_target_saves_a_bool_mask_and_on_the_cpu_one_in_the_input_dtype():
    with FakeTensorMode():
        x = torch.randn(4, 8, requires_grad=True)
        with as_the_target_runs(get_device("h100-80gb")):
            on_gpu = _saved_dtypes(lambda: F.dropout(x, 0.1, True))
        on_cpu = _saved_dtypes(lambda: F.dropout(x, 0.1, True))
    assert on_gpu == [(torch.bool, 32)]
    assert (torch.float32, 32) in on_cpu and torch.bool not in [dtype for dtype, _ in on_cpu]


def test_cuda_dropout_trains_as_dropout_does():
    torch.manual_seed(0)
    x = torch.randn(200, 50, requires_grad=True)
    with cuda_dropout():
        out = F.dropout(x, 0.25, True)
        assert F.dropout(x, 0.0, True) is x and F.dropout(x, 0.25, False) is x
        assert torch.count_nonzero(F.dropout(x, 1.0, True)) == 0
    kept = out != 0
    assert 0.7 < kept.float().mean() < 0.8  # about 1 - p of the elements survive
    torch.testing.assert_close(out[kept], x[kept] / 0.75)
    out.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / 0.75)
    assert torch.count_nonzero(F.dropout(torch.ones(10), 0.5, True) != 1) > 0  # outside, the op is torch's again


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_what_the_simulation_saves_on_an_h100_target_is_what_the_h100_saved(name):
    device = get_device("h100-80gb")
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        with FakeTensorMode(), as_the_target_runs(device), torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            run, known = op_cases(torch.device("cpu"), smoke=False)[name]()
            simulated = saved_by(run, known)["bytes"]
        measured = MEASURED[name][f"cuda {precision}"]["bytes"]
        if name in SAVES_LESS_ON_CUDA:
            assert simulated >= measured, (precision, simulated, measured)
        else:  # the stand-in flash kernel keeps its RNG seed and offset (8 bytes) where CUDA's keeps empty tensors
            assert measured <= simulated <= measured + 16, (precision, simulated, measured)
