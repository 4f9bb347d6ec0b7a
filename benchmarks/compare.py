"""autoplan against what people use today: measured peak memory and step time per configuration.

For a GPT-2-medium-sized model (plain PyTorch, examples/gpt.py) and a Llama-style model
(transformers' LlamaConfig, random weights), at a ladder of budgets (fractions of the bf16 step's
activation memory), measures real training steps of:

    fp32 eager · bf16 autocast · bf16 + checkpoint every block · bf16 + torch.compile ·
    torch.compile with activation_memory_budget tuned to autoplan's peak ·
    autoplan's plan at the budget (eager, and under torch.compile)

and prints one table per model: configuration, budget, measured peak, step time, slowdown against
the fastest configuration that ignores memory, and whether the peak fits the budget.

    python benchmarks/compare.py                 # on a GPU: the sizes above
    python benchmarks/compare.py --cpu           # CPU mode: tiny sizes, eager only

On a GPU the peak is torch.cuda.max_memory_allocated() over the timed steps and times are CUDA
events (median of --steps after two warm-up steps). In CPU mode the peak is the CPU allocator's own
count of the timed steps (autoplan/verify/allocator.py, nothing of the simulation's), compiled rows
are skipped, and times are the wall clock: it exercises the code, its times say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402
from autoplan.vocabulary.formatting import format_bytes
from autoplan.plan import Choice  # noqa: E402
from autoplan.planned.forwards import apply_choices
from autoplan.verify.allocator import AllocatorCount
from autoplan.trace.discovery import find_units
from examples.gpt import GPT, GPTConfig  # noqa: E402

FRACTIONS = (1.0, 0.75, 0.5, 0.35)


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.device], dict]


def gpt2_medium(cpu: bool) -> Workload:
    size = dict(n_layer=4, n_embd=128, n_head=4, block_size=128, vocab_size=512) if cpu else dict(
        n_layer=24, n_embd=1024, n_head=16, block_size=1024, vocab_size=50257)
    batch, seq = (4, 128) if cpu else (8, 1024)

    def make_batch(device):
        ids = torch.randint(0, size["vocab_size"], (batch, seq), device=device)
        return {"idx": ids, "targets": ids}

    return Workload(f"GPT ({size['n_layer']}×{size['n_embd']}, batch {batch}×{seq})", lambda: GPT(GPTConfig(**size)), make_batch)


def llama(cpu: bool) -> Workload | None:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    size = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=512) if cpu else dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                                                 num_attention_heads=16, num_key_value_heads=8, vocab_size=32000)
    batch, seq = (4, 128) if cpu else (4, 2048)
    config = LlamaConfig(**size, max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False)

    def make_batch(device):
        ids = torch.randint(0, size["vocab_size"], (batch, seq), device=device)
        return {"input_ids": ids, "labels": ids}

    return Workload(f"Llama ({size['num_hidden_layers']}×{size['hidden_size']}, batch {batch}×{seq})",
                    lambda: LlamaForCausalLM(config), make_batch)


@dataclass(frozen=True)
class Measured:
    peak_bytes: int | None
    step_s: float
    reserved_bytes: int | None = None  # the caching allocator's reserved peak (CUDA): fragmentation = reserved / peak


def loss_of(output) -> torch.Tensor:
    return output.loss if getattr(output, "loss", None) is not None else output[0]


def measure(model: torch.nn.Module, batch: dict, steps: int, autocast: bool) -> Measured:
    """Median step time and peak bytes of `steps` training steps after two warm-up steps."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=cuda)
    precision = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def step():
        with precision:
            loss = loss_of(model(**batch))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # on the CPU, the allocator's own count from before the warm-up (it reports only blocks it saw made)
    count = None if cuda else AllocatorCount(resident=(model, batch, opt))
    with count if count is not None else contextlib.nullcontext():
        for _ in range(2):
            step()
        times = []
        if count is not None:
            count.mark("measured")
        else:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                started = time.perf_counter()
                step()
                times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() if count is None else count.stretches()[-1].peak_bytes
    reserved = torch.cuda.max_memory_reserved() if cuda else None
    return Measured(peak, statistics.median(times), reserved)


