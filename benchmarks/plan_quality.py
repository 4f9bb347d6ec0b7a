"""Plan quality: peak, step time and extra FLOPs of autoplan's plans against the alternatives.

One run prints the table of issue 15 for a Llama-style model (examples/llama.py, plain PyTorch,
random weights, fp32, AdamW), every row measured in real CPU training steps in this process:

- peak (live tensors): bytes in training step 2 (parameters, gradients, optimizer state,
  activations), the CPU allocator's own count of the real run (autoplan/verify/allocator.py); eager rows only;
- peak (RSS rise): the tensors alive before step 2 plus the resident memory step 2 added
  (`rss_peak_of`); it sees compiled graphs too;
- step time: against a plain eager copy in the same process, steps alternating (plain, config),
  1 thread, the median of --pairs per-pair ratios (differences under ~5% are ties here);
- extra FLOPs: torch's FlopCounterMode over one step, against the plain step (compiled rows: the
  same formulas over the graphs Inductor compiled, `_count_graph_flops`). On the CPU torch has no
  FLOP formula for its flash attention kernel: attention counts zero in every row.

Rows: no plan; checkpointing every layer (full); at static + 50% and + 25% of the activation memory
(static = parameters + gradients + optimizer state, activations = the rest of the no-plan peak)
autoplan's plan (its default menu and fused loss head), the same with the loss as written
(fuse_loss=False; --fixed-modes adds the plans of keep/selective/full only) and torch's auto-SAC
(`sac_estimator` + `sac_milp`, patched to price ops on the CPU: `auto_sac_choices`); torch.compile
with `activation_memory_budget` 1.0 / 0.5 / 0.25, and autoplan's compile=True plans compiled.
Then the ILP's solve time on 24, 96 and 384 units. benchmarks/flop_bound.py gives the fewest
extra FLOPs any op-level policy of the blocks reaches at the same budgets.

    python benchmarks/plan_quality.py --size small    # 4 layers, d=256, 4×256 tokens: about 6 minutes
    python benchmarks/plan_quality.py --size issue    # the issue's model (8 layers, d=512, 4×512 tokens)

Needs `pwlf` (torch's auto-SAC fits its trade-off curves with it): pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import io
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
from torch.distributed._tools.mem_tracker import MemTracker, _ModState
from torch.distributed._tools.runtime_estimator import RuntimeEstimator
from torch.distributed._tools.sac_estimator import SACEstimator
from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module, sac_milp
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import FlopCounterMode, flop_registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402
from autoplan.inputs.devices import get_device  # noqa: E402
from autoplan.memory.model import predict_peak  # noqa: E402
from autoplan.plan import Choice, OutsideUnits  # noqa: E402
from autoplan.profile.profiler import profile  # noqa: E402
from autoplan.vocabulary.formatting import format_bytes  # noqa: E402
from autoplan.planned.forwards import apply_choices  # noqa: E402
from autoplan.units import ModuleUnit  # noqa: E402
from autoplan.vocabulary.tensors import tensors_of, unique_storage_bytes  # noqa: E402
from autoplan.instruments.tracker import op_roofline  # noqa: E402
from autoplan.verify.allocator import AllocatorCount  # noqa: E402
from autoplan.training.step_parts import optimizer_state_tensors  # noqa: E402
from autoplan.inputs.budget import Budget  # noqa: E402
from autoplan.solve.ilp import minimum_peak, solve  # noqa: E402
from autoplan.solve.request import SolveRequest  # noqa: E402
from autoplan.trace.tracer import trace  # noqa: E402
from autoplan.trace.discovery import find_units  # noqa: E402
from examples.gpt import build  # noqa: E402
from examples.llama import Llama, LlamaConfig, example_batch  # noqa: E402

DEVICE = get_device("h100-80gb")  # the solve-time section's target (roofline)
CPU = get_device("cpu")
SIZES = {
    "small": (LlamaConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=688, max_seq_len=256), 4, 256),
    "issue": (LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1376, max_seq_len=512), 4, 512),
}


@dataclass(frozen=True)
class Row:
    config: str
    peak_bytes: int
    time_ratio: float
    extra_flops: float  # fraction of the plain step's FLOPs
    budget_bytes: int | None = None
    rss_peak_bytes: int = 0  # rss_peak_of: the tensors alive before step 2 plus the resident memory step 2 added


def _step(model, inputs, optimizer) -> None:
    model(*inputs).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def peak_of(model, inputs) -> int:
    """The peak of training step 2 (step 1 makes the optimizer state), as the CPU allocator counts it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with AllocatorCount(resident=(model, inputs, optimizer)) as count:
        _step(model, inputs, optimizer)
        count.mark("step 2")
        _step(model, inputs, optimizer)
    return count.stretches()[-1].peak_bytes


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


