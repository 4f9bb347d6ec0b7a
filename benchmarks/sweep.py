"""A sweep of budgets with one autoplan.Planner: the first plan profiles, the others only solve.

    python benchmarks/sweep.py              # Llama 1b and 8b on the meta device, batch 1 × 4096, one h100-80gb
    python benchmarks/sweep.py 1b --points 3

For each model: the seconds of the first `planner.plan` (trace, profile and solve), then the median
seconds of `--points` later plans at budgets spread from the lowest peak to no plan (solve only),
against what `autoplan.plan` would take for each (the first plan's time again). Prints one row per
model and the machine it ran on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from scale import ROOT, llama_arguments  # benchmarks/ is on the path when this script runs

sys.path.insert(0, ROOT)

from benchmarks.machine import describe_machine  # noqa: E402


def sweep(preset: str, args) -> tuple[float, list[float], int]:
    import autoplan
    from examples.llama import LlamaConfig, build_on_meta

    model, batch = build_on_meta(LlamaConfig.preset(preset), args.batch_size, args.seq_len)
    # reserve 0: each budget is what the plan may use; over the card: the sweep reaches the no-plan peak
    planner = autoplan.Planner(model, example_inputs=batch, device=args.device, reserve=0, allow_over_device=True)
    started = time.perf_counter()
    roomy = planner.plan("1TB")
    first = time.perf_counter() - started
    low, high = roomy.prediction.minimum_peak_bytes, roomy.prediction.baseline_peak_bytes
    seconds, fitting = [], 0
    for k in range(args.points):
        budget = low + (high - low) * k // max(args.points - 1, 1)
        started = time.perf_counter()
        plan = planner.plan(budget)
        seconds.append(time.perf_counter() - started)
        fitting += plan.outcome.feasible
    return first, seconds, fitting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    llama_arguments(parser, ["1b", "8b"], seq_len=4096)
    parser.add_argument("--points", type=int, default=5)
    args = parser.parse_args()
    print(f"machine: {describe_machine()}; batch {args.batch_size} × {args.seq_len} on one {args.device}, {args.points} budgets from the lowest "
          "peak to no plan")
    print(f"{'model':>6} {'first plan s':>13} {'later plan s (median)':>22} {'ratio':>6} {'fit':>5}")
    for preset in args.presets:
        first, later, fitting = sweep(preset, args)
        median = statistics.median(later)
        print(f"{preset:>6} {first:>13.2f} {median:>22.2f} {first / median:>5.1f}× {fitting:>2}/{len(later)}")


if __name__ == "__main__":
    main()
