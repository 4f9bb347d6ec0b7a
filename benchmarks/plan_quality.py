"""Plan quality: peak, step time and extra FLOPs of autoplan's plans against the alternatives.

One run prints the table of issue 15 for a Llama-style model (examples/llama.py, plain PyTorch,
random weights, fp32, AdamW), every row measured in real CPU training steps in this process:

- peak: live tensor bytes of training step 2 (parameters, gradients, optimizer state, activations),
  counted by autoplan's tracker over the real run (eager ops only);
- step time: against a plain eager copy in the same process, steps alternating (plain, config),
  1 thread, the median of --pairs per-pair ratios (differences under ~5% are ties here);
- extra FLOPs: torch's FlopCounterMode over one step, against the plain step.

Rows: no plan; checkpointing every layer (full); autoplan at static + 50% and + 25% of the
activation memory (static = parameters + gradients + optimizer state, activations = the rest of
the no-plan peak), with each unit's menu, and with the three fixed modes only (menu_size=0) for
comparison. Then the ILP's solve time on 24, 96 and 384 units.

    python benchmarks/plan_quality.py                 # small model (4 layers, d=256, 4×256 tokens): minutes
    python benchmarks/plan_quality.py --size issue    # the issue's model (8 layers, d=512, 4×512 tokens)
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from autoplan.inputs.devices import get_device  # noqa: E402
from autoplan.memory.model import predict_peak  # noqa: E402
from autoplan.plan import Choice  # noqa: E402
from autoplan.profile.units import profile  # noqa: E402
from autoplan.runtime.formatting import format_bytes  # noqa: E402
from autoplan.runtime.planned import apply_choices  # noqa: E402
from autoplan.runtime.tracker import LiveBytesTracker  # noqa: E402
from autoplan.runtime.training import optimizer_state_tensors  # noqa: E402
from autoplan.solve.ilp import minimum_peak, solve  # noqa: E402
from autoplan.trace.tracer import trace  # noqa: E402
from autoplan.trace.units import find_units  # noqa: E402
from examples.gpt import build  # noqa: E402
from examples.llama import Llama, LlamaConfig, example_batch  # noqa: E402

DEVICE = get_device("h100-80gb")  # the solve-time section's target (roofline)
CPU = get_device("cpu")
SIZES = {
    "small": (LlamaConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=688, max_seq_len=256), 4, 256),
    "issue": (LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1376, max_seq_len=512), 4, 512),
}


def machine() -> str:
    return f"{platform.node()} · {platform.processor() or platform.machine()} · Python {platform.python_version()} · torch {torch.__version__}"


@dataclass(frozen=True)
class Row:
    config: str
    peak_bytes: int
    time_ratio: float
    extra_flops: float  # fraction of the plain step's FLOPs
    budget_bytes: int | None = None


def _step(model, inputs, optimizer) -> None:
    model(*inputs).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def peak_of(model, inputs) -> int:
    """Live tensor bytes of training step 2 (step 1 makes the optimizer state)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, inputs, optimizer)
    tracker = LiveBytesTracker(CPU)
    with tracker:
        tracker.adopt(list(model.parameters()) + list(model.buffers()) + optimizer_state_tensors(optimizer))
        _step(model, inputs, optimizer)
    return max(phase.peak_bytes for phase in tracker.phases())


def flops_of(model, inputs) -> int:
    with FlopCounterMode(display=False) as counter:
        model(*inputs).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def time_ratio(plain, model, inputs, pairs: int) -> float:
    """Median over alternating (plain, model) step pairs of model's time / plain's time, after a warm-up pair."""
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (plain, model)]
    ratios = []
    for pair in range(pairs + 1):
        times = []
        for m, optimizer in zip((plain, model), optimizers):
            started = time.perf_counter()
            _step(m, inputs, optimizer)
            times.append(time.perf_counter() - started)
        if pair:
            ratios.append(times[1] / times[0])
    return statistics.median(ratios)


