"""Profile stage: each unit's own menu of what to save, between keep and full.

One profiled forward of a unit (under fake tensors, in the precision the menu is for) names its
ops by type and occurrence ("aten.mm#3": the unit's fourth matmul) and prices each: the bytes its
output would hold until backward, and the time recomputing it costs, FLOPs *and* bytes moved
(roofline, the slower of the two, in the op's dtype: recomputing a norm or an activation moves
bytes without adding FLOPs). Sorting the ops by recompute time per byte saved, most first, and
saving ever longer prefixes of that order walks the front of saved bytes against recompute
time from "save nothing" (full) towards "save everything" (keep); `menu_points` picks K points
along it. Each point is then measured like every other choice (`profile.profiler`), so the memory
model stays exact whatever the estimate here got wrong.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from dataclasses import dataclass

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS

from autoplan.inputs.options import DEFAULT_MENU_SIZE  # menu points per unit and precision, the option's default
from autoplan.plan import Choice, Precision
from autoplan.vocabulary.tensors import tensors_of, unique_storage_bytes
from autoplan.instruments.flop_formulas import autoplan_flop_formulas
from autoplan.instruments.tracker import RooflineRates, op_roofline
from autoplan.axes.checkpoint import can_save, op_name
from autoplan.planned.wrappers import PlannedForward



# What torch's selective checkpointing raises for a unit it cannot run selectively: an op writing in place
# into an output the policy saved (nn.RNN's tanh cell), ops that differ between forward and recomputation.
# The real run refuses such a unit the same way, so the unit is offered keep and full only.
_SELECTIVE_REFUSALS = ("selective activation checkpoint has been mutated", "encountered during backward but not found in storage")


def measure_or_refuse(choices, measure) -> tuple[dict, str]:
    """`measure(choice)` for each choice, and why selective checkpointing refused the unit ("" when it did
    not): a selective choice it refuses is left out; any other failure is raised."""
    costs, refused = {}, ""
    for choice in choices:
        try:
            costs[choice] = measure(choice)
        except RuntimeError as error:
            if choice.mode != "selective" or not any(words in str(error) for words in _SELECTIVE_REFUSALS):
                raise
            refused = str(error).split(". ")[0]
    return costs, refused


@dataclass(frozen=True)
class OpRecord:
    """One op of a unit's forward, as a policy can name it."""

    occurrence: str  # "aten.mm#3"
    module: str  # the innermost submodule it ran in, relative to the unit ("" for the unit's own body)
    saved_bytes: int  # bytes of its output (new storage only): what saving it holds until backward
    recompute_s: float  # roofline time of running it again (0: checkpoint's early stop never reruns it)
    flops: int
    savable: bool  # not an in-place op or a view


@dataclass(frozen=True)
class PolicyWords:
    """What a menu point saves and what it recomputes, said twice."""

    summary: str  # in a person's words, by kind of op: "keeps the outputs of matmuls and attention; recomputes norms, ..."
    ops: str  # op by op, by submodule (`describe`): what --verbose shows
    name: str = ""  # the named policy it is (`profile.named_policies`), "" for a menu point of autoplan's own


@dataclass(frozen=True)
class MenuPoint:
    choice: Choice
    policy: PolicyWords
    estimated_bytes: int  # saved bytes by the estimate above (the measurement is what counts)
    estimated_recompute_s: float