def _vm_bytes(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field + ":"))) * 1024


def rss_peak_of(model, inputs) -> int:
    """Peak of training step 2 from the resident set: what was alive before it (parameters, buffers,
    optimizer state; no gradients) plus the most resident memory the step added.

    This sees inside compiled graphs, which the eager rows' count is not run on. It is honest only
    because main() runs with MALLOC_MMAP_THRESHOLD_ fixed at 64 KiB: glibc then maps every tensor
    of that size or more on its own and unmaps it when freed, so the resident set follows the live
    tensors (eager rows print both peaks: they agree to a few MB). The high-water mark is reset
    just before the step (Linux: /proc/self/clear_refs).
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, inputs, optimizer)
    gc.collect()
    alive = unique_storage_bytes(list(model.parameters()) + list(model.buffers()) + optimizer_state_tensors(optimizer))
    Path("/proc/self/clear_refs").write_text("5")
    before = _vm_bytes("VmRSS")
    _step(model, inputs, optimizer)
    return alive + _vm_bytes("VmHWM") - before


COMPILED_FLOPS: list[int] = []  # FLOPs of each graph Inductor compiled since the last clear (forward, backward)


def _count_graph_flops(graph: torch.fx.Graph) -> None:
    """Inductor's post-grad pass hook: FlopCounterMode cannot see inside compiled code, so count the
    graphs it runs (after the partitioner chose what the backward recomputes), with the same formulas."""
    total = 0
    for node in graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)
        if node.op == "call_function" and packet in flop_registry:
            args, kwargs = tree_map_only(torch.fx.Node, lambda n: n.meta["val"], (node.args, node.kwargs))
            total += flop_registry[packet](*args, **kwargs, out_val=node.meta["val"])
    COMPILED_FLOPS.append(total)


def auto_sac_choices(config: LlamaConfig, inputs, budget_bytes: int) -> dict[ModuleUnit, Choice] | None:
    """torch's auto-SAC (torch.distributed._tools: sac_estimator + sac_milp) for `budget_bytes`, as autoplan choices.

    Its statistics come from one fake-tensor run of the same model and loop (MemTracker for memory,
    RuntimeEstimator and SACEstimator for time); sac_milp picks which blocks to checkpoint and what
    share of each one's activation memory to discard, and get_optimal_checkpointing_policy_per_module
    picks the ops each saves. The ops are named by type and occurrence as autoplan's policies name
    them, so the same wrapper applies them. None: sac_milp found nothing under the budget.
    """
    # CPU patch: RuntimeEstimator's roofline asks CUDA for the device's peak rates and refuses without
    # it; here it prices each op with autoplan's roofline for the same `cpu` profile autoplan plans with.
    def cpu_roofline(cls, func, args, kwargs):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        return out, op_roofline(CPU, func, args, kwargs, out, tensors_of((args, kwargs)) + tensors_of(out)).time_s * 1e3

    RuntimeEstimator._roofline_estimate = classmethod(cpu_roofline)
    with FakeTensorMode() as fake_mode:
        model = Llama(config)
        fake_inputs = tuple(fake_mode.from_tensor(t) for t in inputs)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            for step in range(2):  # step 1 makes the optimizer state; step 2 is measured
                model(*fake_inputs).backward()
                last = tracker.get_tracker_snapshot("current") if step else None
                optimizer.step()
                optimizer.zero_grad()
                if not step:
                    tracker.reset_mod_stats()
        for stats in tracker.memory_tracking.values():  # as torch's own tests do: modules whose backward hook never ran
            stats.snapshots.setdefault(_ModState.POST_BW, []).append(copy.deepcopy(last))
        runtimes, sac = RuntimeEstimator(), SACEstimator()
        for estimator in (runtimes, sac):
            with estimator("operator-level-cost-model"), contextlib.redirect_stdout(io.StringIO()):  # it prints its total
                model(*fake_inputs).backward()
        info = aggregate_stats(model, tracker, runtimes, sac, torch.device("cpu"))
    units = [f"Llama.layers.{i}" for i in range(config.n_layers)]
    discard, _, peak = sac_milp(parse_module_info(info), memory_budget=budget_bytes / 2**30, ac_units=units)
    if peak < 0:
        return None
    choices = {}
    for fqn, share in discard.items():
        stats = sac.sac_mod_stats[fqn]
        saved = get_optimal_checkpointing_policy_per_module(stats, memory_budget=1 - share)
        seen = Counter()
        names = []
        for name, keep in zip(stats.func_names, saved):
            names.append((f"aten.{name}#{seen[name]}", keep))
            seen[name] += 1
        choices[ModuleUnit(fqn.removeprefix("Llama."))] = Choice("selective", "fp32", saves=tuple(n for n, keep in names if keep))
    return choices


@dataclass(frozen=True)
class Config:
    label: str
    choices: dict | None  # autoplan's Choice per unit (None: no plan fitted)
    budget_bytes: int | None = None
    compile_budget: float | None = None  # torch.compile with this activation_memory_budget; None: eager
    fused_loss: bool = False  # the loss head fused (autoplan's plan.decisions.fused_loss)


@dataclass(frozen=True)
class Setup:
    """The benchmark's model at one size, traced and profiled with the three modes, and its memory split."""

    original: Llama
    inputs: tuple
    traced: object
    measured: object  # the Profile (menu off; the loss head fused unless setup(fuse_loss=False))
    floor: int  # static: parameters + gradients + optimizer state
    activations: int  # the simulated no-plan peak above the floor


