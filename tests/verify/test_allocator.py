"""The independent count: c10's CPU allocator's own reports, replayed; nothing of the simulation's tracker."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from autoplan.verify.allocator import AllocatorCount, resident_bytes

MB = 1 << 20


def test_counts_what_is_allocated_and_freed_in_stretches():
    kept = torch.ones(MB // 4)  # 1 MB, alive before counting
    with AllocatorCount(resident=kept) as count:
        first = torch.empty(2 * MB, dtype=torch.uint8)
        del first
        count.mark("second")
        second = torch.empty(MB + 1, dtype=torch.uint8)  # rounded up to the next 512 B
    start, after = count.stretches()
    assert (start.label, after.label) == ("start", "second")
    assert start.start_bytes == MB and start.peak_bytes == 3 * MB
    assert after.start_bytes == MB and after.peak_bytes == 2 * MB + 512
    assert count.peak_bytes == 3 * MB
    del second


def test_sees_what_no_dispatch_mode_sees_inside_a_kernel():
    """A CPU kernel's own temporaries (here scaled_dot_product_attention's per-thread buffers) are allocated
    below every dispatch mode; the allocator reports them, so the count's peak is above the output's bytes."""
    q = torch.randn(2, 4, 128, 32)
    with AllocatorCount(resident=q) as count:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert count.peak_bytes > count.resident_bytes + out.untyped_storage().nbytes()


def test_leaves_out_what_a_gpu_would_hold_on_the_host():
    """Python numbers wrapped into 0-dim CPU tensors and the RNG state checkpoint keeps are host memory on CUDA."""
    x = torch.randn(256, requires_grad=True)  # 1 KB
    with AllocatorCount(resident=x) as count:
        y = x * 2.0  # saves the wrapped 2.0 for backward
        z = checkpoint(torch.sin, y, use_reentrant=False)  # saves the CPU RNG state
    assert count.peak_bytes == 3 * 1024  # x, y, z: nothing else
    del y, z


def test_holds_no_tensor():
    with AllocatorCount() as count:
        made = torch.ones(1000)
        watched = weakref.ref(made)
        del made
    gc.collect()
    assert watched() is None
    assert count.peak_bytes == 4096


def test_resident_bytes_walks_attributes_and_counts_storages_once():
    class Quantized(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(256))  # 1 KB
            self.state = {"absmax": torch.ones(512)}  # 2 KB, an attribute, neither parameter nor buffer
            self.tied = self.weight  # the same storage again

    assert resident_bytes(Quantized()) == 3 * 1024


def test_mark_outside_the_block_is_an_error():
    count = AllocatorCount()
    with pytest.raises(RuntimeError, match="inside its `with` block"):
        count.mark("x")
    with pytest.raises(RuntimeError, match="read after"):
        count.stretches()


def _freed_in_another_thread(tensor_list: list) -> None:
    # the profiler listens on the threads it was started in: a free in a thread of one's own is not reported
    # (gloo drops FSDP2's buffers so)
    import threading

    worker = threading.Thread(target=tensor_list.clear)
    worker.start()
    worker.join()


def test_a_mark_that_says_what_is_held_drops_frees_the_allocator_never_reported():
    counts = []
    for held in (None, 0):
        with AllocatorCount() as count:
            holder = [torch.empty(2**18)]  # 1 MiB
            _freed_in_another_thread(holder)
            count.mark("after", held_bytes=held)
            small = torch.empty(256)  # 1 KiB
            del small
        counts.append(count.stretches()[-1])
    unsaid, said = counts
    assert unsaid.start_bytes >= 2**20  # the free went unreported: the block still counts
    assert said.start_bytes == 0 and said.peak_bytes == 1024


def test_lists_the_blocks_alive_at_each_peak_by_their_maker_when_asked():
    kept = torch.ones(MB // 4)  # 1 MB, alive before counting
    with AllocatorCount(resident=kept, keep_peak_blocks=True) as count:
        first = torch.empty(2 * MB, dtype=torch.uint8)
        ones = torch.ones(MB // 4)
        del first
        count.mark("second")
        torch.zeros(MB // 8)  # made and freed: the second stretch peaks with it
    start, second = count.stretches()
    assert sum(line[0] for line in start.peak_blocks) == start.peak_bytes == 4 * MB
    assert start.peak_blocks[0][:3] == (2 * MB, 1, 2 * MB) and start.peak_blocks[0][3].startswith("aten::empty")
    makers = {line[3] for line in start.peak_blocks}
    assert "alive before counting" in makers and any("aten::ones" in maker for maker in makers)
    assert sum(line[0] for line in second.peak_blocks) == second.peak_bytes == 2 * MB + MB // 2
    assert any("aten::zeros" in line[3] for line in second.peak_blocks)
    with AllocatorCount() as plain:
        torch.ones(16)
    assert plain.stretches()[0].peak_blocks == ()  # not asked: nothing kept
    del ones


def _allocation(ident: int, address: int, size: int):
    """One record of the profiler's event tree as the replay reads it: an allocation (size > 0) or a free (< 0)."""
    fields = types.SimpleNamespace(alloc_size=size, ptr=address, device=torch.device("cpu"))
    return types.SimpleNamespace(name="[memory]", id=ident, start_time_ns=ident, extra_fields=fields, children=[], parent=None)


