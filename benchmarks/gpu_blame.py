"""The blame part of `benchmarks/gpu_truth.py`: where a real CUDA step's peak comes from, next to the plan.

For each model `gpu_training.MODELS` builds, the plan at the budget halfway between floor and no plan
(roofline times, `reserve=0`) is run in a hand-written loop that drops its outputs at the end of each step:
allocated memory before the forward, at the forward's peak, after it, at the backward's peak and the
optimizer's, and, from the caching allocator's history, the blocks alive at the step's peak grouped by
size and the Python line that allocated them (backward's allocations have no Python line).
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_training import _device, chosen_models, write_json


def _phase_peaks(model: Any, batch: Any, plan: Any, device: torch.device, steps: int = 3) -> list[dict]:
    """Per step: allocated before the forward, the forward's peak, after it, the backward's peak, the step's."""
    import autoplan
    from autoplan.training.step_parts import default_loss
    autoplan.apply(model, plan)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    rows = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(steps):
        sync()
        start = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        output = model(**batch) if isinstance(batch, dict) else model(*batch)
        loss = default_loss(output)
        sync()
        forward = (torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()) if device.type == "cuda" else (0, 0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        loss.backward()
        sync()
        backward = (torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()) if device.type == "cuda" else (0, 0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del output, loss
        sync()
        step = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
        rows.append({"start": start, "forward_peak": forward[0], "after_forward": forward[1],
                     "backward_peak": backward[0], "after_backward": backward[1], "optimizer_peak": step})
    autoplan.remove_plan(model)
    return rows


def _live_at_peak(device: torch.device, events: list) -> list:
    """The blocks alive when the trace's allocated bytes peaked, grouped by size and the allocating Python line."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    at_best: list = []
    for action, addr, size, where in events:
        if action == "alloc":
            live[addr] = (size, where)
            total += size
            if total > best:
                best, at_best = total, list(live.values())
        elif action in ("free_requested", "free") and addr in live:
            total -= live.pop(addr)[0]
    groups: dict[tuple[int, str], int] = {}
    for size, where in at_best:
        groups[(size, where)] = groups.get((size, where), 0) + 1
    return sorted(([size, count, where] for (size, where), count in groups.items()), key=lambda r: -r[0] * r[1])[:60]


def _where(frames: list) -> str:
    inside = [f for f in frames if "/torch/" not in f["filename"]]
    pick = inside[:2] or frames[:1]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in pick)


def part_blame(out: Path, smoke: bool) -> None:
    import autoplan
    device = _device(smoke)
    rows: dict[str, Any] = {}
    for name, build in chosen_models(smoke).items():
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            model, batch, options = build(device, smoke)
            planner = autoplan.Planner(model, example_inputs=batch, device=None if device.type == "cuda" else "cpu",
                                       reserve=0, profile="roofline", **options)
            roomy = planner.plan("90%")
            plan = planner.plan((roomy.prediction.minimum_peak_bytes + roomy.prediction.baseline_peak_bytes) // 2)
            rows[name] = {"plan": json.loads(plan.to_json()), "phases": _phase_peaks(model, batch, plan, device)}
            write_json(out, "blame", rows)
            if device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc", stacks="python")
                _phase_peaks(model, batch, plan, device, steps=2)
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(None)
                events = [(e["action"], e["addr"], e["size"], _where(e.get("frames", [])))
                          for e in snapshot["device_traces"][0]]
                rows[name]["live_at_peak"] = _live_at_peak(device, events)
        except Exception as error:
            import traceback
            rows[name] = {**rows.get(name, {}), "error": f"{type(error).__name__}: {error}"[:600], "where": traceback.format_exc()[-1500:]}
        write_json(out, "blame", rows)
        del model
