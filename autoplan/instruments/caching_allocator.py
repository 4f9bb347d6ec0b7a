"""A model of PyTorch's CUDA caching allocator: what a sequence of allocations and frees reserves.

`torch.cuda.max_memory_allocated` counts live blocks; what the card gives up is the allocator's
*reserved* memory, the segments it took from cudaMalloc and keeps. Between the two lies the free
space inside those segments that the next request could not use. This replays allocations and frees
through the rules of c10/cuda/CUDACachingAllocator.cpp (one stream, no memory fraction, the default
`max_split_size`), so a simulated step's reserved peak can be predicted beside its allocated one:

- a request is rounded up to 512 bytes; up to 1 MiB it is *small*, above it *large*, each pool apart;
- a request takes the smallest free cached block that holds it (ties: the lowest address);
- if none does, a new segment: 2 MiB for a small request, 20 MiB for a large one under 10 MiB, else
  the request rounded up to 2 MiB;
- the block is split when what remains is at least 512 bytes (small pool) or more than 1 MiB (large);
- a freed block merges with free neighbours of its segment; segments go back only on `empty_cache`
  (expandable segments: only a wholly free one, where torch also unmaps a free tail's pages).

With ``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) each pool has one
segment that grows at its end by pages, 2 MiB for the small pool and 20 MiB for the large, when no
free block holds a request; any remainder of at least 512 bytes is split off. Among free blocks that
fit, the one at the segment's growing end is taken last.

What it leaves out, each rare in a training step: other streams (a block freed while another stream
uses it waits for an event), `max_split_size_mb`, `roundup_power2_divisions`, the garbage collection
threshold, and a card shared with other processes. With a limit (``limit_bytes``, what
`torch.cuda.set_per_process_memory_fraction` or the card itself allows) a request that would take the
reserved memory past it is retried as the allocator retries a failed cudaMalloc: every cached segment
none of whose bytes are allocated is given back, then the segment is asked for again; if it still does
not fit, the request is out of memory (`AllocatorOutOfMemory`). With expandable segments only wholly
free segments are given back here, where torch also unmaps the free pages inside a segment: the model
runs out of memory sooner, never later. `least_limit_bytes` searches the smallest limit a step runs
under. `benchmarks/allocator_replay.py` replays the caching allocator's own traces from an H100
through this model and prints where they disagree.
"""

from __future__ import annotations

import bisect
import itertools
import os
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from autoplan.vocabulary.tensors import ALLOCATION_GRANULE, rounded_bytes

MIN_BLOCK = ALLOCATION_GRANULE  # kMinBlockSize (512): every request rounds up to a multiple
SMALL_REQUEST = 1 << 20  # kSmallSize: the largest request the small pool serves
SMALL_SEGMENT = 2 << 20  # kSmallBuffer: a small pool's segment (and its expandable page)
LARGE_SEGMENT = 20 << 20  # kLargeBuffer: a 1–10 MiB request's segment (and the large pool's expandable page)
LARGE_ROUNDED_FROM = 10 << 20  # kMinLargeAlloc: from here a segment is the request rounded to 2 MiB
LARGE_ROUNDING = 2 << 20  # kRoundLarge


def rounded(nbytes: int) -> int:
    """A request's size as the allocator hands it out (what `max_memory_allocated` counts): even 0 bytes take a block."""
    return max(MIN_BLOCK, rounded_bytes(nbytes))


