"""The checkpoint axis: what a unit keeps from its forward for its backward.

- `keep`: everything its ops save (no checkpointing);
- `selective`: some op outputs, recomputing the rest in backward: by the fixed rule every matmul,
  convolution and attention output (and bitsandbytes' fused 4-bit matmul), or the op occurrences a
  menu point names (`Choice.saves`, `profile.menu`);
- `full`: only its inputs, recomputing its whole forward in backward.

Any device runs every mode. A unit is checkpointed with `torch.utils.checkpoint` (non-reentrant;
`planned.wrappers.PlannedForward` calls it), selective mode through torch's selective-checkpoint
contexts with `OccurrencePolicy`. Recomputation is priced by measuring it (`profile.profiler`): the
extra FLOPs and bytes of each mode's backward.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autoplan.axes import DeviceLike
from autoplan.errors import OptionError
from autoplan.instruments.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from autoplan.instruments.quantized import is_quantized_matmul

Mode = Literal["keep", "selective", "full"]

MODES: tuple[Mode, ...] = ("keep", "selective", "full")  # the order of rewriting: keep changes nothing
CHECKPOINTED: frozenset[str] = frozenset({"selective", "full"})  # the modes that recompute in backward


class CheckpointAxis:
    """The `ChoiceAxis` of checkpoint modes (`Choice.mode`)."""

    field = "mode"

    def values(self) -> tuple[Mode, ...]:
        return MODES

    def check(self, value: object) -> Mode:
        if value not in MODES:
            raise OptionError(f"unknown checkpoint mode {value!r}; expected one of {MODES}")
        return MODES[MODES.index(value)]  # the member, as its Literal type

    def unsupported(self, value: str, device: DeviceLike) -> str:
        return ""  # checkpointing is torch's own, on any device

    def rewriting(self, value: str) -> int:
        return MODES.index(self.check(value))

    def words(self, value: str) -> str:
        return value


CHECKPOINT = CheckpointAxis()


def checkpointed(mode: str) -> bool:
    """Whether `mode` recomputes in backward."""
    return mode in CHECKPOINTED


# Selective mode keeps the outputs of these (expensive to recompute, cheap to store relative to
# their cost) and recomputes everything else: norms, activations, dropout, casts, adds. bitsandbytes'
# fused 4-bit matmul is one of them too (instruments.quantized.is_quantized_matmul), and the fused attention kernels.
_SAVED_IN_SELECTIVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.convolution.default,
}


# The fused attention kernels, one name for a policy: a plan made for a GPU (flash or efficient
# kernel) names the same op as the CPU's flash kernel when it is applied and run on the CPU.
_FUSED_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def op_name(func) -> str:
    """How a menu names an aten op: its overload packet, "aten.mm" (occurrences add "#0", "#1", ...);
    "aten.sdpa" for any fused attention kernel; a tensor-parallel rank twin's collective by the functional collective
    torch's DTensor calls in its place, so that a policy that saves one saves it in the real step too."""
    if func in _FUSED_ATTENTION:
        return "aten.sdpa"
    return TWIN_COLLECTIVES.get(func) or str(func.overloadpacket)


# the rank twin's collectives (instruments.collectives) -> the op DTensor dispatches for each
TWIN_COLLECTIVES = {ALL_REDUCE: "_c10d_functional.all_reduce", ALL_GATHER: "_c10d_functional.all_gather_into_tensor",
                    REDUCE_SCATTER: "_c10d_functional.reduce_scatter_tensor"}


def can_save(func) -> bool:
    """Whether a policy may keep this op's output: not an in-place op or a view (their outputs alias
    an input, which recomputation restores for free and which a later in-place op may change)."""
    schema = func._schema
    return not schema.is_mutable and all(ret.alias_info is None for ret in schema.returns)


class OccurrencePolicy:
    """A selective-checkpoint policy that tells ops apart by type and occurrence.

    torch's selective checkpointing asks the policy once per op of the forward (the recomputation
    replays the cached outputs by the same per-op count), so one counter per op type numbers
    the ops exactly as a profiled forward of the unit numbered them. `saves` None is the fixed
    rule (every matmul/conv/attention output). `observer`, if given, sees every op with its name
    and output (the menu builder records a unit's ops through it), through `_ObservedOps`: torch
    before 2.12 asks the policy before the op runs, with no output to show.
    """

    def __init__(self, saves: tuple[str, ...] | None, observer=None) -> None:
        self.saves = None if saves is None else frozenset(saves)
        self.observer = observer
        self.counts: dict[str, int] = {}
        self.asked: tuple[str, object] | None = None  # the occurrence the policy was last asked about, and its op

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        name = op_name(func)
        index = self.counts.get(name, 0)
        self.counts[name] = index + 1
        occurrence = f"{name}#{index}"
        self.asked = (occurrence, func)
        saved = (func in _SAVED_IN_SELECTIVE or func in _FUSED_ATTENTION or is_quantized_matmul(func)) if self.saves is None else occurrence in self.saves and can_save(func)
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts(saves: tuple[str, ...] | None, observer=None) -> Callable[[], tuple]:
    """The `context_fn` that makes `torch.utils.checkpoint` selective: a fresh policy per checkpointed call,
    whose counters number this forward's ops from 0 (the fixed rule's is one function, whoever asks)."""
    if saves is None and observer is None:
        return _fixed_rule_contexts
    return functools.partial(_occurrence_contexts, saves, observer)


def _fixed_rule_contexts():
    return create_selective_checkpoint_contexts(OccurrencePolicy(None))


def _occurrence_contexts(saves, observer):
    policy = OccurrencePolicy(saves, observer)
    forward, recompute = create_selective_checkpoint_contexts(policy)
    if observer is None:
        return forward, recompute
    return _observed(forward, policy), recompute


@contextlib.contextmanager
def _observed(forward: contextlib.AbstractContextManager, policy: OccurrencePolicy):
    with forward, _ObservedOps(policy):  # entered last, so it sees each op first and its output last
        yield


class _ObservedOps(TorchDispatchMode):
    """Shows the policy's observer each op it was asked about, with the op's output."""

    def __init__(self, policy: OccurrencePolicy) -> None:
        super().__init__()
        self.policy = policy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.policy.asked = None
        out = func(*args, **kwargs)
        asked = self.policy.asked
        if asked is not None and asked[1] is func:
            self.policy.observer(asked[0], func, args, kwargs, out)
        return out
