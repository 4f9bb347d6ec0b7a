"""The `capped` part of `benchmarks/gpu_truth.py`: the least memory limit a planned step runs under.

Near the card's limit the caching allocator does not stop at what it would reserve with room to spare:
when a request would pass the limit it gives back every cached segment none of whose bytes are in use
and asks again, so a step can run in less than its free-running reserved peak, down to where the free
space left inside segments still in use is too scattered for a request. autoplan predicts that least
limit by replaying the simulated step through its model of the allocator under a limit
(`plan.prediction.least_limit_bytes`). Here the same limit is found on the GPU: for each model, the plan
at the budget halfway between floor and no plan is verified (3 real steps) under
`torch.cuda.set_per_process_memory_fraction`, the limit halved between a failing one (below the allocated
peak) and a running one (the free-running reserved peak) down to 2 MiB, as
`instruments.caching_allocator.least_limit_bytes` halves it on the replay.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.gpu_training import _device, chosen_models, mib, write_json

RESOLUTION = 2 << 20  # as least_limit_bytes searches


def _verify_under(model, plan, batch, limit: int | None) -> Any:
    """autoplan.verify's three steps with the process's memory limited to `limit` bytes (None: the whole card)."""
    import autoplan
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if limit is None else min(1.0, limit / total), 0)
    torch.cuda.reset_peak_memory_stats(0)
    retries_before = torch.cuda.memory_stats(0).get("num_alloc_retries", 0)
    try:
        result = autoplan.verify(model, plan, example_inputs=batch, steps=3, enforce_budget=False)
        # verify's figures are from step 2 on; the limit holds from step 1, so the whole run's peaks are read here
        whole = {"allocated": torch.cuda.max_memory_allocated(0), "reserved": torch.cuda.max_memory_reserved(0),
                 "retries": torch.cuda.memory_stats(0).get("num_alloc_retries", 0) - retries_before}
        return result, whole
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


def _least_measured(model, plan, batch) -> dict:
    """The least limit the real steps run under, halved between a failing and a running one."""
    free, whole = _verify_under(model, plan, batch, None)
    low, high = whole["allocated"] - 1, whole["reserved"]
    probes = [{"limit": None, "ran": not free.out_of_memory, **whole}]
    while high - low > RESOLUTION:
        middle = (low + high) // 2
        result, seen = _verify_under(model, plan, batch, middle)
        probes.append({"limit": middle, "ran": not result.out_of_memory, **seen})
        if result.out_of_memory:
            low = middle
        else:
            high = middle
    return {"least": high, "allocated": whole["allocated"], "reserved": whole["reserved"], "probes": probes}


def _capped_one(build: Callable, device: torch.device, smoke: bool) -> dict:
    import autoplan
    model, batch, options = build(device, smoke)
    began = time.perf_counter()
    planner = autoplan.Planner(model, example_inputs=batch, reserve=0, **options)
    roomy = planner.plan("90%")
    low, high = roomy.prediction.minimum_peak_bytes, roomy.prediction.baseline_peak_bytes
    plan = planner.plan((low + high) // 2)
    row: dict[str, Any] = {"planning_s": time.perf_counter() - began, "predicted_peak": plan.prediction.peak_bytes,
                           "predicted_reserved": plan.prediction.reserved_peak_bytes,
                           "predicted_least": plan.prediction.least_limit_bytes}
    began = time.perf_counter()
    row["measured"] = _least_measured(model, plan, batch)
    row["search_s"] = time.perf_counter() - began
    return row


def _each_model(out: Path, smoke: bool, name: str, one: Callable[[Callable, torch.device, bool], dict]) -> None:
    """`one(build, device, smoke)` for every chosen model, a failure written as that model's row; the JSON after each."""
    device = _device(smoke)
    rows: dict[str, Any] = {}
    for model_name, build in chosen_models(smoke).items():
        try:
            rows[model_name] = one(build, device, smoke)
        except Exception as error:
            import traceback
            rows[model_name] = {"error": f"{type(error).__name__}: {error}"[:600], "where": traceback.format_exc()[-1500:]}
        write_json(out, name, rows)


def part_capped(out: Path, smoke: bool) -> None:
    device = _device(smoke)
    if device.type != "cuda":  # the limit is CUDA's; the smoke run checks the planning half only
        for name, build in list(chosen_models(smoke).items())[:1]:
            import autoplan
            model, batch, options = build(device, smoke)
            plan = autoplan.plan(model, "90%", example_inputs=batch, reserve=0, **options)
            write_json(out, "capped", {name: {"smoke": True, "feasible": plan.feasible}})
        return
    _each_model(out, smoke, "capped", _capped_one)