def quality_table(size: str, pairs: int) -> None:
    config, batch, seq = SIZES[size]
    torch.manual_seed(0)
    original = Llama(config)
    inputs = example_batch(config, batch, seq)
    traced = trace(original, inputs)
    measured = profile(traced, CPU, precisions=("fp32",), menu_size=0)
    static = measured.timeline.static
    floor = static.parameters + static.optimizer + static.gradients
    activations = measured.reference.peak_bytes - floor
    print(f"Llama-style {config.n_layers} layers, d={config.dim}, ffn {config.ffn_dim}, vocab {config.vocab_size}, "
          f"batch {batch}×{seq}, fp32, AdamW; static {format_bytes(floor)}, activations {format_bytes(activations)} "
          f"(simulated); {pairs} alternating pairs, 1 thread")
    plain_flops = flops_of(copy.deepcopy(original), inputs)
    configs: list[tuple[str, object, int | None]] = [("no plan", {}, None),
                                                     ("checkpoint every layer (full)", {u: Choice("full") for u in find_units(original)}, None)]
    for fraction in (0.5, 0.25):
        budget = floor + int(fraction * activations)
        for label, menu in (("autoplan", None), ("autoplan, 3 fixed modes", 0)):
            options = {} if menu is None else {"menu_size": menu}
            started = time.perf_counter()
            plan = _plan(original, budget, inputs, **options)
            print(f"  planned {label} at static + {fraction:.0%} in {time.perf_counter() - started:.0f} s: "
                  f"{', '.join(sorted({str(d.choice) for d in plan.units}))}")
            configs.append((f"{label} at static + {fraction:.0%}", plan.choices() if plan.feasible else None, budget))
    rows = []
    for label, choices, budget in configs:
        if choices is None:
            print(f"  {label}: no plan fits")
            continue
        model = copy.deepcopy(original)
        apply_choices(model, choices)
        rows.append(Row(label, peak_of(copy.deepcopy(model), inputs), time_ratio(copy.deepcopy(original), model, inputs, pairs),
                        flops_of(copy.deepcopy(model), inputs) / plain_flops - 1, budget))
    print(f"\n| config | budget | peak | step time vs no plan | extra FLOPs |\n|---|---|---|---|---|")
    for row in rows:
        budget = format_bytes(row.budget_bytes) if row.budget_bytes else "—"
        print(f"| {row.config} | {budget} | {format_bytes(row.peak_bytes)} | {row.time_ratio:.2f}× | {row.extra_flops:+.1%} |")
    print("\nnot run here: torch's auto-SAC (sac_estimator + sac_milp need CUDA), torch.compile rows "
          "(the tracker cannot see inside compiled graphs; see docs/plan_quality.md)")


def _plan(model, budget, inputs, menu_size=None):
    """autoplan's plan for `budget`; menu_size 0 profiles the three fixed modes only (None: the menu, 6 points)."""
    options = {"menu_size": 6 if menu_size is None else menu_size}
    return autoplan.plan(model, budget, example_inputs=inputs, device="cpu", precision="fp32", reserve=0, **options)


def solve_times() -> None:
    print("\nILP solve time, fp32|bf16 × keep|selective|full and each unit's menu (GPT blocks 64 wide, batch 1×64;\n"
          "budget halfway between the lowest reachable peak and no plan; profiling not timed)")
    print(f"{'units':>6} {'budget':>12} {'status':>10} {'solve s':>8}")
    for layers in (24, 96, 384):
        model, inputs = build(n_layer=layers, n_embd=64, n_head=2, block_size=64, vocab_size=128, batch_size=1, seq_len=64)
        measured = profile(trace(model, inputs), DEVICE, precisions=("fp32", "bf16"))
        lowest = predict_peak(measured, minimum_peak(measured).choices).bytes
        budget = (lowest + measured.reference.peak_bytes) // 2  # halfway: a real trade-off to solve
        started = time.perf_counter()
        solution = solve(measured, budget)
        print(f"{layers:>6} {format_bytes(budget):>12} {solution.status:>10} {time.perf_counter() - started:>8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--skip-solve-times", action="store_true")
    options = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {machine()}; plans for the cpu device profile; command: python benchmarks/plan_quality.py --size {options.size}\n")
    quality_table(options.size, options.pairs)
    if not options.skip_solve_times:
        solve_times()
