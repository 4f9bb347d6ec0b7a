"""The benchmarks' CPU mode: CI runs their code paths (their GPU numbers need a GPU).

Only what must hold anywhere is asserted: autoplan's plans fit their budgets in a real run and
its predicted peak is what the run measured; checkpointing every block uses less than bf16 alone.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from examples.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def test_compare_cpu_mode_runs_every_eager_configuration(monkeypatch):
    compare = load("compare")
    monkeypatch.setattr(compare, "FRACTIONS", (0.5,))
    size = dict(n_layer=4, n_embd=64, n_head=2, block_size=64, vocab_size=128)

    def batch(device):
        ids = torch.randint(0, 128, (4, 64), device=device)
        return {"idx": ids, "targets": ids}

    workload = compare.Workload("tiny GPT", lambda: GPT(GPTConfig(**size)), batch)
    rows, static, bf16 = compare.rows_for(workload, torch.device("cpu"), steps=2, with_compile=False)
    by_name = {row.config: row for row in rows}
    assert list(by_name) == ["fp32 eager", "bf16 autocast", "bf16 + checkpoint every block", "autoplan @ 50%"]
    assert by_name["bf16 + checkpoint every block"].result.peak_bytes < bf16.peak_bytes < by_name["fp32 eager"].result.peak_bytes
    planned = by_name["autoplan @ 50%"]
    assert planned.result.peak_bytes <= planned.budget
    assert planned.predicted_bytes == pytest.approx(planned.result.peak_bytes, rel=0.01)