def capped_table(out: Path) -> list[str]:
    path = out / "capped.json"
    if not path.exists():
        return []
    lines = ["\n### The least memory limit a planned step runs under (MiB, 2 MiB resolution, budget halfway floor–no plan)",
             "| model | predicted peak | measured allocated | predicted reserved | measured reserved | predicted least limit | "
             "measured least limit | error | probes |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in json.loads(path.read_text()).items():
        if "error" in row or "smoke" in row:
            lines.append(f"| {name} | {row.get('error', 'smoke run')[:200]} |")
            continue
        measured, guess = row["measured"], row["predicted_least"]
        error = f"{(guess - measured['least']) / measured['least']:+.2%}" if guess else "-"
        lines.append(f"| {name} | {mib(row['predicted_peak'])} | {mib(measured['allocated'])} | {mib(row['predicted_reserved'])} | "
                     f"{mib(measured['reserved'])} | {mib(guess)} | {mib(measured['least'])} | {error} | {len(measured['probes'])} |")
    return lines


def part_capped_trace(out: Path, smoke: bool) -> None:
    """The caching allocator's own trace of each model's free-running steps, and of one run under a limit just
    below its reserved peak (its out-of-memory event included), for `benchmarks/allocator_replay.py` to replay
    the real request sequence under limits offline. GPU_TRUTH_MODELS picks the models."""
    import gzip

    import autoplan
    from benchmarks.gpu_training import _Trace
    device = _device(smoke)
    traces: dict[str, Any] = {}
    for name, build in chosen_models(smoke).items():
        model, batch, options = build(device, smoke)
        planner = autoplan.Planner(model, example_inputs=batch, reserve=0, **options)
        roomy = planner.plan("90%")
        plan = planner.plan((roomy.prediction.minimum_peak_bytes + roomy.prediction.baseline_peak_bytes) // 2)
        runs = {}
        for label, below in (("free", None), ("limited", 100 << 20)):
            limit = None if below is None else plan.prediction.reserved_peak_bytes - below
            with _Trace(device) as trace:
                result, whole = _verify_under(model, plan, batch, limit) if device.type == "cuda" else (None, {})
            runs[label] = {"limit": limit, "ran": result is None or not result.out_of_memory, **whole, "events": trace.events}
        traces[name] = {"predicted_reserved": plan.prediction.reserved_peak_bytes,
                        "predicted_least": plan.prediction.least_limit_bytes, **runs}
        with gzip.open(out / "capped_traces.json.gz", "wt") as file:
            json.dump(traces, file)


def part_allocator_fit(out: Path, smoke: bool) -> None:
    """A budget between a plan's allocated peak and its least limit (reserve=0): the plan that fits by allocated
    bytes alone, verified under that budget (`set_per_process_memory_fraction`), against the plan autoplan makes
    for it now, which leaves the caching allocator its least limit."""
    _each_model(out, smoke, "allocator_fit", _allocator_fit_one)


def _allocator_fit_one(build: Callable, device: torch.device, smoke: bool) -> dict:
    import dataclasses

    import autoplan
    model, batch, options = build(device, smoke)
    planner = autoplan.Planner(model, example_inputs=batch, reserve=0, **options)
    roomy = planner.plan("90%")
    over = planner.plan((roomy.prediction.minimum_peak_bytes + roomy.prediction.baseline_peak_bytes) // 2)
    budget = (over.prediction.peak_bytes + over.prediction.least_limit_bytes) // 2
    # the plan an allocated-only rule keeps at this budget: its peak fits, its allocator does not
    over = dataclasses.replace(over, request=dataclasses.replace(over.request, budget_bytes=budget, usable_bytes=budget))
    now = planner.plan(budget)
    runs = {label: autoplan.verify(model, plan, example_inputs=batch, steps=3, enforce_budget=device.type == "cuda")
            for label, plan in (("allocated_only", over), ("now", now))}
    return {"budget": budget, "allocated_only": {"peak": over.prediction.peak_bytes, "least": over.prediction.least_limit_bytes},
            "now": {"feasible": now.feasible, "peak": now.prediction.peak_bytes, "least": now.prediction.least_limit_bytes,
                    "noted": any("a faster plan fits by its allocated peak" in note for note in now.notes)},
            **{f"{label}_run": {"out_of_memory": run.out_of_memory, "held": run.held, "measured": run.measured_peak_bytes,
                                "reserved": run.measured_reserved_bytes} for label, run in runs.items()}}


def allocator_fit_table(out: Path) -> list[str]:
    path = out / "allocator_fit.json"
    if not path.exists():
        return []
    lines = ["\n### A budget between a plan's allocated peak and its least limit, enforced (MiB, reserve=0)",
             "| model | budget | allocated-only plan: peak / least | its run | plan now: peak / least | its run |", "|---|---|---|---|---|---|"]
    for name, row in json.loads(path.read_text()).items():
        if "error" in row:
            lines.append(f"| {name} | {row['error'][:200]} |")
            continue
        def said(run: dict) -> str:
            return "out of memory" if run["out_of_memory"] else f"ran, allocated {mib(run['measured'])}, reserved {mib(run['reserved'])}"
        old, now = row["allocated_only"], row["now"]
        lines.append(f"| {name} | {mib(row['budget'])} | {mib(old['peak'])} / {mib(old['least'])} | {said(row['allocated_only_run'])} | "
                     f"{mib(now['peak'])} / {mib(now['least'])}{'' if now['feasible'] else ' (DOES NOT FIT)'} | {said(row['now_run'])} |")
    return lines
