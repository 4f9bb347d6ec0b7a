"""A segment's forward: one checkpoint region over consecutive calls of different modules.

A segment ("layers.0–layers.3") is blocks the model's own code calls one after the other
(`for layer in self.layers: h = layer(h, mask)`), checkpointed together as Chen et al.'s √n
checkpointing does: during forward the region saves only the first block's inputs; in backward
the whole run is recomputed, each block fed the previous one's recomputed output, and from then
on every block holds what it saves until its own backward.

The model's loop is not ours to run, so the region is opened when the first block is called and
closed when the last one returns (`SegmentMember` is each block's instance forward). Recomputation
needs each block's inputs: at the first block they are the region's saved inputs; every later
block's tensor arguments must be the previous block's output (a leaf of it, e.g. `[0]`) or the
first block's own arguments (a mask, position embeddings), which is checked call by call here and
at planning time (`memory.segment_terms`). Dropout masks replay (the region restores the RNG state),
buffers (BatchNorm statistics) update once, and under `torch.no_grad()` / eval nothing is opened.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import noop_context_fn

from autoplan.errors import SegmentError
from autoplan.plan import Choice
from autoplan.units import Segment
from autoplan.planned.buffers import BufferSnapshot, BufferWrites, has_buffers
from autoplan.planned.wrappers import PlannedForward, recomputing_whole, without_cache_writes

# torch.utils.checkpoint builds `checkpoint(use_reentrant=False)` on this generator: entered, it
# installs the saved-tensors hooks of one region; resumed, it removes them. It is the only way to
# checkpoint a region whose end is not inside one Python call of ours (the model's loop calls the
# blocks). Private: used here and nowhere else.
_checkpoint_region = torch.utils.checkpoint._checkpoint_without_reentrant_generator
_SAVED = object()  # where a tensor of the first block's inputs goes: the region hands them back on recompute


@dataclass
class _Region:
    """One open region: what recomputation needs to replay the blocks called so far."""

    generator: Any
    first_spec: Any  # the first block's (args, kwargs) tree
    first_leaves: list  # its leaves, tensors replaced by _SAVED (they come back as the region's saved inputs)
    later: list = field(default_factory=list)  # per later block: (tree spec, leaves as ("prev", i) / ("first", i) / value)
    previous: list = field(default_factory=list)  # the last block's output tensors, until the next block takes them
    first_tensors: list = field(default_factory=list)  # the first block's tensors, until the region closes
    buffers: BufferSnapshot | None = None  # the blocks' buffers as the forward found them (planned.buffers)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same tensor, or a view of it with the same layout (what `h = out.view(out.shape)` passes)."""
    if a is b:
        return True
    return (
        a._base is not None and a._base is (b._base if b._base is not None else b)
        and a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype
    )


