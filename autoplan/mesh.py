"""Parallelism as a mesh: the devices one plan is for, a dimension per way the work is split across them.

A `Mesh` is a tuple of dimensions, each a number of ranks and a `Strategy` that says what each rank
holds along it: its share of the parameters, gradients and optimizer state, and of the batch. One
device is the empty mesh. Today there is one strategy, FSDP's full sharding (`FSDP`, the `world_size`
option: parameters, gradients and optimizer state 1/N each, rows padded to a multiple of N; each rank
trains its own batch); the memory model prices it (`memory.sharded`) and the world-size search walks
its dimension (`solve.worlds`). Tensor parallelism (`TP`, the `tensor_parallel` option) is a second dimension:
its ranks split the linears the mesh's `tp_layout` names and train the same batch; the plan is made for one
rank's model (`inputs.tensor_parallel.rank_model`), which already holds only its slices, so along that
dimension a rank holds all of what the plan counts (FSDP, if the mesh has it too, shards that further).
How FSDP runs its units is the mesh's too: `reshard_after_forward` (fully_shard's option of that name) False
keeps each unit's gathered parameters from its forward to its backward, which then gathers nothing (per unit:
pattern -> bool pairs, as torchtitan keeps its last block gathered).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from autoplan.errors import OptionError

Share = Literal["shard", "whole"]  # a rank's part along a dimension: 1/N (rows padded to a multiple of N), or all of it
Batch = Literal["own", "same"]  # each rank trains a batch of its own (data parallel), or every rank the same one


@dataclass(frozen=True)
class Strategy:
    """What each rank of a dimension holds."""

    name: str  # "fsdp"
    state: Share  # parameters, gradients and optimizer state
    batch: Batch  # the batch, and so the activations


FSDP = Strategy("fsdp", state="shard", batch="own")  # torch's fully_shard (FSDP2): every dimension of N ranks shards the state
# torch's parallelize_module: the planned model is one rank's slice already (module docstring), so "whole" of it
TP = Strategy("tp", state="whole", batch="same")

MAX_RANKS = 65_536  # above any FSDP job run so far; a larger number is a typo, and the search would plan for it


@dataclass(frozen=True)
class MeshDim:
    """One dimension of the mesh: `size` ranks, each holding what `strategy` says."""

    size: int
    strategy: Strategy

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 1 <= self.size <= MAX_RANKS:
            raise OptionError(f"a mesh dimension is a whole number of ranks from 1 to {MAX_RANKS:,}; got {self.size!r}")


@dataclass(frozen=True)
class Mesh:
    """The devices a plan is for; `Mesh()` is one device, `Mesh.fsdp(8)` FSDP over 8."""

    dims: tuple[MeshDim, ...] = ()
    # FSDP's units free their gathered parameters after forward (True), keep them for backward (False), or per unit:
    # (pattern, bool) pairs, the first pattern a unit matches deciding (unmatched: True)
    reshard_after_forward: bool | tuple[tuple[str, bool], ...] = True
    # FSDP2's MixedPrecisionPolicy: "bf16"/"fp16" parameters gathered and computed in, fp32 kept and reduced; None: as stored
    param_dtype: str | None = None
    # with a TP dimension: the linears split, (module name, "colwise" | "rowwise"), as parallelize_module takes them
    tp_layout: tuple[tuple[str, str], ...] = ()
    # with a TP dimension: the residual stream between the split linears is one Nth of the sequence on each rank
    sequence_parallel: bool = False

    @staticmethod
    def fsdp(ranks: int, reshard_after_forward: bool | tuple[tuple[str, bool], ...] = True, param_dtype: str | None = None,
             tensor_parallel: int = 1, tp_layout: tuple[tuple[str, str], ...] = (), sequence_parallel: bool = False) -> Mesh:
        """FSDP over `ranks` devices (one device: no FSDP, the empty mesh, which keeps `reshard_after_forward` for the
        world-size search to resize it with); with `tensor_parallel` > 1, each of those is a group of that many
        tensor-parallel ranks splitting `tp_layout`'s linears (FSDP's dimension first, as torchtitan's ("dp", "tp"))."""
        dims: tuple[MeshDim, ...] = (MeshDim(ranks, FSDP),) if ranks != 1 else ()
        if tensor_parallel != 1:
            dims += (MeshDim(tensor_parallel, TP),)
        split = tensor_parallel != 1
        return Mesh(dims, reshard_after_forward, param_dtype, tp_layout if split else (), sequence_parallel and split)

    @property
    def reshard_as_given(self) -> bool | dict[str, bool]:
        """`reshard_after_forward` as plan() takes it: True, False, or {unit pattern: bool}."""
        setting = self.reshard_after_forward
        return setting if isinstance(setting, bool) else dict(setting)

    @property
    def size(self) -> int:
        """Devices in all: what `world_size` counts."""
        return math.prod(dim.size for dim in self.dims)

    @property
    def shards(self) -> int:
        """Into how many parts each rank's parameters, gradients and optimizer state are split (1: whole on each)."""
        return math.prod(dim.size for dim in self.dims if dim.strategy.state == "shard")

    def along(self, strategy: Strategy) -> int:
        """Ranks along `strategy`'s dimension (1 where the mesh has none)."""
        return math.prod(dim.size for dim in self.dims if dim.strategy == strategy)

    def resized(self, strategy: Strategy, size: int) -> Mesh:
        """This mesh with `strategy`'s dimension at `size` ranks (added, or dropped at 1): a step of the world-size search."""
        kept = tuple(dim for dim in self.dims if dim.strategy != strategy)
        dims = ((MeshDim(size, strategy),) if size > 1 else ()) + kept
        dims = tuple(sorted(dims, key=lambda dim: dim.strategy != FSDP))  # FSDP's dimension outermost, as fsdp() makes it
        sharded = any(dim.strategy == FSDP for dim in dims)
        return Mesh(dims, self.reshard_after_forward if sharded else True, self.param_dtype, self.tp_layout,  # no FSDP: nothing to reshard
                    self.sequence_parallel)

    @property
    def gathered_words(self) -> str:
        """Which FSDP groups hold gathered parameters in a phase, as the report says it."""
        setting = self.reshard_after_forward
        if setting is True:
            return "root, running and prefetched unit"
        if setting is False:
            return "root and every unit between its forward and backward"
        kept = ", ".join(pattern for pattern, reshard in setting if not reshard)
        return f"root, running and prefetched unit, and {kept} from its forward to its backward"

    @property
    def tensor_parallel(self) -> int:
        """Ranks each linear of `tp_layout` is split over (1: none)."""
        return self.along(TP)

    @property
    def split_words(self) -> str:
        """How the work is split, as the report says it: "FSDP", "tensor parallel", "2 FSDP × 4 tensor parallel"."""
        names = {"fsdp": "FSDP", "tp": "tensor parallel" + (" (sequence parallel)" if self.sequence_parallel else "")}
        if len(self.dims) == 1:
            return names[self.dims[0].strategy.name]
        return " × ".join(f"{dim.size} {names[dim.strategy.name]}" for dim in self.dims)

    @property
    def slice_words(self) -> str:
        """What a plan's counts are of under tensor parallelism, as the report says it ("" without)."""
        return f", one of {self.tensor_parallel} tensor-parallel ranks' slices of the model" if self.tensor_parallel > 1 else ""

    def __str__(self) -> str:
        if not self.dims:
            return "one device"
        words = " × ".join(f"{dim.size} {dim.strategy.name}" for dim in self.dims) + (" (sequence parallel)" if self.sequence_parallel else "")
        if self.reshard_after_forward is not True:
            words += f" ({self.gathered_words} gathered)"
        if self.param_dtype:
            words += f" ({self.param_dtype} parameters, fp32 reduce)"
        return words
