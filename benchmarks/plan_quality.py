"""Plan quality: autoplan's plan against uniform checkpointing, and ILP solve time.

For a GPT-style model (plain PyTorch, random weights, fake tensors: no real memory) at budgets of
100%, 75%, 50%, 35% and 25% of its activation memory, prints the predicted and simulated peak and
the recomputed FLOPs of autoplan's plan next to checkpointing every block and every k-th block.
Then times the ILP on 24, 96 and 384 units. Everything is fp32, so recompute FLOPs compare.

    python benchmarks/plan_quality.py
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from autoplan.runtime.formatting import format_bytes
from autoplan.inputs.devices import get_device
from autoplan.memory.model import predict_peak
from autoplan.plan import Choice  # noqa: E402
from autoplan.profile.units import profile
from autoplan.solve.ilp import minimum_peak, solve
from autoplan.trace.tracer import trace
from autoplan.verify.simulate import simulate_plan
from examples.gpt import build  # noqa: E402

DEVICE = get_device("h100-80gb")
FRACTIONS = (1.00, 0.75, 0.50, 0.35, 0.25)


def machine() -> str:
    return f"{platform.node()} · {platform.processor() or platform.machine()} · Python {platform.python_version()} · torch {torch.__version__}"


def uniform(units: list[str], every: int) -> dict[str, Choice]:
    return {u: Choice("full" if i % every == 0 else "keep", "fp32") for i, u in enumerate(units)}


def quality_table() -> None:
    model, inputs = build(n_layer=12, n_embd=256, n_head=4, block_size=256, vocab_size=1024, batch_size=8, seq_len=256)
    traced = trace(model, inputs)
    measured = profile(traced, DEVICE, precisions=("fp32",))
    static = measured.timeline.static
    floor = static.parameters + static.optimizer + static.gradients
    baseline = measured.reference.peak_bytes
    activations = baseline - floor
    units = list(traced.units)
    print(f"GPT 12×256, batch 8×256, fp32, AdamW; baseline peak {format_bytes(baseline)}, "
          f"of which activation memory {format_bytes(activations)} (peak − params − grads − optimizer)")
    header = f"{'budget':>16} {'plan':<22} {'predicted':>11} {'simulated':>11} {'error':>7} {'fits':>5} {'recompute GFLOP':>16}"
    print(header)
    print("-" * len(header))
    for fraction in FRACTIONS:
        budget = floor + int(fraction * activations)
        plan = autoplan.plan(model, budget, example_inputs=inputs, device=DEVICE, precision="fp32", reserve=0)
        rows = [("autoplan", plan.choices())] + [(f"full every {k} block", uniform(units, k)) for k in (1, 2, 3)]
        for name, choices in rows:
            predicted = predict_peak(measured, choices).bytes
            simulated = simulate_plan(traced, choices, device=DEVICE, optimizer="adamw", rest_precision="fp32").peak_bytes
            recompute = sum(measured.unit(u).recompute_flops(c) for u, c in choices.items())
            fits = "yes" if simulated <= budget and (name != "autoplan" or plan.feasible) else "no"
            label = f"{fraction:.0%} {format_bytes(budget)}" if name == "autoplan" else ""
            print(f"{label:>16} {name:<22} {format_bytes(predicted):>11} {format_bytes(simulated):>11} "
                  f"{(predicted - simulated) / simulated:>+7.1%} {fits:>5} {recompute / 1e9:>16.2f}")


def solve_times() -> None:
    print("\nILP solve time, fp32|bf16 × keep|selective|full per unit (GPT blocks 64 wide, batch 1×64;\n"
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
    print(f"machine: {machine()}; target device profile: {DEVICE.name} (roofline times)\n")
    quality_table()
    solve_times()