def fresh(workload: Workload, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = workload.build().to(device)
    if cuda_available(device):
        torch.cuda.empty_cache()
    return model


def cuda_available(device: torch.device) -> bool:
    return device.type == "cuda"


def checkpoint_every_block(model: torch.nn.Module) -> torch.nn.Module:
    if hasattr(model, "activation_checkpointing_enable"):  # what a Hugging Face user does (transformers 5.x name)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    return apply_choices(model, {unit: Choice("full", "fp32") for unit in find_units(model)})


def compiled_with_budget(model: torch.nn.Module, fraction: float) -> torch.nn.Module:
    torch._dynamo.reset()
    torch._functorch.config.activation_memory_budget = fraction
    return torch.compile(model)


@dataclass(frozen=True)
class Row:
    config: str
    budget: int | None  # None: a configuration that ignores memory
    result: Measured | None  # None: nothing fits
    note: str = ""
    predicted_bytes: int | None = None  # autoplan's predicted peak, for its own rows


def rows_for(workload: Workload, device: torch.device, steps: int, with_compile: bool) -> tuple[list[Row], int, Measured]:
    rows: list[Row] = []

    def add(config: str, budget: int | None, result: Measured | None, note: str = "", predicted: int | None = None) -> None:
        rows.append(Row(config, budget, result, note, predicted))

    fp32 = measure(fresh(workload, device), workload.batch(device), steps, autocast=False)
    add("fp32 eager", None, fp32)
    bf16 = measure(fresh(workload, device), workload.batch(device), steps, autocast=True)
    add("bf16 autocast", None, bf16)
    add("bf16 + checkpoint every block", None,
        measure(checkpoint_every_block(fresh(workload, device)), workload.batch(device), steps, autocast=True))
    if with_compile:
        add("bf16 + torch.compile", None,
            measure(compiled_with_budget(fresh(workload, device), 1.0), workload.batch(device), steps, autocast=True))
    model = fresh(workload, device)
    static = sum(p.numel() * p.element_size() for p in model.parameters()) * 4  # weights, grads, AdamW's two states
    activations = max(1, bf16.peak_bytes - static)
    plan_device = None if device.type == "cuda" else "cpu"
    for fraction in FRACTIONS:
        budget = static + int(fraction * activations)
        model = fresh(workload, device)
        # measure() drops the output once the loss is computed: plan for that loop
        plan = autoplan.plan(model, budget, example_inputs=workload.batch(device), device=plan_device, precision="bf16",
                             reserve=0, loop=autoplan.TrainingLoop(keep_outputs=False))
        if not plan.outcome.feasible:
            add(f"autoplan @ {fraction:.0%}", budget, None, f"no plan fits (lowest {format_bytes(plan.prediction.minimum_peak_bytes)})")
            continue
        autoplan.apply(model, plan)
        result = measure(model, workload.batch(device), steps, autocast=False)  # the plan applies autocast
        add(f"autoplan @ {fraction:.0%}", budget, result, f"predicted {format_bytes(plan.prediction.peak_bytes)}",
            plan.prediction.peak_bytes)
        if with_compile:
            add(f"autoplan + compile @ {fraction:.0%}", budget,
                measure(compiled_with_budget(model, 1.0), workload.batch(device), steps, autocast=False))
            add(f"compile activation_memory_budget @ {fraction:.0%}", budget, *tuned_compile(workload, device, steps, budget))
    return rows, static, bf16


def tuned_compile(workload: Workload, device: torch.device, steps: int, budget: int) -> tuple[Measured | None, str]:
    """torch.compile's own knob, bisected to the largest activation_memory_budget whose peak fits."""
    low, high, best = 0.0, 1.0, None
    for _ in range(5):
        middle = (low + high) / 2
        result = measure(compiled_with_budget(fresh(workload, device), middle), workload.batch(device), steps, autocast=True)
        if result.peak_bytes <= budget:
            best, low = (result, middle), middle
        else:
            high = middle
    torch._functorch.config.activation_memory_budget = 1.0
    if best is None:
        return None, "no activation_memory_budget fits"
    return best[0], f"activation_memory_budget={best[1]:.3f}"


def print_table(title: str, rows: list, reference_s: float) -> None:
    print(f"\n{title}")
    print(f"{'configuration':<42} {'budget':>10} {'peak':>10} {'step':>10} {'slowdown':>9} {'fits':>5}  note")
    reserved = [r.result.reserved_bytes / r.result.peak_bytes for r in rows if r.result is not None and r.result.reserved_bytes]
    for row in rows:
        config, budget, result, note = row.config, row.budget, row.result, row.note
        if result is None:
            print(f"{config:<42} {format_bytes(budget) if budget else '':>10} {'—':>10} {'—':>10} {'':>9} {'no':>5}  {note}")
            continue
        fits = "" if budget is None else ("yes" if result.peak_bytes <= budget else "no")
        print(f"{config:<42} {format_bytes(budget) if budget else '—':>10} {format_bytes(result.peak_bytes):>10} "
              f"{result.step_s * 1e3:>8.1f}ms {result.step_s / reference_s - 1:>+8.1%} {fits:>5}  {note}")
    if reserved:  # what calibrates autoplan's fragmentation allowance
        print(f"allocator reserved / allocated peak: median {statistics.median(reserved):.3f}, max {max(reserved):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU mode: tiny sizes, eager only (also the default without CUDA)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (after two warm-up steps)")
    args = parser.parse_args()
    cpu = args.cpu or not torch.cuda.is_available()
    device = torch.device("cpu" if cpu else "cuda")
    if not cpu:
        torch.backends.cuda.matmul.allow_tf32 = True
    print("machine:", describe_machine(device) + ("" if device.type == "cuda" else " · CPU mode (the CPU allocator's count, wall clock)"))
    print("command: python benchmarks/compare.py" + (" --cpu" if args.cpu else "") + f" --steps {args.steps}")
    for workload in filter(None, (gpt2_medium(cpu), llama(cpu))):
        rows, static, bf16 = rows_for(workload, device, args.steps, with_compile=not cpu)
        unconstrained = [r.result.step_s for r in rows if r.budget is None and r.result is not None and "checkpoint" not in r.config]
        print_table(f"{workload.name}: weights+grads+AdamW {format_bytes(static)}, bf16 activations "
                    f"{format_bytes(bf16.peak_bytes - static)}; budgets are static + a fraction of them", rows, min(unconstrained))


if __name__ == "__main__":
    main()
