"""The fewest extra FLOPs any op-level save policy can reach at a memory budget, on plan_quality's Llama.

Extra FLOPs are what torch's FlopCounterMode counts (matmul/conv/attention kernels; on the CPU it
has no formula for `_scaled_dot_product_flash_attention_for_cpu`, so attention counts zero here).
Under that metric a unit's ops without FLOPs (norms, RoPE, SiLU, adds) are free to recompute, and
saving one can never spare a matmul's recomputation (checkpoint replays the forward in order and
skips only cached ops), so the FLOP-minimal op-level policies of a unit are the subsets of its
matmuls that it saves, recomputing everything else. This script measures every such subset of
the Llama block (2^7 with its 7 matmuls) like any other choice (fake tensors: held bytes, forward
and backward peaks, FLOPs), adds them to the profile beside keep/selective/full, and asks
autoplan's own ILP and memory model for the choices of fewest recomputed FLOPs under each budget
(the ILP's objective priced in FLOPs instead of roofline time), with the loss head as autoplan plans
it (fused, planned.loss_head; --loss-as-written for F.cross_entropy as the model writes it). Each
answer is then run for real:
FlopCounterMode over one step and the live-bytes peak of step 2, as in plan_quality.py.

    python benchmarks/flop_bound.py --size issue                      # about 3 minutes on 2 shared cores
    python benchmarks/flop_bound.py --size issue --loss-as-written    # the same, the loss head not fused
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import sys
import time
from pathlib import Path
from types import MappingProxyType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.machine import describe_machine  # noqa: E402
from plan_quality import CPU, SIZES, flops_of, peak_of, setup  # noqa: E402

from autoplan.memory.model import predict_peak  # noqa: E402
from autoplan.memory.segment_terms import chosen_segments  # noqa: E402
from autoplan.plan import Choice, OutsideUnits  # noqa: E402
from autoplan.profile.menu import describe, record_ops  # noqa: E402
from autoplan.profile.profiler import with_choices  # noqa: E402
from autoplan.vocabulary.formatting import format_bytes  # noqa: E402
from autoplan.memory.segment_terms import choices_by_unit  # noqa: E402
from autoplan.planned.forwards import apply_choices  # noqa: E402
from autoplan.inputs.budget import Budget  # noqa: E402
from autoplan.solve.ilp import solve  # noqa: E402
from autoplan.solve.request import SolveRequest  # noqa: E402
from examples.llama import Llama  # noqa: E402

FLOP_SECONDS = 1e-12  # a FLOP priced as a picosecond: the ILP's "time" becomes FLOPs


def block_ops(model: Llama, inputs: tuple):
    """The first block's ops, recorded on the real model (every block is the same)."""
    captured = {}
    handle = model.layers[0].register_forward_pre_hook(lambda m, a, k: captured.setdefault("call", (a, k)), with_kwargs=True)
    with torch.no_grad():
        model(*inputs)
    handle.remove()
    args, kwargs = captured["call"]
    args = tuple(a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args)
    return record_ops(model.layers[0], args, kwargs, "fp32", CPU)


def priced_in_flops(measured):
    """The profile with every option's time replaced by its FLOPs (forward + backward with recompute)."""
    def flops_cost(cost):
        return dataclasses.replace(cost, fwd_time_s=cost.fwd_flops * FLOP_SECONDS, bwd_time_s=cost.bwd_flops * FLOP_SECONDS)
    units = tuple(dataclasses.replace(u, options=MappingProxyType({c: flops_cost(k) for c, k in u.options.items()})) for u in measured.units)
    return dataclasses.replace(measured, units=units)


def recomputed_flops(profile, choices) -> int:
    """FLOPs the choices recompute; a chosen segment recomputes each of its members whole."""
    segments = sum(profile.units[u].recompute_flops(Choice("full", choice.precision))
                   for candidate, choice in chosen_segments(profile, choices) for u in candidate.members)
    units = {unit.name for unit in profile.units}  # any other name is a segment's
    return segments + sum(profile.unit(n).recompute_flops(c) for n, c in choices.items() if n in units)