def setup(size: str, fuse_loss: bool = True) -> Setup:
    config, batch, seq = SIZES[size]
    torch.manual_seed(0)
    original = Llama(config)
    inputs = example_batch(config, batch, seq)
    traced = trace(original, inputs)
    measured = profile(traced, CPU, precisions=("fp32",), menu_size=0, fuse_loss=fuse_loss)
    static = measured.timeline.static
    floor = static.parameters + static.optimizer + static.gradients
    return Setup(original, inputs, traced, measured, floor, measured.reference.peak_bytes - floor)


def quality_table(size: str, pairs: int, with_compile: bool, with_fixed_modes: bool) -> None:
    config, batch, seq = SIZES[size]
    made = setup(size)
    original, inputs, floor, activations = made.original, made.inputs, made.floor, made.activations
    print(f"Llama-style {config.n_layers} layers, d={config.dim}, ffn {config.ffn_dim}, vocab {config.vocab_size}, "
          f"batch {batch}×{seq}, fp32, AdamW; static {format_bytes(floor)}, activations {format_bytes(activations)} "
          f"(simulated); {pairs} alternating pairs, 1 thread")
    plain_flops = flops_of(copy.deepcopy(original), inputs)
    every_layer = {u: Choice("full") for u in find_units(original)}
    configs = [Config("no plan", {}), Config("checkpoint every layer (full)", every_layer)]
    plans = {}
    for fraction in (0.5, 0.25):
        budget = floor + int(fraction * activations)
        variants = [("autoplan", {}), ("autoplan, loss as written", {"fuse_loss": False})]
        variants += [("autoplan, 3 fixed modes", {"menu_size": 0})] if with_fixed_modes else []
        for label, options in variants:
            started = time.perf_counter()
            plan = _plan(original, budget, inputs, **options)
            print(f"  planned {label} at static + {fraction:.0%} in {time.perf_counter() - started:.0f} s: "
                  f"{', '.join(f'{n}× {c}' for c, n in Counter(str(d.choice) for d in plan.decisions.units).items())}"
                  + (f"; fused loss ({plan.decisions.fused_logits})" if plan.decisions.fused_loss else ""))
            configs.append(Config(f"{label} at static + {fraction:.0%}", plan.decisions.choices_by_unit() if plan.outcome.feasible else None, budget,
                                  fused_loss=plan.decisions.fused_loss))
        if with_compile:
            plan = _plan(original, budget, inputs, compile=True)
            print(f"  planned autoplan compile=True at static + {fraction:.0%}: "
                  f"{', '.join(f'{n}× {c}' for c, n in Counter(str(d.choice) for d in plan.decisions.units).items())}")
            plans[fraction] = plan.decisions.choices_by_unit() if plan.outcome.feasible else None
        started = time.perf_counter()
        sac = auto_sac_choices(config, inputs, budget)
        print(f"  planned torch auto-SAC at static + {fraction:.0%} in {time.perf_counter() - started:.0f} s: "
              + ("nothing fits" if sac is None else "; ".join(f"{unit} saves {len(c.saves)} ops" for unit, c in sac.items()) or "nothing checkpointed"))
        configs.append(Config(f"torch auto-SAC at static + {fraction:.0%}", sac, budget))
    if with_compile:
        configs += [Config(f"torch.compile, activation_memory_budget {knob}", {}, None, knob) for knob in (1.0, 0.5, 0.25)]
        configs += [Config(f"autoplan (compile=True) at static + {fraction:.0%}, compiled", plans[fraction],
                           floor + int(fraction * activations), 1.0) for fraction in (0.5, 0.25)]
    rows = [measure_row(entry, original, inputs, plain_flops, pairs) for entry in configs if entry.choices is not None]
    for entry in configs:
        if entry.choices is None:
            print(f"  {entry.label}: no plan fits")
    print("\n| config | budget | peak (live tensors) | peak (RSS rise) | step time vs no plan | extra FLOPs |\n|---|---|---|---|---|---|")
    for row in rows:
        budget = format_bytes(row.budget_bytes) if row.budget_bytes else "—"
        live = format_bytes(row.peak_bytes) if row.peak_bytes else "n/a (compiled)"
        print(f"| {row.config} | {budget} | {live} | {format_bytes(row.rss_peak_bytes)} | {row.time_ratio:.2f}× | {row.extra_flops:+.1%} |")


