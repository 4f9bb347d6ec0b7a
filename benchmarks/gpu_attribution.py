"""Where the H100's verify peaks came from, read off the kept results (no GPU needed).

For each model of `gpu_truth.py`'s verify part: the measured peak (`max_memory_allocated`, steps 2–4),
what the steps themselves allocated at that peak (the caching allocator's trace of the verify run,
replayed: the optimizer state included), what was allocated before the steps began (the difference),
and the prediction next to the steps' own bytes plus the parameters and batch (which were allocated
before). The parameters come from the blame part's plan of the same model; the batches are the
builders' shapes.

    python benchmarks/gpu_attribution.py [benchmarks/results/h100_2026-11-27] [RUN]

RUN names a later verify run kept beside the first (``after_fixes`` reads ``verify_after_fixes.json`` and
``verify_after_fixes_traces.json.gz``); the parameters are read from the first run's blame part either way.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

MIB = 2**20
# the batches gpu_training.py builds: ids and labels, int64; ResNet-50's images, fp32
BATCH_BYTES = {"transformers Llama 2×2048 bf16": 2 * 2 * 2048 * 8, "example GPT (GPT-2 small) 8×1024": 8 * 1024 * 8,
               "4-bit QLoRA Llama 2×2048": 2 * 2 * 2048 * 8, "ResNet-50 batch 64": 64 * 3 * 224 * 224 * 4}


def steps_peak(events: list) -> int:
    """The most bytes the trace's own allocations held at once."""
    live: dict[int, int] = {}
    total = best = 0
    for action, address, size, _stream in events:
        if action == "alloc":
            live[address] = size
            total += size
            best = max(best, total)
        elif action == "free_requested" and address in live:
            total -= live.pop(address)
    return best


def main(folder: Path, run: str = "") -> None:
    stem = f"verify_{run}" if run else "verify"
    verify = json.loads((folder / f"{stem}.json").read_text())
    blame = json.loads((folder / "blame.json").read_text())
    traces = json.load(gzip.open(folder / f"{stem}_traces.json.gz", "rt"))
    print(f"results: {folder}, {stem} (halfway plans; MiB)")
    print("| model (order run) | measured | steps' own | held before | of it: parameters + batch | predicted | steps' own + parameters + batch | difference |")
    print("|---|---|---|---|---|---|---|---|")
    for order, (name, row) in enumerate(verify.items(), 1):
        measured, predicted = row["halfway"]["measured"], row["halfway"]["predicted"]
        own = steps_peak(traces[name])
        static = blame[name]["plan"]["breakdown"]["parameters"] + BATCH_BYTES[name]
        print(f"| {name} ({order}) | {measured / MIB:,.1f} | {own / MIB:,.1f} | {(measured - own) / MIB:,.1f} | {static / MIB:,.1f} | "
              f"{predicted / MIB:,.1f} | {(own + static) / MIB:,.1f} | {(own + static - predicted) / predicted:+.2%} |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results/h100_2026-11-27"),
         sys.argv[2] if len(sys.argv) > 2 else "")
