"""The same inputs give the same plans: the zoo planned now equals the zoo planned before a refactoring.

`tests/end_to_end/plans_before.json` holds, for every model of `tests/models.py` (ALL_MODELS) and
every structure of `tests/structures.py` (the compile case recorded again 2026-11-29, when a compile plan's whole step
came to be priced as compiled: its three plans' step times 0.38 of before, their choices as they were), the plans made after a unit's profile stopped counting its own backward root
(the two FSDP cases recorded again 2026-11-29, when a phase's start became a moment of its own on a mesh,
`memory.sharded.on_rank`: their per-rank peaks 0.3-0.6% lower, and three of their plans recompute less)
and gradient seed in its forward (1,024 B on a keep unit; 2026-11-28: 8 plans chose other units at the same feasibility,
four peaks moved by 1-11 KiB, the notes of issue 39 added); before that after the commit that fits GPU plans to the caching
allocator's least limit (the JSON's least_limit_bytes; a GPU plan whose allocator needs more than the budget less the
context is solved again, and the floor counts it; the halfway and under-the-floor budgets are taken from the
floor budget and, on a GPU, what the roomy plan's allocator needs (tests/halfway.py), as CPU budgets always were);
before that after commit cf7e053 (the JSON's reserved_peak_bytes, GPU plans'
note where the caching allocator's predicted reserved memory is above the budget, and again after 8ebb2bb as that note
left infeasible plans; no choice, peak or time changed); before
that at e857b23 (GPU targets hold cuBLAS's workspaces, 8.5 MB on the a100-80gb: every GPU
peak that much higher, budgets made from them too, and the FSDP "auto" case's 7.1 MB per rank no longer fits them
at any world size; at 1b25ad1 dropout's 1-byte mask and matmul operand copies; before that at 56dc43f;
first recorded at b821f0e, before the options schema, the request value and the choice-axis modules): on the CPU at a budget halfway between
the lowest peak and no plan and below the lowest peak, and for a GPU target (a100-80gb, offload
allowed, bf16 per unit); a few models also under FSDP (world_size 2 and "auto"), with pins, a
forced precision, compile pricing and the loss as written. Each plan is held as a digest of
`plan.to_dict()` less its wall times (every field counts), beside what a failure names first: whether
it fits, its peaks and step time, and each unit's choice. A change that means to change plans records
the fixture again and says why:

    python -m tests.end_to_end.test_same_plans            # rewrites plans_before.json
    python -m tests.end_to_end.test_same_plans "CASE" ...  # those cases only

The CPU cases depend on the CPU too: a CPU target's plans count the scratch its kernels hold, read off real calls
(`instruments.cpu_scratch`), and an AVX512-BF16 CPU's oneDNN packs bf16 matmul operands where another's does not, which
moves peaks, times and choices (and the stacked LSTM's bf16 kernel, run for real even for a GPU target, exists on some
CPUs only). plans_before.json holds them as the machine that recorded it (and CI) plans them; a machine whose CPU kernels
differ (`cpu_kernels()`) may hold its own CPU-dependent cases beside it, in plans_before.cpu-<its kernels' digest>.json,
compared instead there:

    python -m tests.end_to_end.test_same_plans --this-cpu  # this machine's CPU cases, recorded from autoplan as it is
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import autoplan
from autoplan.errors import ProfileError, TraceError
from autoplan.plan import CPU_PRECISION_NOTE
from tests.halfway import halfway_budget
from tests.models import ALL_MODELS
from tests.structures import STRUCTURES

FIXTURE = Path(__file__).with_name("plans_before.json")
ROOT = Path(__file__).resolve().parents[2]
WALL_TIMES = ("solve_time_s",)  # the only fields a second run on the same machine may change
# keys to_dict() gained after the fixture was recorded, with the value they would have had in every recorded plan: at
# that value the digest leaves them out, so the recorded digests still hold (Outcome.decided_by: solve.states_bound)
# (a dotted key is one inside a nested object: TrainingLoop's and MemoryBreakdown's fields added for issue 37)
ADDED_SINCE = {"decided_by": "simulation", "breakdown.loop_held": 0, "loop.zero_grad_before_backward": False,
               "loop.fetches_whole_step": False, "loop.batches_ahead": 0, "loop.kept_on_device_bytes": 0,
               "loop.outer_autocast": None, "context_bytes": 0, "context_source": "", "reshard_after_forward": True, "fsdp_mixed_precision": None,
               "tensor_parallel": 1, "tensor_parallel_layout": [], "sequence_parallel": False}
NOTES_ADDED_SINCE = (CPU_PRECISION_NOTE,)  # notes added since the fixture (a CPU plan's bf16 units, solve.assemble): left out
HOST_BUDGET = "1GB"  # given, not this machine's RAM: the fixture holds on any machine
GPU = "a100-80gb"
THREADS = 1  # as every test under pytest-xdist runs (tests/conftest.py)

Build = Callable[[], tuple[Any, Any]]


def _zoo() -> dict[str, Build]:
    zoo: dict[str, Build] = {f"models:{name}": build for name, build in sorted(ALL_MODELS.items())}
    zoo |= {f"structures:{s.name}": s.build for s in STRUCTURES}
    return zoo


def _inputs(example: Any) -> dict[str, Any]:
    """A builder's inputs as plan()'s example_inputs (a dict of keyword arguments stays one)."""
    return {"example_inputs": example}


def _comparable(plan: autoplan.Plan) -> dict[str, Any]:
    """The plan's digest (its whole JSON document but the wall times), and the figures a failure names."""
    document = plan.to_dict()
    for key in WALL_TIMES:
        document.pop(key)
    for key, default in ADDED_SINCE.items():  # a key added since the fixture, at the value every recorded plan had
        *outer, name = key.split(".")
        holder = document
        for part in outer:
            holder = holder.get(part) or {}
        if isinstance(holder, dict) and name in holder and holder[name] == default:
            holder.pop(name)
    document["notes"] = [note for note in document["notes"] if not note.startswith(NOTES_ADDED_SINCE)]
    digest = hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()
    return {"digest": digest, "feasible": plan.feasible, "peaks": [document[key] for key in PEAKS],
            "step_time_s": document["predicted_step_time_s"], "world_size": document["world_size"],
            "choices": [f"{unit['name']}: {_choice(unit)}" for unit in document["units"]]}