@dataclass
class PlannedSegment:
    """Consecutive blocks checkpointed as one region; each block's forward is a `SegmentMember` of it."""

    unit: Segment
    modules: list[torch.nn.Module]
    choice: Choice
    originals: list[Any]  # each block's instance forward before the plan (None: its class's)
    region: _Region | None = None

    def __post_init__(self) -> None:
        # each block runs in the segment's precision, saving what it saves: the region does the checkpointing
        self.planned = [
            PlannedForward(module, Choice("keep", self.choice.precision), original=original)
            for module, original in zip(self.modules, self.originals)
        ]
        blocks = torch.nn.ModuleList(self.modules)  # registered nowhere
        self.buffer_writes = BufferWrites(blocks) if has_buffers(blocks) else None

    def call(self, index: int, args: tuple, kwargs: dict):
        if index == 0:
            self.abandon()  # a forward that stopped before the last block (an exception) left one open
            if torch.is_grad_enabled():
                return self._open(args, kwargs)
        if self.region is None:
            return self.planned[index](*args, **kwargs)  # no_grad, eval: nothing to recompute
        return self._continue(self.region, index, args, kwargs)

    def _open(self, args: tuple, kwargs: dict):
        args, kwargs = without_cache_writes(self.modules[0], args, kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        region = _Region(None, spec, [_SAVED if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], first_tensors=tensors,
                         buffers=self.buffer_writes.before_forward() if self.buffer_writes is not None else None)
        replay = functools.partial(self._replay, region)
        region.generator = _checkpoint_region(replay, True, noop_context_fn, "default", False, True, *tensors)
        with recomputing_whole(any(planned.recompute_whole for planned in self.planned)):  # read as the region opens
            next(region.generator)
        self.region = region
        return self._run(0, args, kwargs)

    def _continue(self, region: _Region, index: int, args: tuple, kwargs: dict):
        if index != len(region.later) + 1:
            self.abandon()
            raise SegmentError(f"segment {self.unit.name}: block {index} ran out of order; remove the plan (autoplan.remove_plan) and plan again")
        args, kwargs = without_cache_writes(self.modules[index], args, kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        region.later.append((spec, [self._source(region, index, leaf) for leaf in leaves]))
        return self._run(index, args, kwargs)

    def _source(self, region: _Region, index: int, leaf: Any):
        if not isinstance(leaf, torch.Tensor):
            return ("value", leaf)
        for position, tensor in enumerate(region.previous):
            if _same_tensor(leaf, tensor):
                return ("prev", position)
        for position, tensor in enumerate(region.first_tensors):
            if _same_tensor(leaf, tensor):
                return ("first", position)
        self.abandon()
        raise SegmentError(
            f"segment {self.unit.name}: block {index} was called with a tensor that is neither the previous block's output "
            "nor an argument of the first block, so the segment cannot be recomputed; plan again without segments "
            "(autoplan.plan(..., segments=False))"
        )

    def _run(self, index: int, args: tuple, kwargs: dict):
        try:
            output = self.planned[index](*args, **kwargs)
        except BaseException:
            self.abandon()
            raise
        region = self.region
        assert region is not None  # _open or _continue ran this block in it
        if index == len(self.modules) - 1:
            self.region = None
            if self.buffer_writes is not None:
                self.buffer_writes.after_forward(region.buffers)
            # the region's own saved inputs keep what recomputation needs; references of ours would
            # keep the first block's inputs alive as long as the graph
            region.previous, region.first_tensors = [], []
            next(region.generator, None)  # closes the region: its hooks come off
        else:
            region.previous = [leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, torch.Tensor)]
        return output

    def abandon(self) -> None:
        """Close an open region without finishing it (its hooks come off; its backward is not ours to save)."""
        region, self.region = self.region, None
        if region is not None:
            region.previous, region.first_tensors = [], []
            region.generator.close()

    def _replay(self, region: _Region, *first_tensors: torch.Tensor):
        """Recomputation: every block again, each fed the previous one's output, on the forward's buffer copies."""
        if self.buffer_writes is None:
            return self._replay_blocks(region, first_tensors)
        with self.buffer_writes.recomputing(region.buffers):
            return self._replay_blocks(region, first_tensors)

    def _replay_blocks(self, region: _Region, first_tensors: tuple):
        supply = iter(first_tensors)
        leaves = [next(supply) if leaf is _SAVED else leaf for leaf in region.first_leaves]
        args, kwargs = tree_unflatten(leaves, region.first_spec)
        output = self.planned[0](*args, **kwargs)
        for index, (spec, sources) in enumerate(region.later, 1):
            previous = [leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, torch.Tensor)]
            leaves = [previous[i] if kind == "prev" else first_tensors[i] if kind == "first" else i for kind, i in sources]
            args, kwargs = tree_unflatten(leaves, spec)
            output = self.planned[index](*args, **kwargs)
        return output


@dataclass
class SegmentMember:
    """One block's forward inside a segment: it runs through the segment's region."""

    segment: PlannedSegment
    index: int
    original: Any = None  # the block's instance forward before the plan

    @property
    def choice(self) -> Choice:
        return self.segment.choice

    # torch.compile cannot trace a region opened in one call and closed in another: the blocks of a
    # segment run eagerly (graph breaks around them), the rest of the model compiled
    @torch.compiler.disable
    def __call__(self, *args, **kwargs):
        return self.segment.call(self.index, args, kwargs)
