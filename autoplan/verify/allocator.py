"""The independent measurement of a real CPU step: the CPU allocator's own count of bytes in use.

The simulation counts tensors with `instruments.tracker`, a dispatch mode over fake tensors. A
measurement that ran that same tracker over the real step would miss what it misses and keep what it
keeps, and so agree with it by construction. `AllocatorCount` shares no code, no hook and no idea
with it: c10's CPU allocator reports every allocation and free it makes, with its size, to
`torch.profiler` when `profile_memory=True`; this replays those reports in order and keeps a running
total. It sees every block the step allocates, those made inside a kernel where no dispatch mode
looks (oneDNN's workspaces, attention's per-thread buffers, bitsandbytes' dequantized weights)
included, and holds no reference to any tensor.

Each block counts rounded up to 512 bytes, as the CUDA caching allocator's `max_memory_allocated`
counts it, so the figure compares with a plan for a GPU. What was allocated before counting began
(the model, the batch) the allocator never reports: `resident_bytes` finds it by walking what the
model and the batch hold, storages counted once, and the count starts from there. A block allocated
before counting began and freed during it is not reported either (the profiler warns); the model's
own storages are not freed by a training step, and `AllocatorCount.unreported_frees` says when one was.

Blocks a GPU would not hold are left out, each for a CUDA fact: a Python number wrapped into a 0-dim
CPU tensor (and its dtype conversion inside a CPU kernel), the CPU RNG state checkpoint keeps, and the
buffers a collective's gloo backend stages inside the collective (NCCL's are not PyTorch's blocks).
The host copies autoplan's offload makes are counted apart (`host_peak_bytes`): they are made inside
a profiler record (`instruments.host.on_host`), the one thing of autoplan's this count reads, and a
GPU keeps them in pinned host memory.

What it cannot see: memory that is not c10's CPU allocator's (Python objects, a library's own
malloc), and an allocation on a thread the profiler does not follow.
"""

from __future__ import annotations

import itertools
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.profiler

from autoplan.instruments.host import HOST_ALLOCATIONS
from autoplan.instruments.host_blocks import cpu_allocations, host_only as _host_only, records_around as _records_around
from autoplan.vocabulary.descriptors import silenced

GRANULE = 512  # the CUDA caching allocator's smallest block: max_memory_allocated counts blocks of 512 B


