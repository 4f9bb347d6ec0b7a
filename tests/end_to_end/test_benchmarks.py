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

ROOT = Path(__file__).resolve().parents[2]


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


def test_plan_quality_counts_compiled_graph_flops_like_flop_counter():
    quality = load("plan_quality")
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.flop_counter import FlopCounterMode

    def step(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    args = (torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 4))
    graph = make_fx(step, tracing_mode="fake")(*args).graph
    quality.COMPILED_FLOPS.clear()
    quality._count_graph_flops(graph)
    with FlopCounterMode(display=False) as counter:
        step(*args)
    assert quality.COMPILED_FLOPS == [counter.get_total_flops()] and counter.get_total_flops() > 0


def test_plan_quality_auto_sac_names_ops_autoplan_can_apply():
    pytest.importorskip("pwlf")  # torch's auto-SAC fits its trade-off curves with it
    quality = load("plan_quality")
    from autoplan.planned.forwards import apply_choices
    from examples.llama import Llama, LlamaConfig, example_batch

    config = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=192, max_seq_len=64)
    torch.manual_seed(0)
    model, inputs = Llama(config), example_batch(config, 2, 64)
    assert quality.auto_sac_choices(config, inputs, budget_bytes=1) is None  # nothing fits
    # its memory model counts less than autoplan's (no logits, ...): below autoplan's floor it still checkpoints
    choices = quality.auto_sac_choices(config, inputs, int(0.75 * quality._plan(model, "100%", inputs, menu_size=0).prediction.minimum_peak_bytes))
    assert choices and {unit.name for unit in choices} <= {"layers.0", "layers.1"}
    assert all(c.mode == "selective" and all("#" in name for name in c.saves) for c in choices.values())
    reference, planned = Llama(config), Llama(config)
    planned.load_state_dict(reference.state_dict())
    apply_choices(planned, choices)
    for m in (reference, planned):
        m(*inputs).backward()
    for (name, a), (_, b) in zip(planned.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)
