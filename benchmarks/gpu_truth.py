"""GPU truth in one call: what a real CUDA device holds, next to what autoplan plans for it.

Made for the few minutes of GPU a session may be lent (issues 38 and 43). Each part runs in its own
process with its own time limit, writes its figures as JSON under the output folder, and a failure in
one part is written down and does not stop the others:

- ``context``: what the CUDA context takes beyond torch's reserved memory (NVML's used memory less
  reserved), lazy and eager module loading, after the first cuBLAS, cuDNN and attention calls.
- ``saved``: what each op's CUDA kernel saves for backward (storages, dtypes, bytes), beside the CPU
  kernel's, in fp32 and under bf16 autocast: dropout's mask, attention's statistics, norms.
- ``bert``: bert-large (seq 512) trained as the transformers page "efficient training on a single GPU"
  trains it, nine configurations: allocated, reserved and NVML's used peak, and the caching
  allocator's own trace of one step (``traces.json.gz``) for modelling reserved memory offline.
- ``verify``: ``autoplan.verify`` of planned models on the GPU (the example GPT at GPT-2 small size, a
  transformers Llama at 2×2048 in bf16, a ResNet-50, a 4-bit QLoRA Llama) at the budget halfway between
  floor and no plan, and the unconstrained plan's step beside the planned one.
- ``tests``: the tests that need CUDA.
- ``bert_expandable``: three of bert's configurations with ``expandable_segments:True``.
- ``verify_expandable``: the verify part with ``expandable_segments:True``.
- ``capped``: the least memory limit (`set_per_process_memory_fraction`) each verify model's planned step
  runs under, against the plan's `least_limit_bytes` (benchmarks/gpu_capped.py).
- ``allocator_fit``: at a budget between a plan's allocated peak and its least limit, that plan and the one
  autoplan makes now, each verified with the budget enforced (benchmarks/gpu_capped.py).
- ``blame``: for each verify model, allocated memory phase by phase of a real step and the blocks alive at
  its peak with the Python line that allocated them, next to the plan's own JSON.

    python benchmarks/gpu_truth.py --out DIR [--parts context,saved,...] [--budget-s 420]
    python benchmarks/gpu_truth.py --smoke --out DIR   # the same code on this CPU, tiny sizes
    python benchmarks/gpu_truth.py --tables benchmarks/results/h100_2026-11-27   # the tables of a run kept here

On a lent GPU the device tool's command was (pulp, highspy and bitsandbytes carried as unpacked wheels
in `.site`, which `.git/info/exclude` ignores):
``export PYTHONPATH=$PWD/.site:$PWD; python3 benchmarks/gpu_truth.py --out /tmp/gt --budget-s 500``.

Nothing is downloaded: every model is built from a config with random weights.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"context": 40, "saved": 60, "bert": 100, "verify": 220, "tests": 50, "bert_expandable": 40, "blame": 240,
         "verify_expandable": 220, "capped": 300, "capped_trace": 200, "allocator_fit": 240}  # seconds each may take
PART_ENV = {"bert_expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
            "verify_expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_truth_out")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--budget-s", type=float, default=440.0, help="all parts together")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the code runs")
    parser.add_argument("--tables", help="print the tables of a folder of results (benchmarks/results/...) and stop")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # a child process runs one part
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part:
        from benchmarks import gpu_blame, gpu_capped, gpu_parts, gpu_training
        module = next(m for m in (gpu_parts, gpu_training, gpu_blame, gpu_capped) if hasattr(m, f"part_{args.part}"))
        getattr(module, f"part_{args.part}")(out, args.smoke)
        return
    if args.tables:
        from benchmarks import gpu_parts
        print(gpu_parts.tables(Path(args.tables)))
        return
    start = time.monotonic()
    for part in args.parts.split(","):
        left = args.budget_s - (time.monotonic() - start)
        limit = min(PARTS[part], left)
        if limit < 10:
            from benchmarks.gpu_training import write_json
            write_json(out, f"{part}.error", {"error": f"skipped: {left:.0f} s left of the call's budget"})
            continue
        command = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--out", str(out)]
        command += ["--smoke"] if args.smoke else []
        began = time.monotonic()
        try:
            done = subprocess.run(command, cwd=ROOT, timeout=limit, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **PART_ENV.get(part, {})})
            status = f"rc {done.returncode}"
            log = done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            status = f"timed out after {limit:.0f} s"
            log = _text(expired.stdout) + _text(expired.stderr)
        (out / f"{part}.log").write_text(log)
        print(f"== {part}: {status} in {time.monotonic() - began:.0f} s", flush=True)
        if status != "rc 0":
            print(log[-2500:], flush=True)
    from benchmarks import gpu_parts
    print(gpu_parts.tables(out))


def _text(value: bytes | str | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
