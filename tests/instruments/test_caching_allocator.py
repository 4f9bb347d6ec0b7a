"""The caching allocator model: PyTorch's documented rules case by case, an H100's own traces replayed, and
the steady-state replay of a simulated step's log."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from autoplan.instruments.caching_allocator import (
    CARRIED,
    WARM_UP,
    AllocatorOutOfMemory,
    CachingAllocatorModel,
    expandable_from_environment,
    least_limit_bytes,
    rounded,
    segment_size,
    steady_reserved_bytes,
)
from autoplan.plan import BACKWARD_START, FORWARD_START, OPTIMIZER_STEP
from benchmarks.allocator_replay import replay

MiB = 2**20
TRACES = Path(__file__).resolve().parents[2] / "benchmarks/results/h100_2026-11-27"


def test_requests_round_to_512_bytes_and_segments_by_size_class():
    assert rounded(1) == 512 and rounded(512) == 512 and rounded(513) == 1024
    assert segment_size(1 * MiB) == 2 * MiB  # small: packed in 2 MiB
    assert segment_size(1 * MiB + 512) == 20 * MiB  # 1–10 MiB: a 20 MiB segment to split
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB - 512) == 12 * MiB  # rounded to 2 MiB


def test_small_requests_share_a_2_mib_segment():
    allocator = CachingAllocatorModel()
    blocks = [allocator.malloc(100) for _ in range(4096)]  # 4096 × 512 B = 2 MiB exactly
    assert allocator.reserved_bytes == 2 * MiB and allocator.allocated_bytes == 2 * MiB
    allocator.malloc(100)
    assert allocator.reserved_bytes == 4 * MiB
    for block in blocks:
        allocator.free(block)
    assert allocator.reserved_bytes == 4 * MiB  # cached, not given back


def test_mid_sized_requests_split_one_20_mib_segment_and_merge_back_when_freed():
    allocator = CachingAllocatorModel()
    a, b, c = (allocator.malloc(6 * MiB) for _ in range(3))
    assert allocator.reserved_bytes == 20 * MiB  # 18 MiB of one segment, 2 MiB left free
    allocator.free(a)
    allocator.free(b)
    allocator.malloc(12 * MiB)  # a and b merged into one 12 MiB block: no new segment
    assert allocator.reserved_bytes == 20 * MiB
    allocator.free(c)


def test_a_free_block_too_small_for_the_request_leaves_it_unused():
    allocator = CachingAllocatorModel()
    a = allocator.malloc(12 * MiB)
    keep = allocator.malloc(12 * MiB)
    allocator.free(a)  # a 12 MiB hole
    allocator.malloc(14 * MiB)  # does not fit the hole: a new 14 MiB segment
    assert allocator.reserved_bytes == 12 * MiB + 12 * MiB + 14 * MiB
    assert allocator.allocated_bytes == 26 * MiB
    allocator.free(keep)


def test_best_fit_takes_the_smallest_free_block_that_holds_the_request():
    allocator = CachingAllocatorModel()
    big, small = allocator.malloc(40 * MiB), allocator.malloc(12 * MiB)
    allocator.free(big)
    allocator.free(small)
    allocator.malloc(12 * MiB)  # takes the 12 MiB block, so the 40 MiB one still holds 40
    allocator.malloc(40 * MiB)
    assert allocator.reserved_bytes == 52 * MiB


def test_large_blocks_split_only_when_more_than_1_mib_remains():
    allocator = CachingAllocatorModel()
    block = allocator.malloc(19 * MiB)  # rounded to a 20 MiB segment: 1 MiB remains, not split off
    assert block.size == 20 * MiB and allocator.allocated_bytes == 20 * MiB


def test_empty_cache_gives_back_only_wholly_free_segments():
    allocator = CachingAllocatorModel()
    a, b = allocator.malloc(6 * MiB), allocator.malloc(30 * MiB)
    allocator.free(b)
    allocator.empty_cache()
    assert allocator.reserved_bytes == 20 * MiB  # a's segment stays
    allocator.free(a)
    allocator.empty_cache()
    assert allocator.reserved_bytes == 0


def test_expandable_segments_grow_by_pages_at_the_end():
    allocator = CachingAllocatorModel(expandable_segments=True)
    a = allocator.malloc(30 * MiB)
    assert allocator.reserved_bytes == 40 * MiB  # two 20 MiB pages
    allocator.malloc(30 * MiB)  # the 10 MiB free at the end and one more page
    assert allocator.reserved_bytes == 60 * MiB
    allocator.free(a)
    allocator.malloc(25 * MiB)  # fits the freed block at the start
    assert allocator.reserved_bytes == 60 * MiB


def test_expandable_segments_are_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    assert expandable_from_environment()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not expandable_from_environment()


@pytest.mark.parametrize("name, expandable", [("bert", False), ("bert_expandable", True)])
def test_an_h100s_own_allocator_traces_replay_to_its_reserved_peak(name, expandable):
    # bert-large training steps recorded on an H100 from an empty cache (benchmarks/gpu_truth.py, part bert):
    # every allocation and free in order, and every segment the allocator took
    traces = json.load(gzip.open(TRACES / f"{name}_traces.json.gz", "rt"))
    for run in ("batch 4", "batch 4, checkpointing, fp16"):
        replayed = replay(traces[run], expandable=expandable)  # benchmarks/allocator_replay.py's table
        measured, modelled = replayed["trace_peak"], replayed["model_peak"]
        assert abs(modelled - measured) <= 0.005 * measured, (run, measured / MiB, modelled / MiB)


def _log(*parts: list) -> list:
    return [entry for part in parts for entry in part]


def test_the_optimizer_state_of_a_real_first_step_lands_in_the_activations_freed_blocks():
    # parameters 30 MiB; each step saves two 100 MiB activations; AdamW's state: two 30 MiB tensors
    start = [("alloc", "param", 30 * MiB)]
    warm_up = [("phase", WARM_UP, 0), ("alloc", "grad0", 30 * MiB), ("alloc", "m", 30 * MiB), ("alloc", "v", 30 * MiB),
               ("free", "grad0", 0)]
    forward = [("phase", FORWARD_START, 0), ("alloc", "act1", 100 * MiB), ("alloc", "act2", 100 * MiB)]
    backward = [("phase", BACKWARD_START, 0), ("free", "act2", 0), ("free", "act1", 0), ("alloc", "grad", 30 * MiB)]
    step = [("phase", OPTIMIZER_STEP, 0), ("free", "grad", 0)]
    reserved = steady_reserved_bytes(_log(start, warm_up, forward, backward, step))
    # step 1: grad, m and v split the first activation's freed 100 MiB segment, so step 2's second activation
    # finds no 100 MiB block and takes a third segment; state made before step 1 would need 290 MiB
    assert reserved == 30 * MiB + 3 * 100 * MiB


def test_outputs_the_loop_carries_are_freed_when_the_next_forward_returns():
    start = [("alloc", "param", 10 * MiB)]
    warm_up = [("phase", WARM_UP, 0)]
    forward = [("phase", FORWARD_START, 0), ("alloc", "logits", 50 * MiB)]
    backward = [("phase", BACKWARD_START, 0)]
    carried = [("phase", OPTIMIZER_STEP, 0), ("phase", CARRIED, 0), ("free", "logits", 0)]
    reserved = steady_reserved_bytes(_log(start, warm_up, forward, backward, carried))
    # step 2's logits are made while step 1's are alive: a second segment (freed at the end of step 1, one would do)
    assert reserved == 10 * MiB + 2 * 50 * MiB


def test_at_its_limit_the_allocator_gives_back_wholly_free_segments_and_asks_again():
    allocator = CachingAllocatorModel(limit_bytes=40 * MiB)
    held = allocator.malloc(9 * MiB)  # a 20 MiB segment that stays in use, 11 MiB of it free
    allocator.free(allocator.malloc(15 * MiB))  # a 16 MiB segment, cached
    other = allocator.malloc(18 * MiB)  # 16 + 20 + 18 > 40: the cached 16 MiB segment goes back first
    assert allocator.reserved_bytes == 38 * MiB and allocator.peak_reserved_bytes == 38 * MiB
    allocator.free(other)
    allocator.malloc(19 * MiB)  # a 20 MiB segment: 38 + 20 > 40, so the free 18 MiB one goes back
    assert allocator.reserved_bytes == 40 * MiB
    with pytest.raises(AllocatorOutOfMemory):
        allocator.malloc(19 * MiB)  # nothing wholly free to give back: `held`'s segment has 11 MiB free, but is in use
    assert held.allocated


def test_without_a_limit_the_same_requests_reserve_beyond_it():
    allocator = CachingAllocatorModel()
    allocator.free(allocator.malloc(18 * MiB))
    allocator.malloc(19 * MiB)
    assert allocator.reserved_bytes == 18 * MiB + 20 * MiB  # the cached segment is kept, a new one taken


def _freed_cache_log() -> list:
    """Parameters of 12 MiB; each step a 15 MiB activation (a 16 MiB segment) freed in backward, then an 18 MiB
    gradient buffer no free block holds: reserved grows to 46 MiB, though at most 30 MiB is alive at once."""
    return _log([("alloc", "param", 12 * MiB)], [("phase", WARM_UP, 0)],
                [("phase", FORWARD_START, 0), ("alloc", "act", 15 * MiB)],
                [("phase", BACKWARD_START, 0), ("free", "act", 0), ("alloc", "buffer", 18 * MiB)],
                [("phase", OPTIMIZER_STEP, 0), ("free", "buffer", 0)])


def test_the_least_limit_lies_below_the_free_running_reserved_peak_where_giving_back_the_cache_helps():
    log = _freed_cache_log()
    assert steady_reserved_bytes(log) == 12 * MiB + 16 * MiB + 18 * MiB
    least = least_limit_bytes(log)
    # at 30 MiB the activation's wholly free segment goes back before the buffer's is taken; later steps reuse it
    assert 30 * MiB <= least <= 32 * MiB
    assert steady_reserved_bytes(log, limit_bytes=least) <= least  # runs at the least limit, within it
    with pytest.raises(AllocatorOutOfMemory):
        steady_reserved_bytes(log, limit_bytes=30 * MiB - 512)  # below what is alive at once


def test_the_limit_is_checked_against_the_segment_a_request_asks_for_not_the_request():
    allocator = CachingAllocatorModel(limit_bytes=10 * MiB)
    with pytest.raises(AllocatorOutOfMemory):
        allocator.malloc(6 * MiB)  # its segment is 20 MiB, over the limit, and nothing is cached to give back
    allocator.malloc(10 * MiB)  # from 10 MiB a segment is the request's size: it fits exactly
    assert allocator.reserved_bytes == 10 * MiB