def test_a_free_never_reported_widens_the_count_into_a_range_that_holds_the_truth():
    """A block freed where the profiler does not listen (gloo drops the buffers of an FSDP2 collective in its own
    threads) counts until its address is handed out again: the count reads high, never low. `floor_bytes` is the
    count less the blocks alive whose frees were never reported, so the true peak lies between the two."""
    events = [_allocation(1, 0xA000, MB), _allocation(2, 0xB000, MB), _allocation(3, 0xC000, 2 * MB),
              # A's free is never reported: its address made again is how the count learns it
              _allocation(4, 0xA000, MB // 2), _allocation(5, 0xC000, -2 * MB)]
    stretch, = AllocatorCount()._replay(events)
    assert stretch.peak_bytes == 4 * MB  # A, B and C, as counted
    assert stretch.floor_bytes == 3 * MB + MB // 2  # B and C without A; then B, C and the block made at A's address
    reported = [_allocation(1, 0xA000, MB), _allocation(2, 0xA000, -MB), _allocation(3, 0xB000, 2 * MB)]
    stretch, = AllocatorCount()._replay(reported)
    assert stretch.peak_bytes == stretch.floor_bytes == 2 * MB  # every free reported: the count is exact


def test_an_all_gather_output_freed_unheard_and_never_reused_is_left_out_of_the_floor():
    """FSDP2 drops a unit's all-gather output right after copying out of it; when gloo's thread held its last
    reference the free goes unreported, and if its address is not handed out again before counting ends, no reuse
    tells. Such a block is out of the floor (it lived only within its gather); any other block never freed stays in."""
    gather = types.SimpleNamespace(name="FSDP::all_gather (layers.0)", parent=None, extra_fields=types.SimpleNamespace())
    inside_gloo = types.SimpleNamespace(name="c10d::_allgather_base_", parent=gather, extra_fields=types.SimpleNamespace())
    output, staged = _allocation(1, 0xA000, MB), _allocation(2, 0xD000, 4 * MB)
    output.parent, staged.parent = gather, inside_gloo
    events = [output, staged, _allocation(3, 0xB000, MB), _allocation(4, 0xC000, 2 * MB)]
    stretch, = AllocatorCount()._replay(events)
    assert stretch.peak_bytes == 4 * MB  # the output, B and C (gloo's own staging buffer never counts)
    assert stretch.floor_bytes == 3 * MB  # B and C: the output's free may have gone unheard
    reported = [output, _allocation(5, 0xA000, -MB), _allocation(6, 0xB000, 2 * MB)]
    stretch, = AllocatorCount()._replay(reported)
    assert stretch.peak_bytes == stretch.floor_bytes == 2 * MB  # its free heard: the count is exact
    kept = [_allocation(1, 0xA000, MB), _allocation(2, 0xB000, MB)]
    stretch, = AllocatorCount()._replay(kept)
    assert stretch.floor_bytes == 2 * MB  # a block made elsewhere and never freed is alive, as far as anyone can tell
    reduced = _allocation(1, 0xA000, MB)  # DTensor's all-reduce output, made inside the functional collective's op
    reduced.parent = types.SimpleNamespace(name="_c10d_functional::all_reduce", parent=None, extra_fields=types.SimpleNamespace())
    stretch, = AllocatorCount()._replay([reduced, _allocation(2, 0xB000, MB)])
    assert stretch.peak_bytes == 2 * MB and stretch.floor_bytes == MB  # its free may have gone unheard too
