"""Profile stage: each unit's own menu of what to save, between keep and full.

One profiled forward of a unit (under fake tensors, in the precision the menu is for) names its
ops by type and occurrence ("aten.mm#3": the unit's fourth matmul) and prices each: the bytes its
output would hold until backward, and the time recomputing it costs, FLOPs *and* bytes moved
(roofline, the slower of the two, in the op's dtype: recomputing a norm or an activation moves
bytes without adding FLOPs). Sorting the ops by recompute time per byte saved, most first, and
saving ever longer prefixes of that order walks the front of saved bytes against recompute
time from "save nothing" (full) towards "save everything" (keep); `menu_points` picks K points
along it. Each point is then measured like every other choice (`profile.units`), so the memory
model stays exact whatever the estimate here got wrong.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from autoplan.plan import Choice
from autoplan.runtime.tensors import tensors_of, unique_storage_bytes
from autoplan.runtime.tracker import RooflineRates, op_roofline
from autoplan.runtime.wrappers import PlannedForward, can_save

DEFAULT_MENU_SIZE = 0  # menu points per unit and precision (keep and full not counted); opt in with menu_size=6: it multiplies profiling work


@dataclass(frozen=True)
class OpRecord:
    """One op of a unit's forward, as a policy can name it."""

    occurrence: str  # "aten.mm#3"
    module: str  # the innermost submodule it ran in, relative to the unit ("" for the unit's own body)
    saved_bytes: int  # bytes of its output (new storage only): what saving it holds until backward
    recompute_s: float  # roofline time of running it again
    flops: int
    savable: bool  # not an in-place op or a view


@dataclass(frozen=True)
class MenuPoint:
    choice: Choice
    policy: str  # in words: what it saves and what it recomputes
    estimated_bytes: int  # saved bytes by the estimate above (the measurement is what counts)
    estimated_recompute_s: float


