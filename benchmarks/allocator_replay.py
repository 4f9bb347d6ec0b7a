"""The caching allocator model against the H100's own allocator traces (no GPU needed).

Each kept trace (`torch.cuda.memory._record_memory_history`, recorded by `gpu_truth.py`) lists every
allocation with its requested size and address, every free, and every segment the allocator took
(`segment_alloc`) or gave back (`segment_free`). This replays the allocations and frees, in order,
through `autoplan.instruments.caching_allocator` and compares the model's reserved memory with the
trace's: at its peak, at the end, and how many segments each took. A trace that starts from an empty
cache (the bert runs) is a complete check; one recorded after the model was loaded (the verify runs)
starts with the model's segments unknown (verify empties the cache first, then the steps add theirs), so
only what the steps added is compared there.

    python benchmarks/allocator_replay.py [benchmarks/results/h100_2026-11-27]
"""

from __future__ import annotations

import gzip
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoplan.instruments.caching_allocator import CachingAllocatorModel  # noqa: E402

MIB = 2**20


def replay(events: list, *, expandable: bool) -> dict:
    """The trace's reserved figures and the model's, for one trace."""
    model = CachingAllocatorModel(expandable_segments=expandable)
    blocks: dict[int, object] = {}
    traced = traced_peak = 0
    segments = {"trace": 0, "model": 0}
    before = 0
    unknown_frees = 0
    for action, address, size, _stream in events:
        if action == "alloc":
            reserved = model.reserved_bytes
            blocks[address] = model.malloc(size)
            segments["model"] += model.reserved_bytes > reserved
        elif action == "free_requested":
            if address in blocks:
                model.free(blocks.pop(address))
            else:
                unknown_frees += 1  # allocated before the trace began
        elif action in ("segment_alloc", "segment_map"):
            traced += size
            traced_peak = max(traced_peak, traced)
            segments["trace"] += 1
        elif action in ("segment_free", "segment_unmap"):
            if traced == 0 and not segments["trace"]:
                before += size  # empty_cache of segments from before the trace
                continue
            traced -= size
    return {"trace_peak": traced_peak, "model_peak": model.peak_reserved_bytes, "trace_end": traced,
            "model_end": model.reserved_bytes, "allocated_peak": model.peak_allocated_bytes,
            "segments": segments, "unknown_frees": unknown_frees}


def main(folder: Path) -> None:
    print(f"machine: {platform.node()} ({platform.machine()}), python {platform.python_version()}; traces from {folder}")
    print("| trace | run | allocated peak | reserved peak, H100 | model | error | segments H100 / model | frees of older blocks |")
    print("|---|---|---|---|---|---|---|---|")
    # (the first verify run's traces began with the cache already warm: neither start is known, so it is left out)
    kept = (("bert", False), ("bert_expandable", True), ("verify_after_fixes", False), ("verify_reserved", False),
            ("verify_reserved_expandable", True))
    for name, expandable in kept:
        path = folder / f"{name}_traces.json.gz"
        if not path.exists():
            continue
        for run, events in json.load(gzip.open(path, "rt")).items():
            if not events:
                continue
            r = replay(events, expandable=expandable)
            error = (r["model_peak"] - r["trace_peak"]) / r["trace_peak"] if r["trace_peak"] else 0.0
            print(f"| {name} | {run} | {r['allocated_peak'] / MIB:,.1f} | {r['trace_peak'] / MIB:,.1f} | {r['model_peak'] / MIB:,.1f} | "
                  f"{error:+.2%} | {r['segments']['trace']} / {r['segments']['model']} | {r['unknown_frees']} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks/results/h100_2026-11-27")