def record_ops(module: torch.nn.Module, args: tuple, kwargs: dict, precision: Precision, device: RooflineRates) -> tuple[OpRecord, ...]:
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
    with autoplan_flop_formulas():  # the roofline prices attention, LSTM layers and 4-bit matmuls by autoplan's formulas
        hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
        try:
            with torch.enable_grad():
                output = planned(*args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        recomputed = _recomputed_prefix(output, [op.occurrence for op in records])
    for param in module.parameters():
        param.grad = None  # the recording's backward leaves gradients behind
    return tuple(
        dataclasses.replace(op, savable=op.savable and i not in mutated, recompute_s=op.recompute_s if i < recomputed else 0.0)
        for i, op in enumerate(records)
    )


class _OpSequence(TorchDispatchMode):
    """The aten ops run under it, by name, as the selective-checkpoint policy sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in SAC_IGNORED_OPS:
            self.names.append(op_name(func))
        return func(*args, **(kwargs or {}))


def _recomputed_prefix(output, occurrences: list[str]) -> int:
    """How many of the forward's ops (in order) the save-nothing policy's backward recomputes.

    Checkpoint's early stop ends the recomputation once every tensor backward needs is back, so
    the ops after that (often a block's last matmul: its output feeds only an add) never rerun and
    saving them spares nothing. The recomputation replays the forward from its first op, so it
    shows in the backward's op sequence as the longest run matching the forward's.
    """
    needs_grad = [t for t in tensors_of(output) if t.requires_grad]
    if not needs_grad or not occurrences:
        return len(occurrences)
    forward = [occurrence.split("#")[0] for occurrence in occurrences]
    with _OpSequence() as seen:
        torch.autograd.backward(needs_grad, [torch.ones_like(t) for t in needs_grad])
    longest = 0
    for start in range(len(seen.names)):
        matched = 0
        while matched < len(forward) and start + matched < len(seen.names) and seen.names[start + matched] == forward[matched]:
            matched += 1
        longest = max(longest, matched)
    return longest


def menu_points(ops: tuple[OpRecord, ...], precision: Precision, size: int = DEFAULT_MENU_SIZE) -> list[MenuPoint]:
    """Up to `size` policies along the front of saved bytes vs recompute time (greedy by time per byte).

    Saving ever longer prefixes of the ops sorted by recompute time per byte saved walks the
    front's lower hull (a fractional knapsack's order). The points are spread evenly over the
    recompute time they spare (one per `1/size` of it): the solver mixes points across units, and
    what it loses to the menu's gaps is at most one step of time per unit. Ops that checkpoint's
    early stop never recomputes (`recompute_s` 0: e.g. a block's last matmul) are never saved.
    """
    candidates = sorted(
        (op for op in ops if op.savable and op.saved_bytes > 0 and op.recompute_s > 0),
        key=lambda op: op.recompute_s / op.saved_bytes,
        reverse=True,
    )
    if not candidates or size <= 0:
        return []
    total_s = sum(op.recompute_s for op in ops)
    spared = list(itertools.accumulate(op.recompute_s for op in candidates))
    held = list(itertools.accumulate(op.saved_bytes for op in candidates))
    ends = sorted({min(bisect.bisect_left(spared, step * spared[-1] / size * (1 - 1e-9)), len(candidates) - 1)
                   for step in range(1, size + 1)})
    order = {op.occurrence: index for index, op in enumerate(ops)}
    points = []
    for end in ends:
        saved = sorted((op.occurrence for op in candidates[: end + 1]), key=order.__getitem__)
        saves = tuple(saved)
        choice = Choice("selective", precision, saves=saves)
        words = PolicyWords(summarize(ops, saves), describe(ops, saves))
        points.append(MenuPoint(choice, words, held[end], total_s - spared[end]))
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
    kinds_in: dict[str, set[str]] = {}
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


# Kinds of op, in a person's words, in the order a summary names them: by the op's name ("aten.mm"
# after `_kind`), and norms by the submodule they run in too (an RMSNorm is pow, mean, rsqrt, mul).
_KINDS_IN_WORDS = (
    ("matmuls", ("matmul", "gemm", "linear")),
    ("attention", ("sdpa", "attention")),
    ("convolutions", ("conv",)),
    ("softmax", ("softmax",)),
    ("norms", ("norm",)),
    ("activations", ("silu", "gelu", "relu", "sigmoid", "tanh", "elu", "mish", "softplus", "hardswish", "glu", "threshold")),
    ("dropout", ("dropout", "bernoulli")),
    ("casts", ("to_copy", "copy")),
    ("embeddings", ("embedding",)),
)
_OTHER = "elementwise ops"


def summarize(ops: tuple[OpRecord, ...], saves: tuple[str, ...]) -> str:
    """A policy in a person's words, by kind of op: "keeps the outputs of attention and some matmuls and
    norms; recomputes activations, casts and the rest of the matmuls and norms".

    Ops checkpoint's early stop never reruns (a block's last matmul) count as neither: saving them
    would spare nothing, and nothing reruns them.
    """
    kept = set(saves)
    saved: dict[str, int] = {}
    recomputed: dict[str, int] = {}
    for op in ops:
        if op.occurrence in kept:
            saved[_in_words(op)] = saved.get(_in_words(op), 0) + 1
        elif op.savable and op.saved_bytes > 0 and op.recompute_s > 0:
            recomputed[_in_words(op)] = recomputed.get(_in_words(op), 0) + 1
    order = [words for words, _ in _KINDS_IN_WORDS] + [_OTHER]
    split = [kind for kind in order if kind in saved and kind in recomputed]  # some kept, the rest recomputed
    keeps = [kind for kind in order if kind in saved and kind not in split] + (["some " + _listed(split)] if split else [])
    reruns = [kind for kind in order if kind in recomputed and kind not in split] + (["the rest of the " + _listed(split)] if split else [])
    return f"keeps {'the outputs of ' + _listed(keeps) if keeps else 'only its inputs'}; recomputes {_listed(reruns) or 'nothing'}"


def _in_words(op: OpRecord) -> str:
    kind, within = _kind(op), op.module.rsplit(".", 1)[-1].lower()
    if "norm" in within or within.startswith("ln"):
        return "norms"
    return next((words for words, marks in _KINDS_IN_WORDS if any(mark in kind for mark in marks)), _OTHER)


def _listed(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1] if words else ""


def dominated(cost, others) -> bool:
    """A measured menu point that holds no fewer bytes and takes no less time than another option.

    Peaks are not compared: a point that only lowers a transient peak rarely decides a plan, and
    near-duplicate options make the ILP much slower to prove optimal (2.2 s instead of 0.12 s at
    96 units, benchmarks/plan_quality.py's solve-time section).
    """
    return any(other.held_bytes <= cost.held_bytes and other.time_s <= cost.time_s for other in others)