def main(size: str, fuse_loss: bool) -> None:
    config, batch, seq = SIZES[size]
    made = setup(size, fuse_loss)
    original, inputs, traced, measured = made.original, made.inputs, made.traced, made.measured
    floor, activations = made.floor, made.activations
    plain_flops = flops_of(copy.deepcopy(original), inputs)
    print(f"machine: {describe_machine()}\nLlama-style {config.n_layers} layers, d={config.dim}, batch {batch}×{seq}, fp32; static "
          f"{format_bytes(floor)}, activations {format_bytes(activations)}; loss head "
          f"{'fused (' + measured.timeline.fused_logits + ')' if measured.timeline.fused_loss else 'as written'}; plain step {plain_flops / 1e9:.1f} GFLOP (FlopCounterMode)\n")

    ops = block_ops(original, inputs)
    matmuls = [op for op in ops if op.savable and op.flops > 0]
    print("the block's ops with FLOPs (the only ones whose recomputation the metric counts):")
    for op in matmuls:
        print(f"  {op.occurrence:10} {op.module:18} output {format_bytes(op.saved_bytes):>9}  {op.flops / 1e9:5.2f} GFLOP  "
              f"{op.flops / op.saved_bytes * 2**20 / 1e9:5.3f} GFLOP per MiB saved")
    started = time.perf_counter()
    subsets = [Choice("selective", "fp32", saves=tuple(op.occurrence for op in chosen))
               for k in range(len(matmuls) + 1) for chosen in itertools.combinations(matmuls, k)]
    # per-block policies only: a segment recomputes its inner blocks' last ops too, which the FLOP count here
    # (members' own full recompute) would miss
    studied = with_choices(traced, measured, subsets)
    print(f"measured {len(subsets)} subsets in {time.perf_counter() - started:.0f} s\n")
    unit = studied.units[0]
    keep_bwd = unit.options[Choice("keep")].bwd_flops
    print("per block, the subsets on the front of held bytes vs recomputed FLOPs (measured):")
    front = sorted(unit.options.items(), key=lambda item: (item[1].held_bytes, item[1].bwd_flops))
    best = None
    for choice, cost in front:
        if best is None or cost.bwd_flops < best:
            best = cost.bwd_flops
            what = choice.mode if choice.saves is None else describe(ops, choice.saves).split(";")[0]
            print(f"  holds {format_bytes(cost.held_bytes):>9}  recomputes {(cost.bwd_flops - keep_bwd) / 1e9:5.2f} GFLOP  {what}")

    flop_priced = priced_in_flops(studied)
    print("\n| budget | fewest extra FLOPs (predicted) | measured peak | measured extra FLOPs | per block |\n|---|---|---|---|---|")
    for fraction in (0.5, 0.25):
        budget = floor + int(fraction * activations)
        solution = solve(flop_priced, SolveRequest(Budget(budget, 0, f"{budget}B"), time_limit_s=60, segments=False))
        if not solution.feasible:
            print(f"| static + {fraction:.0%} ({format_bytes(budget)}) | nothing fits | | | |")
            continue
        predicted = recomputed_flops(studied, solution.choices)
        model = copy.deepcopy(original)
        apply_choices(model, choices_by_unit(studied, solution.choices), OutsideUnits(fused_loss=studied.timeline.fused_loss))
        real_flops = flops_of(copy.deepcopy(model), inputs) / plain_flops - 1
        peak = peak_of(copy.deepcopy(model), inputs)
        per_block = ", ".join(c.mode if c.saves is None else f"{len(c.saves)} mm" for c in solution.choices.values())
        print(f"| static + {fraction:.0%} ({format_bytes(budget)}) | {predicted / plain_flops:+.1%} "
              f"(peak {format_bytes(predict_peak(studied, solution.choices).bytes)}) | {format_bytes(peak)} | {real_flops:+.1%} | {per_block} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="issue")
    parser.add_argument("--loss-as-written", action="store_true", help="the bound without autoplan's fused loss head")
    torch.set_num_threads(1)
    options = parser.parse_args()
    main(options.size, not options.loss_as_written)