def _rounded(nbytes: int) -> int:
    return -(-nbytes // GRANULE) * GRANULE


@dataclass(frozen=True)
class CountedStretch:
    """One stretch of a counted run, between two marks: the bytes in use when it began, and its peak."""

    label: str
    start_bytes: int
    peak_bytes: int
    # the most bytes surely in use: the count less the blocks alive then whose frees were never reported (found when
    # their address was handed out again). The stretch's true peak lies between the two; equal where none was late
    floor_bytes: int
    # with AllocatorCount(keep_peak_blocks=True): what was alive at the peak, largest first, each line the bytes of the
    # blocks one maker made of one size: (bytes in all, blocks, bytes each, the records around the allocation)
    peak_blocks: tuple[tuple[int, int, int, str], ...] = ()


class AllocatorCount:
    """Counts the bytes c10's CPU allocator holds while it is entered, from the allocator's own reports.

    `resident`: tensors alive before counting (their storages are counted once, rounded); `mark(label)`
    starts a new stretch. After the `with` block, `stretches()` gives each stretch's start and peak.
    """

    def __init__(self, resident: Any = (), keep_peak_blocks: bool = False) -> None:
        self._keep_peak_blocks = keep_peak_blocks  # a listing of each stretch's peak: slower, for finding what differs
        self._resident_blocks = resident_blocks(resident)
        self.resident_bytes = sum(self._resident_blocks.values())
        self._resident_storages = _storage_refs(resident)
        self._profile: torch.profiler.profile | None = None
        self._stretches: list[CountedStretch] | None = None
        self._marks = 0
        self._held: dict[int, int | None] = {}
        self.host_peak_bytes = 0  # most bytes of offloaded activations' host copies held at once
        self.host_bytes = 0  # those held when counting ended
        self.late_frees = 0  # blocks whose free went unreported, found when their address was handed out again

    def __enter__(self) -> "AllocatorCount":
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        made_before = torch.empty(1)
        with silenced(2):  # kineto prints its start and stop lines to the process's stderr
            self._profile.__enter__()
            # c10 warns once a process when a block made before counting is freed; have it warn here, unheard
            del made_before
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._profile is not None
        with silenced(2):
            self._profile.__exit__(*exc)
        recorded = self._profile.profiler
        results = recorded.kineto_results if recorded is not None else None
        if exc[0] is None and results is not None:
            self._stretches = self._replay(results.experimental_event_tree())
        self._profile = None

    def mark(self, label: str, held_bytes: int | None = None) -> None:
        """Begin a new stretch here (a step, a phase). `held_bytes`: what is truly alive here, where it is known (a
        walk of what the model, the optimizer and the batch hold between two steps); a count above it holds
        blocks whose frees went unreported (`late_frees`), and starts the stretch from it instead."""
        if self._profile is None:
            raise RuntimeError("AllocatorCount.mark() is called inside its `with` block")
        self._marks += 1
        self._held[self._marks] = held_bytes
        with torch.profiler.record_function(f"{_MARK}{self._marks}:{label}"):
            pass

    def stretches(self) -> list[CountedStretch]:
        if self._stretches is None:
            raise RuntimeError("the count is read after its `with` block has ended without an error")
        return list(self._stretches)

    @property
    def peak_bytes(self) -> int:
        return max(stretch.peak_bytes for stretch in self.stretches())

    @property
    def unreported_frees(self) -> int:
        """Storages alive when counting began and freed since: the allocator reported none of those frees."""
        return sum(1 for ref in self._resident_storages if ref() is None)

    def _replay(self, roots) -> list[CountedStretch]:
        events = _in_time_order(roots)
        freed_late, resident_freed_late = _freed_late(events, self._resident_blocks)
        in_use = self.resident_bytes
        late = {address: nbytes for address, nbytes in self._resident_blocks.items() if address in resident_freed_late}
        labels, starts, peaks, floors = ["start"], [in_use], [in_use], [in_use - sum(late.values())]
        counted: dict[int, int] = {}  # address of a block in use -> the bytes it counts
        resident = dict(self._resident_blocks)  # blocks from before counting: their frees are never reported
        host: dict[int, int] = {}  # the same for offloaded activations' host copies
        host_in_use = 0
        unsure: set[int] = set()  # blocks counted when a mark said what is held: alive or not, the count cannot tell
        listing = _PeakListing(self._keep_peak_blocks)
        for node in events:
            if node.name.startswith(_MARK):
                number, label = node.name[len(_MARK):].split(":", 1)
                held = self._held.get(int(number))
                if held is not None and in_use > held:
                    in_use, unsure, late = held, set(counted) | set(resident), {}  # what is held here is known
                labels.append(label)
                starts.append(in_use)
                peaks.append(in_use)
                floors.append(in_use - sum(late.values()))
                listing.begin(in_use, counted, resident, unsure)
                continue
            size, address = node.extra_fields.alloc_size, node.extra_fields.ptr
            if size > 0 and _host_copy(node):  # pinned host memory on a GPU: counted apart, as the plan counts it
                host[address] = _rounded(size)
                host_in_use += host[address]
                self.host_peak_bytes = max(self.host_peak_bytes, host_in_use)
            elif size > 0:
                # an address made again while its block still counts: that block was freed where the profiler does
                # not listen (another thread: gloo's collectives drop their buffers in theirs)
                # (or freed, made before counting, where the allocator reports no free: FSDP2's resized storages)
                self.late_frees += address in counted or address in resident
                freed = counted.pop(address, 0) + resident.pop(address, 0)
                in_use -= 0 if address in unsure else freed  # an unsure block's late free: the mark already left it out
                unsure.discard(address)
                late.pop(address, None)
                counted[address] = 0 if _host_only(node) or _backend_buffer(node) else _rounded(size)
                in_use += counted[address]
                if node.id in freed_late:
                    late[address] = counted[address]
                listing.made(address, node)
                floors[-1] = max(floors[-1], in_use - sum(late.values()))
                if in_use > peaks[-1]:
                    peaks[-1] = in_use
                    listing.peak(in_use, counted, resident, unsure)
            elif address in host:
                host_in_use -= host.pop(address)
            else:
                in_use -= counted.pop(address, 0)  # a block from before counting: its free is never reported
                unsure.discard(address)  # reported: it was alive, and in what the mark said is held
        self.host_bytes = host_in_use
        return [CountedStretch(*stretch) for stretch in zip(labels, starts, peaks, floors, listing.stretches)]


def _freed_late(events, resident: dict[int, int]) -> tuple[set[int], set[int]]:
    """The blocks whose frees the allocator never reported, each found when its address was handed out again while
    it still counted: the ids of their allocations, and the addresses of such blocks from before counting (the
    allocator reports no free of those: any block made at one's address means it was freed).

    A block handed to a collective (an FSDP2 all-gather output, a functional collective's output: DTensor's
    all-reduces, all-gathers and reduce-scatters) whose free was never reported and whose address was not handed out
    again before counting ended is one too: each lives within its step (FSDP2 drops an all-gather output right after
    copying out of it), and when gloo's thread held the last reference, it was freed there, unheard."""
    late_ids: set[int] = set()
    reused_resident: set[int] = set()
    live: dict[int, int] = {}  # address -> the id of the allocation there
    handed: dict[int, int] = {}  # the same for blocks handed to a collective (`_handed_to_a_collective`)
    for node in events:
        if node.name.startswith(_MARK):
            continue
        size, address = node.extra_fields.alloc_size, node.extra_fields.ptr
        if size > 0:
            if address in resident:
                reused_resident.add(address)
            if address in live:
                late_ids.add(live[address])
            live[address] = node.id
            handed.pop(address, None)
            if _handed_to_a_collective(node):
                handed[address] = node.id
        else:
            live.pop(address, None)
            handed.pop(address, None)
    return late_ids | set(handed.values()), reused_resident


def _handed_to_a_collective(allocation) -> bool:
    """A block a collective writes into: an FSDP2 all-gather's output (made by FSDP outside the collective) or a
    functional collective's output (made inside its op); not a backend's own staging buffer, which is never counted."""
    return _made_inside(allocation, lambda name: name.startswith(_HANDED)) and not _backend_buffer(allocation)


# FSDP2's record around one unit's all-gather (its copy-out is a record apart), and torch's functional collectives
_HANDED = ("FSDP::all_gather (", "_c10d_functional::")


class _PeakListing:
    """The blocks alive at each stretch's peak, by who made them (kept only when asked: a copy at every new peak)."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.makers: dict[int, str] = {}
        self.stretches: list[tuple] = [()]

    def made(self, address: int, node) -> None:
        if self.keep:
            self.makers[address] = " < ".join(record.name for record in itertools.islice(_records_around(node), 4))

    def begin(self, in_use: int, counted: dict[int, int], resident: dict[int, int], unsure: set[int]) -> None:
        self.stretches.append(())
        self.peak(in_use, counted, resident, unsure)

    def peak(self, in_use: int, counted: dict[int, int], resident: dict[int, int], unsure: set[int]) -> None:
        if not self.keep:
            return
        groups: dict[tuple[str, int], list[int]] = {}
        for address, nbytes in [*counted.items(), *resident.items()]:
            if nbytes and address not in unsure:
                maker = self.makers.get(address, "alive before counting") if address in counted else "alive before counting"
                groups.setdefault((maker, nbytes), []).append(nbytes)
        listed = sum(sum(sizes) for sizes in groups.values())
        if in_use > listed:  # what a mark said is held, of blocks whose frees the count can no longer tell
            groups[("held at the mark", in_use - listed)] = [in_use - listed]
        lines = [(sum(sizes), len(sizes), size, maker) for (maker, size), sizes in groups.items()]
        self.stretches[-1] = tuple(sorted(lines, reverse=True))


_MARK = "autoplan.allocator_count."


def _backend_buffer(allocation) -> bool:
    """A block a collective's backend makes inside the collective (`c10d::_allgather_base_`, `gloo:all_reduce`): gloo
    stages its CPU all-gathers and reduce-scatters in blocks of c10's allocator (a clone of the input, a gather buffer)
    and drops them in threads of its own, where no free is reported. A GPU's NCCL writes into the tensors it is handed
    and holds its own buffers outside PyTorch's caching allocator; the buffers FSDP2 hands it (its all-gather outputs,
    reduce-scatter inputs and outputs) are made outside the collective and counted."""
    return _made_inside(allocation, lambda name: name.startswith(_COLLECTIVES))


_COLLECTIVES = ("c10d::", "gloo:")


def _made_inside(allocation, named: Callable[[str], bool]) -> bool:
    """Whether a block was made inside a profiler record whose name `named` accepts."""
    return any(named(record.name) for record in _records_around(allocation))


def _host_copy(allocation) -> bool:
    """Made where autoplan's offload makes its host copies (`instruments.host.on_host`, named in the profile)."""
    return _made_inside(allocation, lambda name: name == HOST_ALLOCATIONS)