PEAKS = ("predicted_peak_bytes", "simulated_peak_bytes", "minimum_peak_bytes", "baseline_peak_bytes")


def _choice(unit: dict[str, Any]) -> str:
    saves = "" if unit["saves"] is None else f"[{len(unit['saves'])} saved]"
    return f"{unit['mode']}{saves}/{unit['precision']}/{unit['placement']}"


def _sweep(build: Build, **options: Any) -> dict[str, Any]:
    """Plans at three budgets from one profile: no limit, halfway between the floor and no plan, under the floor;
    or the class of the error planning raised (the same inputs raise the same)."""
    try:
        return _three_budgets(build, **options)
    except (ProfileError, TraceError) as error:
        return {"budgets": [], "plans": [], "error": type(error).__name__}


def _three_budgets(build: Build, **options: Any) -> dict[str, Any]:
    model, example = build()
    planner = autoplan.Planner(model, **_inputs(example), reserve=0, **options)
    loose = planner.plan(2**30 if options.get("device") == "cpu" else "100%")  # not this machine's RAM: any machine
    floor = loose.prediction.minimum_budget_bytes  # reserve=0: the lowest peak, or its allocator's least limit on a GPU
    halfway = halfway_budget(loose)
    under = max(1, floor - max(1, floor // 50))
    return {"budgets": [halfway, under],
            "plans": [_comparable(loose), _comparable(planner.plan(halfway)), _comparable(planner.plan(under))]}


def cpu_kernels() -> str:
    """What the CPU cases' plans depend on of this machine: its vendor, torch's CPU capability and the instruction sets
    that choose oneDNN's kernels (and so the scratch they hold)."""
    flags: set[str] = set()
    vendor = ""
    cpuinfo = Path("/proc/cpuinfo")
    for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else []):
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            vendor = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break
    isa = sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_tile"})
    return f"{vendor or sys.platform} {torch.backends.cpu.get_cpu_capability()} {' '.join(isa)}"


def this_cpus_fixture() -> Path:
    return FIXTURE.with_name(f"plans_before.cpu-{hashlib.sha256(cpu_kernels().encode()).hexdigest()[:12]}.json")


# the cases whose plans depend on this machine's CPU, filled by _variants: those planned for device="cpu", and the
# stacked LSTM for a GPU, whose profile runs oneDNN's LSTM for real (instruments.rnn): its bf16 kernel exists on some CPUs only
CPU_DEPENDENT: set[str] = {"structures:stacked nn.LSTM with residuals | a100-80gb"}


def _variants() -> dict[str, Callable[[], dict[str, Any]]]:
    """Each case: a name and the plans it makes."""
    cases: dict[str, Callable[[], dict[str, Any]]] = {}
    for name, build in _zoo().items():
        # the structures as tests/handmade.py plans them (fp32: oneDNN's LSTM has no bf16 kernel on every CPU)
        cpu = {"precision": "fp32"} if name.startswith("structures:") else {}
        cases[f"{name} | cpu"] = lambda build=build, cpu=cpu: _sweep(build, device="cpu", **cpu)
        CPU_DEPENDENT.add(f"{name} | cpu")
        cases[f"{name} | {GPU}"] = lambda build=build: _sweep(build, device=GPU, host_budget=HOST_BUDGET)
    tiny_gpt, residual = ALL_MODELS["tiny_gpt"], ALL_MODELS["residual_mlp"]
    cases["models:tiny_gpt | fsdp 2"] = lambda: _sweep(tiny_gpt, device=GPU, world_size=2)
    cases["models:residual_mlp | fsdp auto"] = lambda: _fsdp_auto(residual)
    cases["models:tiny_gpt | pins"] = lambda: _sweep(tiny_gpt, device=GPU, host_budget=HOST_BUDGET,
                                                      checkpoint={"transformer.h.0": "full"}, keep_fp32=["transformer.h.1"])
    cases["models:tiny_gpt | fp16 on t4"] = lambda: _sweep(tiny_gpt, device="t4", precision="fp16", host_budget=HOST_BUDGET)
    cases["models:tiny_gpt | compile"] = lambda: _sweep(tiny_gpt, device=GPU, compile=True, offload=False)
    cases["models:tiny_gpt | loss as written"] = lambda: _sweep(tiny_gpt, device="cpu", fuse_loss=False, segments=False,
                                                               menu_size=0, optimizer="sgd")
    CPU_DEPENDENT.add("models:tiny_gpt | loss as written")
    return cases


def _fsdp_auto(build: Build) -> dict[str, Any]:
    """world_size="auto" under a budget one GPU cannot meet: the fewest GPUs, and the curve on the way."""
    model, example = build()
    one = autoplan.plan(model, "100%", **_inputs(example), device=GPU, reserve=0, offload=False)
    budget = int(one.prediction.minimum_peak_bytes * 0.8)
    model, example = build()
    plan = autoplan.plan(model, budget, **_inputs(example), device=GPU, reserve=0, world_size="auto")
    return {"budgets": [budget], "plans": [_comparable(plan)]}


# Planned in a process of their own: the stacked LSTM's plans depend on what the process ran before (a second plan of
# the same model in one process peaks 256 bytes apart; oneDNN's kernel is run for real, `instruments.rnn`)
FRESH_PROCESS = ("structures:stacked nn.LSTM with residuals",)


def _planned(case: str) -> dict[str, Any]:
    if not case.startswith(FRESH_PROCESS):
        return _variants()[case]()
    code = (f"import json, torch; torch.set_num_threads({THREADS}); from tests.end_to_end import test_same_plans as t; "
            f"print(json.dumps(t._variants()[{case!r}]()))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=1200, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def record(cases: list[str]) -> None:
    """Plan every case (or those named) and write them into the fixture, the others as recorded."""
    torch.set_num_threads(THREADS)
    unknown = sorted(set(cases) - set(_variants()))
    if unknown:
        raise SystemExit(f"no such case: {unknown}; the cases: {sorted(_variants())}")
    plans = _recorded() if cases else {}
    plans.update({name: _planned(name) for name in (cases or _variants())})
    FIXTURE.write_text(json.dumps(plans, indent=1, sort_keys=True) + "\n")


def record_this_cpu() -> None:
    """This machine's CPU-dependent cases, in its own fixture (the module docstring says when)."""
    torch.set_num_threads(THREADS)
    cases = sorted(case for case in _variants() if case in CPU_DEPENDENT)
    plans = {"cpu_kernels": cpu_kernels(), "cases": {name: _planned(name) for name in cases}}
    this_cpus_fixture().write_text(json.dumps(plans, indent=1, sort_keys=True) + "\n")


def _recorded() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def _recorded_case(case: str) -> dict[str, Any]:
    """The case as recorded: by this machine's CPU where it holds its own CPU-dependent cases, else by plans_before.json."""
    own = this_cpus_fixture()
    if case in CPU_DEPENDENT and own.exists():
        return json.loads(own.read_text())["cases"][case]
    return _recorded()[case]


@pytest.fixture(autouse=True)
def _one_thread():
    """oneDNN's LSTM workspace (`instruments.rnn`, read off a real call) depends on the thread count: plan with one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case", sorted(_variants()))
def test_the_same_inputs_give_the_same_plans(case):
    if "transformers" in case:
        pytest.importorskip("transformers")
    before = _recorded_case(case)
    now = _planned(case)
    assert now.get("error") == before.get("error"), case
    assert now["budgets"] == before["budgets"], case
    for index, (was, is_now) in enumerate(zip(before["plans"], now["plans"])):
        summary = {key: value for key, value in is_now.items() if key != "digest"}
        assert summary == {key: value for key, value in was.items() if key != "digest"}, \
            f"{case}: plan {index} changed: {_first_change(was, is_now)}"
        assert is_now["digest"] == was["digest"], f"{case}: plan {index} changed in a field of to_dict() the summary leaves out"


def _first_change(was: Any, now: Any, path: str = "") -> str:
    """Where two plan documents first differ, for the failure message."""
    if isinstance(was, dict) and isinstance(now, dict):
        for key in sorted(set(was) | set(now)):
            if was.get(key, "<absent>") != now.get(key, "<absent>"):
                return _first_change(was.get(key, "<absent>"), now.get(key, "<absent>"), f"{path}.{key}")
    if isinstance(was, list) and isinstance(now, list) and len(was) == len(now):
        for index, (a, b) in enumerate(zip(was, now)):
            if a != b:
                return _first_change(a, b, f"{path}[{index}]")
    return f"{path or 'the plan'}: {was!r} then, {now!r} now"


if __name__ == "__main__":
    sys.exit(record_this_cpu() if sys.argv[1:] == ["--this-cpu"] else record(sys.argv[1:]))
