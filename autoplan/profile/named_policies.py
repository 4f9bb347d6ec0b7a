"""Profile stage: selective-checkpoint policies people run today, by name, so a plan can be pinned to them.

A unit pinned to a named policy (`checkpoint={"layers.*": "torchtitan-op"}`) takes that policy's selective
choice and no other: the op occurrences it saves are worked out from one recorded forward of the unit
(`profile.menu.record_ops`) by the policy's own rule, and the choice is measured like every menu point, so
its bytes are what the rule does to this unit, not an estimate. A person can then price the setup they run
against the plan autoplan would choose.

- `torchtitan-op`: torchtitan's op-level selective checkpointing (`activation_checkpoint.mode = "selective"`,
  `selective_ac_option = "op"`, its `_custom_policy` counting matmuls per block): save the outputs of
  matmuls (`aten.mm`), fused attention kernels and `aten.max`, except every second matmul of the block
  (its 2nd, 4th, ... `aten.mm`, counted from one), which is recomputed with everything else. Biased
  linears run `aten.addmm`, which the rule neither counts nor saves, as in torchtitan.

Megatron-LM's selective recomputation (`--recompute-granularity selective`: the attention core alone
recomputed) is not a named policy: it checkpoints a function inside the block and keeps the rest as
autograd saves it, which no set of saved op outputs reproduces to the byte.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from autoplan.errors import OptionError, ProfileError
from autoplan.instruments.target import as_the_target_runs
from autoplan.plan import Choice
from autoplan.profile.menu import OpRecord, PolicyWords, describe, record_ops, summarize


def _torchtitan_op(ops: tuple[OpRecord, ...]) -> tuple[str, ...]:
    saved = []
    for op in ops:
        name, index = op.occurrence.split("#")
        if name == "aten.mm":
            if int(index) % 2 == 0:  # torchtitan counts from one and recomputes the even counts (indices 1, 3, ... here)
                saved.append(op.occurrence)
        elif name in ("aten.sdpa", "aten.max"):
            saved.append(op.occurrence)
    return tuple(saved)


NAMED_POLICIES: dict[str, Callable[[tuple[OpRecord, ...]], tuple[str, ...]]] = {
    "torchtitan-op": _torchtitan_op,
}

WORDS = {
    "torchtitan-op": "torchtitan's op-level selective checkpointing (every other matmul and attention kept)",
}


def check_named(name: str) -> str:
    """`name`, a named policy; else an OptionError that lists them."""
    if name not in NAMED_POLICIES:
        raise OptionError(f"unknown named checkpoint policy {name!r}; the named ones are {', '.join(NAMED_POLICIES)}")
    return name


def named_saves(name: str, ops: tuple[OpRecord, ...]) -> tuple[str, ...]:
    """The occurrences policy `name` saves in a unit whose forward recorded `ops` (none: it recomputes the whole unit)."""
    savable = {op.occurrence for op in ops if op.savable}
    return tuple(occurrence for occurrence in NAMED_POLICIES[check_named(name)](ops) if occurrence in savable)


def named_choices(module: torch.nn.Module, unit: str, named: str, precisions, refused: str, inputs: Callable[[], tuple],
                  measure: Callable[[Choice], Any], device, fake_mode) -> dict[Choice, tuple[Any, PolicyWords]]:
    """The selective choice policy `named` makes of a unit in each precision, measured (`measure(choice)`, a
    `profile.profiler.UnitCost`), with its words. `inputs()` makes the unit's (args, kwargs) under `fake_mode`."""
    if refused:
        raise ProfileError(f"unit {unit!r} is pinned to the named checkpoint policy {named!r}, but torch's selective "
                           f"checkpointing refuses it ({refused}): pin it to 'keep' or 'full'")
    measured = {}
    for precision in precisions:
        with fake_mode, as_the_target_runs(device):
            args, kwargs = inputs()
            ops = record_ops(module, args, kwargs, precision, device)
        saves = named_saves(named, ops)
        choice = Choice("selective", precision, saves=saves)
        words = PolicyWords(f"{WORDS[named]}: {summarize(ops, saves)}", describe(ops, saves), named)
        measured[choice] = (measure(choice), words)
    return measured