def segment_size(size: int) -> int:
    """The cudaMalloc a rounded request makes when no cached block holds it (get_allocation_size)."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < LARGE_ROUNDED_FROM:
        return LARGE_SEGMENT
    return -(-size // LARGE_ROUNDING) * LARGE_ROUNDING


class AllocatorOutOfMemory(Exception):
    """A request the allocator cannot serve within its limit, even after giving its cached segments back."""


def expandable_from_environment() -> bool:
    """Whether PYTORCH_CUDA_ALLOC_CONF turns expandable segments on in this process."""
    settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    pairs = dict(item.split(":", 1) for item in settings.replace(" ", "").split(",") if ":" in item)
    return pairs.get("expandable_segments", "False").lower() == "true"


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None
    at_growing_end: bool = False  # expandable: the last mapped block, which can grow into unmapped pages


@dataclass
class _Pool:
    small: bool
    # (size, address, block), sorted. Free blocks have distinct addresses, so tuples compare by (size, address)
    # and never reach the block; a (size, address) pair sorts just before its own entry. No key function:
    # a replay calls these hundreds of thousands of times (a Planner's re-plan replays every candidate)
    free: list[tuple[int, int, _Block]] = field(default_factory=list)
    tail: _Block | None = None  # expandable: the last block of the pool's one segment
    mapped_end: int = 0  # expandable: the segment's first unmapped address

    def insert(self, block: _Block) -> None:
        bisect.insort(self.free, (block.size, block.address, block))

    def remove(self, block: _Block) -> None:
        index = bisect.bisect_left(self.free, (block.size, block.address))
        assert self.free[index][2] is block, "a free block the pool does not hold"
        del self.free[index]


class CachingAllocatorModel:
    """Reserved and allocated bytes of a sequence of `malloc`/`free` calls, as torch's CUDA allocator keeps them."""

    def __init__(self, *, expandable_segments: bool = False, limit_bytes: int | None = None) -> None:
        self.expandable = expandable_segments
        self.limit_bytes = limit_bytes
        self.pools = {True: _Pool(True), False: _Pool(False)}
        self.reserved_bytes = self.peak_reserved_bytes = 0
        self.allocated_bytes = self.peak_allocated_bytes = 0
        self._addresses = itertools.count(1 << 40, 1 << 36)  # a fresh address range per segment, increasing

    # -- the public calls --------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> _Block:
        """Hand out a block for a request of `nbytes`, taking a new segment (or pages) if none is free."""
        size = rounded(nbytes)
        pool = self.pools[size <= SMALL_REQUEST]
        block = self._best_fit(pool, size) or self._grow(pool, size)
        if block is None:  # over the limit: give the cache back and ask again, as alloc_block's retry does
            self.empty_cache()
            block = self._grow(pool, size)
        if block is None:
            raise AllocatorOutOfMemory(f"{size} bytes requested with {self.reserved_bytes} of {self.limit_bytes} reserved")
        if self._should_split(block, size):
            block = self._split(pool, block, size)
        block.allocated = True
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return block

    def free(self, block: _Block) -> None:
        """Return a block to its pool's cache, merged with free neighbours."""
        assert block.allocated, "freed twice"
        block.allocated = False
        self.allocated_bytes -= block.size
        pool = self.pools[block.small]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                pool.remove(neighbour)
                self._merge(block, neighbour)
        block.at_growing_end = self.expandable and block.next is None
        pool.insert(block)

    def empty_cache(self) -> None:
        """Give back every segment none of whose bytes are allocated (expandable: only a wholly free one)."""
        for pool in self.pools.values():
            for size, address, block in list(pool.free):
                if block.prev is None and block.next is None:
                    pool.remove(block)
                    self.reserved_bytes -= block.size
                    if self.expandable:
                        pool.tail, pool.mapped_end = None, 0

    # -- the rules -----------------------------------------------------------------------------------
    def _best_fit(self, pool: _Pool, size: int) -> _Block | None:
        index = bisect.bisect_left(pool.free, (size, -1))
        if index == len(pool.free):
            return None
        block = pool.free[index][2]
        # the growing end counts as big as it can grow: a later block that fits is taken before it
        if block.at_growing_end and index + 1 < len(pool.free):
            block = pool.free[index + 1][2]
        pool.remove(block)
        return block

    def _grow(self, pool: _Pool, size: int) -> _Block | None:
        if self.limit_bytes is not None and self.reserved_bytes + segment_size(size) > self.limit_bytes:
            return None  # alloc_block checks the request's segment size against the limit, expandable or not
        if not self.expandable:
            grown = segment_size(size)
            block = _Block(next(self._addresses), grown, pool.small)
            self._reserve(grown)
            return block
        page = SMALL_SEGMENT if pool.small else LARGE_SEGMENT
        tail = pool.tail if pool.tail is not None and not pool.tail.allocated else None
        have = tail.size if tail is not None else 0
        pages = -(-(size - have) // page)
        self._reserve(pages * page)
        if tail is not None:
            pool.remove(tail)
            tail.size += pages * page
            pool.mapped_end += pages * page
            return tail
        if pool.tail is None:
            pool.mapped_end = next(self._addresses)
        block = _Block(pool.mapped_end, pages * page, pool.small, prev=pool.tail, at_growing_end=True)
        if pool.tail is not None:
            pool.tail.next, pool.tail.at_growing_end = block, False
        pool.tail = block
        pool.mapped_end += pages * page
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.expandable:
            return remaining >= MIN_BLOCK
        return remaining > SMALL_REQUEST

    def _split(self, pool: _Pool, block: _Block, size: int) -> _Block:
        """The first `size` bytes of `block` handed out; the rest stays a free block after it."""
        rest = _Block(block.address + size, block.size - size, block.small, prev=block, next=block.next,
                      at_growing_end=block.at_growing_end)
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size, block.at_growing_end = rest, size, False
        if pool.tail is block:
            pool.tail = rest
        pool.insert(rest)
        return block

    def _merge(self, block: _Block, neighbour: _Block) -> None:
        """Absorb a free neighbour into `block` (the neighbour's place in the segment becomes the block's)."""
        if neighbour is block.prev:
            block.address, block.prev = neighbour.address, neighbour.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
            if self.pools[block.small].tail is neighbour:
                self.pools[block.small].tail = block
        block.size += neighbour.size

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)


WARM_UP = "warm-up"  # the label the simulation gives the phase that makes the earlier steps' state
CARRIED = "carried"  # the log's mark before the loop lets go of what it carried through the step (outputs, loss)