def measure_row(entry: Config, original, inputs, plain_flops: int, pairs: int) -> Row:
    model = copy.deepcopy(original)
    apply_choices(model, entry.choices, OutsideUnits(fused_loss=entry.fused_loss))
    if entry.compile_budget is None:
        return Row(entry.label, peak_of(copy.deepcopy(model), inputs), time_ratio(copy.deepcopy(original), model, inputs, pairs),
                   flops_of(copy.deepcopy(model), inputs) / plain_flops - 1, entry.budget_bytes, rss_peak_of(copy.deepcopy(model), inputs))
    torch._dynamo.reset()
    COMPILED_FLOPS.clear()
    with torch._functorch.config.patch(activation_memory_budget=entry.compile_budget):
        compiled = torch.compile(model)
        rss = rss_peak_of(compiled, inputs)  # its first step compiles the forward and backward graphs
    return Row(entry.label, 0, time_ratio(copy.deepcopy(original), compiled, inputs, pairs),
               sum(COMPILED_FLOPS) / plain_flops - 1, entry.budget_bytes, rss)


def _plan(model, budget, inputs, **options):
    """autoplan's plan for `budget` (options: menu_size=0 for the three fixed modes only, fuse_loss=False, compile=True)."""
    return autoplan.plan(model, budget, example_inputs=inputs, device="cpu", precision="fp32", reserve=0, **options)


def solve_times() -> None:
    print("\nILP solve time, fp32|bf16 × keep|selective|full and each unit's menu (GPT blocks 64 wide, batch 1×64;\n"
          "budget halfway between the lowest reachable peak and no plan; profiling not timed)")
    print(f"{'units':>6} {'budget':>12} {'status':>10} {'solve s':>8}")
    for layers in (24, 96, 384):
        model, inputs = build(n_layer=layers, n_embd=64, n_head=2, block_size=64, vocab_size=128, batch_size=1, seq_len=64)
        measured = profile(trace(model, inputs), DEVICE, precisions=("fp32", "bf16"))
        lowest = predict_peak(measured, minimum_peak(measured, SolveRequest(Budget(1, 0, "any"))).choices).bytes
        budget = (lowest + measured.reference.peak_bytes) // 2  # halfway: a real trade-off to solve
        started = time.perf_counter()
        solution = solve(measured, SolveRequest(Budget(budget, 0, f"{budget}B")))
        print(f"{layers:>6} {format_bytes(budget):>12} {solution.status:>10} {time.perf_counter() - started:>8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="small: a few minutes; issue: the issue's model, about 20 minutes")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--skip-solve-times", action="store_true")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows (each compiles the model)")
    parser.add_argument("--fixed-modes", action="store_true", help="add autoplan's rows with the menu off (keep/selective/full only)")
    options = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # rss_peak_of needs it from the process's start
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    torch.set_num_threads(1)
    import torch._inductor.config

    torch._inductor.config.post_grad_custom_pre_pass = _count_graph_flops
    print(f"machine: {describe_machine()}; plans for the cpu device profile; command: python benchmarks/plan_quality.py "
          f"{' '.join(sys.argv[1:])}\n")
    quality_table(options.size, options.pairs, not options.no_compile, options.fixed_modes)
    if not options.skip_solve_times:
        solve_times()