def _in_time_order(roots) -> list:
    """The CPU allocator's blocks and this count's marks in a profile's event tree, oldest first."""
    return cpu_allocations(roots, marks=_MARK)


def resident_bytes(roots: Any) -> int:
    """Bytes of the distinct storages reachable from `roots` (a model, a batch, an optimizer), each rounded
    up to 512 B: parameters, buffers, and any tensor an attribute holds (a quantized layer's state)."""
    return sum(resident_blocks(roots).values())


def resident_blocks(roots: Any) -> dict[int, int]:
    """The CPU blocks behind the storages reachable from `roots`: address -> rounded bytes."""
    seen: dict[int, int] = {}
    for tensor in _reachable_tensors(roots):
        storage = tensor.untyped_storage()
        if storage.device.type != "cpu" or storage.nbytes() == 0:
            continue
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), _rounded(storage.nbytes()))
    return seen


def _storage_refs(roots: Any) -> list[weakref.ref]:
    refs = []
    for tensor in _reachable_tensors(roots):
        try:
            refs.append(weakref.ref(tensor.untyped_storage()))
        except TypeError:  # a storage type without weak references: nothing to watch
            pass
    return refs


_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)


def _reachable_tensors(roots: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `roots` through containers, modules and plain objects' attributes, once.

    Functions, classes and modules of Python are not followed: through their globals every tensor of the
    process would be reachable."""
    pending, visited = [roots], set()
    while pending:
        item = pending.pop()
        if id(item) in visited or isinstance(item, _LEAVES):
            continue
        visited.add(id(item))
        if isinstance(item, torch.Tensor):
            yield item
            pending.extend(t for t in (item.grad if item.is_leaf else None, *_tensor_attributes(item)) if t is not None)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            pending.extend(item)
        elif isinstance(item, (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
            continue
        elif hasattr(item, "__dict__"):
            pending.extend(vars(item).values())
        elif hasattr(type(item), "__slots__"):
            pending.extend(getattr(item, slot, None) for slot in type(item).__slots__ if isinstance(slot, str))


def _tensor_attributes(tensor: torch.Tensor) -> list[Any]:
    """What a tensor subclass or a parameter class carries beside its data (bitsandbytes' quant_state, CB, SCB)."""
    held = getattr(tensor, "__dict__", None)
    return list(held.values()) if held else []