def record_ops(module: torch.nn.Module, args: tuple, kwargs: dict, precision: str, device: RooflineRates) -> tuple[OpRecord, ...]:
    """Run the unit's forward once as a selective unit that saves nothing, recording every op the policy sees."""
    records: list[OpRecord] = []
    names = {id(sub): name for name, sub in module.named_modules()}
    running: list[str] = []  # the submodules whose forward is running, innermost last
    producer: dict[int, int] = {}  # storage -> index of the op that made it
    mutated: set[int] = set()  # ops whose output a later in-place op changes

    def observe(occurrence, func, op_args, op_kwargs, out) -> None:
        inputs, outputs = tensors_of((op_args, op_kwargs)), tensors_of(out)
        input_storages = {id(t.untyped_storage()) for t in inputs}
        new = [t for t in outputs if id(t.untyped_storage()) not in input_storages]
        cost = op_roofline(device, func, op_args, op_kwargs, out, inputs + outputs)
        where = running[-1] if running else ""
        if func._schema.is_mutable:  # an in-place op: what made its inputs cannot be saved (the cache would change)
            mutated.update(producer[key] for key in input_storages if key in producer)
        producer.update((id(t.untyped_storage()), len(records)) for t in new)
        records.append(OpRecord(occurrence, where, unique_storage_bytes(new), cost.time_s, cost.flops, can_save(func)))

    def enter(sub, _args) -> None:
        if id(sub) in names:
            running.append(names[id(sub)])

    def leave(sub, _args, _out) -> None:
        if id(sub) in names and running:
            running.pop()

    planned = PlannedForward(module, Choice("selective", precision, saves=()), observer=observe, cast_outputs=False)
    hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        with torch.enable_grad():
            planned(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return tuple(dataclasses.replace(op, savable=False) if i in mutated else op for i, op in enumerate(records))


def menu_points(ops: tuple[OpRecord, ...], precision: str, size: int = DEFAULT_MENU_SIZE) -> list[MenuPoint]:
    """Up to `size` policies along the front of saved bytes vs recompute time (greedy by time per byte)."""
    candidates = sorted(
        (op for op in ops if op.savable and op.saved_bytes > 0 and op.recompute_s > 0),
        key=lambda op: op.recompute_s / op.saved_bytes,
        reverse=True,
    )
    if not candidates or size <= 0:
        return []
    total_s = sum(op.recompute_s for op in ops)
    total_bytes = sum(op.saved_bytes for op in candidates)
    cumulative_s, cumulative_bytes, prefix_ends = 0.0, 0, []
    for op in candidates:
        cumulative_s += op.recompute_s
        cumulative_bytes += op.saved_bytes
        prefix_ends.append((total_s - cumulative_s, cumulative_bytes))
    # Where the front bends: the prefixes that leave a falling share of the time to recompute
    # (matmuls first) and ones spread evenly over the bytes (elementwise ops after them).
    wanted = set()
    for share in (0.5, 0.25, 0.1, 0.04, 0.01):
        wanted.add(next((i for i, (left, _) in enumerate(prefix_ends) if left <= share * total_s), len(candidates) - 1))
    for share in (0.25, 0.5, 0.75):
        wanted.add(next(i for i, (_, held) in enumerate(prefix_ends) if held >= share * total_bytes))
    ends = sorted(wanted)
    if len(ends) > size:  # thin evenly, keeping the last (the most saved)
        ends = sorted({ends[round((i + 1) * (len(ends) - 1) / size)] for i in range(size)})
    order = {op.occurrence: index for index, op in enumerate(ops)}
    points = []
    for end in ends:
        saved = sorted((op.occurrence for op in candidates[: end + 1]), key=order.__getitem__)
        choice = Choice("selective", precision, saves=tuple(saved))
        points.append(MenuPoint(choice, describe(ops, choice.saves), prefix_ends[end][1], prefix_ends[end][0]))
    return points


def describe(ops: tuple[OpRecord, ...], saves: tuple[str, ...]) -> str:
    """A policy in words: "saves attention.wq, attention.wk, attention (sdpa); recomputes attention_norm, silu, ...".

    Ops are grouped by the submodule they ran in; a submodule that runs more than one kind of op
    names the kinds in parentheses; ops of the unit's own body are named by kind.
    """
    kept = set(saves)
    saved = [op for op in ops if op.occurrence in kept]
    recomputed = [op for op in ops if op.occurrence not in kept and op.savable and op.saved_bytes > 0]
    return f"saves {_grouped(saved, ops) or 'only its inputs'}; recomputes {_grouped(recomputed, ops) or 'nothing'}"


_KIND_NAMES = {"mm": "matmul", "addmm": "matmul", "bmm": "matmul", "baddbmm": "matmul", "convolution": "conv"}


def _kind(op: OpRecord) -> str:
    name = op.occurrence.split("#")[0].removeprefix("aten.").strip("_")
    return "sdpa" if "scaled_dot_product" in name else _KIND_NAMES.get(name, name)


def _grouped(chosen: list[OpRecord], ops: tuple[OpRecord, ...], most: int = 8) -> str:
    kinds_in = {}
    for op in ops:
        kinds_in.setdefault(op.module, set()).add(_kind(op))
    groups: dict[str, list[str]] = {}
    for op in chosen:
        kinds = groups.setdefault(op.module, [])
        if _kind(op) not in kinds:
            kinds.append(_kind(op))
    words = []
    for module, kinds in groups.items():
        if not module:
            words.extend(kinds)
        elif len(kinds_in[module]) == 1:
            words.append(module)
        else:
            words.append(f"{module} ({', '.join(kinds)})")
    if len(words) <= most:
        return ", ".join(words)
    return ", ".join(words[:most]) + f" and {len(words) - most} more"


def dominated(cost, others) -> bool:
    """A measured menu point that holds no fewer bytes and takes no less time than another option.

    Peaks are not compared: a point that only lowers a transient peak rarely decides a plan, and
    near-duplicate options make the ILP much slower to prove optimal (2.2 s instead of 0.12 s at
    96 units, benchmarks/plan_quality.py's solve-time section).
    """
    return any(other.held_bytes <= cost.held_bytes and other.time_s <= cost.time_s for other in others)
