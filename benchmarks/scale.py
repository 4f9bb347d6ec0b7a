"""Planning time and peak RAM for Llama-style models built on the meta device (no weights).

    python benchmarks/scale.py                 # 1b, 8b and 70b, batch 1 × 8192, 8 × h100-80gb
    python benchmarks/scale.py 70b --world-size auto                   # tensor-parallel degrees searched too
    python benchmarks/scale.py 70b --world-size auto --tensor-parallel 1  # FSDP alone
    python benchmarks/scale.py hf:llama-3-70b hf:llama-3-8b --world-size 1 --seq-len 4096   # the command line's presets

Each configuration is planned in a fresh process, timed with /usr/bin/time -v (wall clock and
maximum resident set size) when it is there, else with the process's own clock and ru_maxrss.
A bare name is examples/llama.py's plain-PyTorch Llama planned by `autoplan.plan` (its "plan s" is
that call alone); an `hf:` name is the transformers model `autoplan plan hf:NAME ... --json -` plans,
the whole command timed as a user waits for it (import, config, planning, report and advice).
It prints one row per model and the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import torch, autoplan
from examples.llama import LlamaConfig, build_on_meta
model, batch = build_on_meta(LlamaConfig.preset({preset!r}), {batch}, {seq})
world = {world!r}
degree = {degree!r}
started = time.perf_counter()
plan = autoplan.plan(model, {budget!r}, example_inputs=batch, device={device!r}, world_size=world,
                     **({{}} if degree is None else {{"tensor_parallel": degree}}))
print(json.dumps({{"seconds": time.perf_counter() - started, "parameters": plan.model.parameter_count,
    "world_size": plan.request.world_size, "tensor_parallel": plan.request.mesh.tensor_parallel,
    "feasible": plan.outcome.feasible, "peak": plan.prediction.peak_bytes,
    "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
"""


def run(preset: str, args) -> dict:
    if preset.startswith("hf:"):
        return _timed(_command_line(preset, args), preset, lambda stdout: _row_of_plan(json.loads(stdout)))
    world = args.world_size if args.world_size == "auto" else int(args.world_size)
    degree = None if args.tensor_parallel is None else (args.tensor_parallel if args.tensor_parallel == "auto" else int(args.tensor_parallel))
    code = CHILD.format(root=ROOT, preset=preset, batch=args.batch_size, seq=args.seq_len, world=world,
                        budget=args.budget, device=args.device, degree=degree)
    return _timed([sys.executable, "-c", code], preset, lambda stdout: json.loads(stdout.strip().splitlines()[-1]))


def _command_line(preset: str, args) -> list[str]:
    return [sys.executable, "-c", "from autoplan.cli.main import run; run()", "plan", preset, "--budget", args.budget, "--device", args.device,
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--world-size", str(args.world_size),
            *(["--tensor-parallel", args.tensor_parallel] if args.tensor_parallel is not None else []), "--json", "-"]


def _row_of_plan(document: dict) -> dict:
    """The row's fields from `autoplan plan --json -`'s document."""
    plan = document["plan"]
    return {"seconds": None, "parameters": plan["parameter_count"], "world_size": plan["world_size"],
            "tensor_parallel": plan.get("tensor_parallel", 1), "feasible": plan["feasible"], "peak": plan["predicted_peak_bytes"]}


def _timed(command: list[str], preset: str, read_row: Callable[[str], dict]) -> dict:
    """`command` run under /usr/bin/time -v where there is one: the row `read_row` makes of its stdout, its wall and RSS."""
    timed = os.path.exists("/usr/bin/time")
    started = time.perf_counter()
    result = subprocess.run((["/usr/bin/time", "-v"] if timed else []) + command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode not in (0, 3):  # 3: the command line's "does not fit", a verdict
        raise SystemExit(f"{preset}: planning failed:\n{result.stderr[-3000:]}")
    row = read_row(result.stdout)
    row["wall_s"] = wall
    if timed:
        row["maxrss_kb"] = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr)[1])
    return row


def llama_arguments(parser: argparse.ArgumentParser, presets: list[str], seq_len: int) -> None:
    """The Llama presets to plan and the batch and device they are planned for (benchmarks/sweep.py too)."""
    parser.add_argument("presets", nargs="*", default=presets)
    parser.add_argument("--device", default="h100-80gb")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    llama_arguments(parser, ["1b", "8b", "70b"], seq_len=8192)
    parser.add_argument("--world-size", default="8")
    parser.add_argument("--budget", default="80GB")
    parser.add_argument("--tensor-parallel", default=None, help="N, auto or 1 (FSDP alone); left out: autoplan's default "
                        "(the degree searched under --world-size auto)")
    args = parser.parse_args()
    from machine import describe_machine  # imports torch, which this process otherwise leaves to its children

    print(f"machine: {describe_machine()}; planning batch {args.batch_size} × {args.seq_len} for {args.world_size} × {args.device}, "
          f"budget {args.budget} per GPU")
    print(f"{'model':>16} {'parameters':>11} {'world size':>10} {'fits':>5} {'peak/GPU':>9} {'plan s':>7} {'wall s':>7} {'max RSS':>8}")
    for preset in args.presets:
        row = run(preset, args)
        planned = "-" if row["seconds"] is None else f"{row['seconds']:.1f}"
        world = f"{row['world_size']}" + (f" tp{row['tensor_parallel']}" if row.get("tensor_parallel", 1) > 1 else "")
        print(f"{preset:>16} {row['parameters'] / 1e9:>10.2f}B {world:>10} {'yes' if row['feasible'] else 'no':>5} "
              f"{row['peak'] / 1e9:>7.1f}GB {planned:>7} {row['wall_s']:>7.1f} {row['maxrss_kb'] / 2**20:>6.2f}GiB", flush=True)


if __name__ == "__main__":
    main()