def steady_reserved_bytes(log: Sequence[tuple[str, Hashable, int]], *, expandable_segments: bool = False,
                          steps: int = 3, limit_bytes: int | None = None) -> int:
    """What the caching allocator holds reserved after `steps` real training steps, from one simulated step's log.

    The log (`LiveBytesTracker.allocation_log`) holds, in order: what exists before training (parameters,
    workspaces, the batch), the *warm-up* that makes what earlier steps leave (`WARM_UP`: gradients,
    the optimizer's state), then one recorded step, its phases labelled, and after `CARRIED` the frees of
    what the loop's variables held through it. A real first step differs from the recorded one in where
    the optimizer's state comes from: `optimizer.step()` makes it lazily, after the first backward has
    freed its activations, so it lands in their freed blocks. So the replay is: the start; step 1 = the
    recorded forward and backward, the state's allocations (those the warm-up made that the log never
    frees), the recorded optimizer phase; then the recorded step again, each step letting go of the
    previous one's outputs when its forward returns (where the loop reassigns them). What the recorded
    step allocates and never frees is made once, in step 1. Without `empty_cache` reserved memory never
    shrinks, so its figure at the end is the peak. With `limit_bytes` the replay runs as under that limit
    (AllocatorOutOfMemory where the steps would not run) and the figure is its reserved peak.
    """
    return _replayed(log, expandable_segments, steps, limit_bytes).peak_reserved_bytes


def least_limit_bytes(log: Sequence[tuple[str, Hashable, int]], *, expandable_segments: bool = False, steps: int = 3,
                      resolution: int = SMALL_SEGMENT) -> int:
    """The smallest memory limit (to `resolution`) under which the caching allocator runs `steps` steps of the log.

    Between the allocated peak and the reserved peak: under a lower limit the allocator gives its cached
    segments back when a request would pass it and asks again, so a step can run in less than it reserves
    when free, until the free space left inside segments still in use is too scattered for a request.
    Searched by halving, as `benchmarks/gpu_capped.py` searches it on a GPU with
    `torch.cuda.set_per_process_memory_fraction`.
    """
    free = _replayed(log, expandable_segments, steps, None)
    low, high = free.peak_allocated_bytes - 1, free.peak_reserved_bytes  # low fails (reserved >= allocated), high runs
    while high - low > resolution:
        middle = (low + high) // 2
        try:
            _replayed(log, expandable_segments, steps, middle)
            high = middle
        except AllocatorOutOfMemory:
            low = middle
    return high


def _replayed(log: Sequence[tuple[str, Hashable, int]], expandable_segments: bool, steps: int,
              limit_bytes: int | None) -> CachingAllocatorModel:
    """The allocator after the replay `steady_reserved_bytes` describes."""
    freed = {handle for action, handle, _ in log if action == "free"}
    start, warm_up, forward, backward, optimizer, carried = _split_log(log)
    state = [entry for entry in warm_up if entry[0] == "alloc" and entry[1] not in freed]
    model = CachingAllocatorModel(expandable_segments=expandable_segments, limit_bytes=limit_bytes)
    blocks: dict[Hashable, _Block] = {}
    _replay(model, start, blocks)
    previous: list[_Block] = []  # what the previous step's loop variables still hold
    for step in range(steps):
        renamed: dict[Hashable, _Block] = {}
        _replay(model, forward, blocks, renamed=renamed, once=step == 0, freed=freed)
        for block in previous:
            model.free(block)
        _replay(model, backward, blocks, renamed=renamed, once=step == 0, freed=freed)
        if step == 0:
            _replay(model, state, blocks)
        _replay(model, optimizer, blocks, renamed=renamed, once=step == 0, freed=freed)
        previous = [renamed.pop(handle) for action, handle, _ in carried if action == "free" and handle in renamed]
    return model


def _split_log(log: Sequence[tuple[str, Hashable, int]]) -> list[list]:
    """The log's start, warm-up, the recorded step's forward, backward, optimizer phase onwards, and what follows `CARRIED`."""
    parts: list[list] = [[], [], [], [], [], []]
    part = 0
    for entry in log:
        action, label, _ = entry
        if action != "phase":
            parts[part].append(entry)
        elif label == WARM_UP:
            part = 1
        elif label == CARRIED:
            part = 5
        elif part == 1:
            part = 2
        elif part == 2 and getattr(label, "kind", None) == "bwd":
            part = 3
        elif part == 3 and getattr(label, "kind", None) == "step":
            part = 4
    return parts


def _replay(model: CachingAllocatorModel, entries: list, blocks: dict, *, renamed: dict | None = None,
            once: bool = True, freed: set | None = None) -> None:
    """Allocate and free `entries` in `model`. With `renamed`, a repeated step's blocks are its own: an
    allocation the log frees goes there, one it never frees (`freed`) is made only `once`, into `blocks`."""
    for action, handle, nbytes in entries:
        if action == "alloc":
            if renamed is not None and handle in (freed or ()):
                renamed[handle] = model.malloc(nbytes)
            elif renamed is None or once:
                blocks[handle] = model.malloc(nbytes)
        elif renamed is not None and handle in renamed:
            model.free(renamed.pop(handle))
        elif handle in blocks:  # made before this step (the start, the warm-up), freed here once
            model.free(blocks.pop(handle))
