"""The live-bytes tracker (`instruments.tracker`), on its own: the bytes it counts for known
allocations and frees, views and in-place ops that allocate nothing, phases, adopted tensors, host
copies apart from device bytes, and the roofline time it charges each op from its FLOPs, its bytes
and the device's rates."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from autoplan.instruments.host import on_host
from autoplan.instruments.tracker import FusedElementwiseRates, LiveBytesTracker, op_roofline
from autoplan.vocabulary.tensors import ALLOCATION_GRANULE


@dataclass(frozen=True)
class Rates:
    """A device with round rates, so every expected time is a hand computation."""

    fp32_flops: float = 1e9
    bf16_flops: float = 4e9
    memory_bandwidth: float = 1e9

    def flops_for(self, dtype: torch.dtype, *, allow_tf32: bool = False) -> float:
        return self.bf16_flops if dtype == torch.bfloat16 else self.fp32_flops


def test_counts_a_known_allocation_rounded_up_and_frees_it() -> None:
    with LiveBytesTracker(Rates()) as tracker:
        x = torch.empty(1000)  # 4000 bytes: the allocator's granule rounds it up to 4096
        assert tracker.live_bytes == 4096 == 8 * ALLOCATION_GRANULE
        y = torch.empty(128)  # exactly one granule
        assert tracker.live_bytes == 4096 + 512
        del x
        assert tracker.live_bytes == 512
        del y
        assert tracker.live_bytes == 0
    assert tracker.phases()[-1].peak_bytes == 4096 + 512


def test_views_and_in_place_ops_allocate_nothing() -> None:
    with LiveBytesTracker(Rates()) as tracker:
        x = torch.zeros(256)
        before = tracker.live_bytes
        view = x.view(16, 16)
        view.add_(1.0)
        x[:10].mul_(2.0)
        assert tracker.live_bytes == before == 1024
        z = x + 1  # a new storage
        assert tracker.live_bytes == 2048
        del view, z
        assert tracker.live_bytes == 1024


def test_phases_record_the_bytes_they_start_with_and_their_own_peak() -> None:
    with LiveBytesTracker(Rates()) as tracker:
        kept = torch.empty(256)  # 1024 bytes, live through both phases
        tracker.begin_phase("forward")
        temporary = torch.empty(1024)  # 4096 bytes
        del temporary
        tracker.begin_phase("backward")
        small = torch.empty(128)  # 512 bytes
        assert tracker.current_phase == "backward" and tracker.phase_count == 3
    start, forward, backward = tracker.phases()
    assert (start.label, start.peak_bytes) == ("start", 1024)
    assert (forward.label, forward.start_bytes, forward.peak_bytes) == ("forward", 1024, 1024 + 4096)
    assert (backward.label, backward.start_bytes, backward.peak_bytes) == ("backward", 1024, 1024 + 512)
    assert [p.label for p in tracker.phases(since=1)] == ["forward", "backward"]
    del kept, small


def test_adopted_tensors_count_once_and_free_when_they_die() -> None:
    weight = torch.empty(1000)
    tracker = LiveBytesTracker(Rates())
    tracker.adopt([weight, weight, weight.view(10, 100)])  # one storage, however often it is named
    assert tracker.live_bytes == 4096
    del weight
    assert tracker.live_bytes == 0


def test_host_copies_are_counted_apart_in_powers_of_two() -> None:
    with LiveBytesTracker(Rates()) as tracker:
        with on_host():
            copy = torch.empty(300)  # 1200 bytes: the pinned allocator hands out a 2048-byte block
        assert (tracker.live_bytes, tracker.host_bytes, tracker.host_peak_bytes) == (0, 2048, 2048)
        del copy
        assert (tracker.host_bytes, tracker.host_peak_bytes) == (0, 2048)


def test_watch_records_the_last_phase_that_reads_a_tensor() -> None:
    with LiveBytesTracker(Rates()) as tracker:
        saved = torch.ones(8)
        tracker.watch(saved, key=7)
        tracker.begin_phase("forward")
        tracker.begin_phase("backward")
        _ = saved * 2  # read in phase 2
        tracker.begin_phase("optimizer")
        _ = torch.zeros(8) + 1  # does not read it
    assert tracker.last_use[7] == 2


def test_roofline_of_a_matmul_is_the_slower_of_its_flops_and_its_bytes() -> None:
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    out = torch.mm(a, b)
    flops = 2 * 64 * 32 * 16
    moved = (64 * 32 + 32 * 16 + 64 * 16) * 4
    compute_bound = Rates(fp32_flops=1e6, memory_bandwidth=1e12)
    cost = op_roofline(compute_bound, torch.ops.aten.mm.default, (a, b), {}, out, [a, b, out])
    assert cost.flops == flops and cost.time_s == pytest.approx(flops / 1e6)
    memory_bound = Rates(fp32_flops=1e15, memory_bandwidth=1e6)
    cost = op_roofline(memory_bound, torch.ops.aten.mm.default, (a, b), {}, out, [a, b, out])
    assert cost.flops == flops and cost.time_s == pytest.approx(moved / 1e6)
    low = (a.bfloat16(), b.bfloat16())
    cost = op_roofline(Rates(fp32_flops=1e6, bf16_flops=4e6, memory_bandwidth=1e12), torch.ops.aten.mm.default, low, {},
                       out.bfloat16(), [*low, out.bfloat16()])
    assert cost.time_s == pytest.approx(flops / 4e6)  # the bf16 rate for bf16 operands


def test_elementwise_ops_cost_their_bytes_and_nothing_when_fused() -> None:
    x = torch.randn(1000)
    out = x + 1
    add = torch.ops.aten.add.Tensor
    cost = op_roofline(Rates(memory_bandwidth=1e6), add, (x, 1), {}, out, [x, out])
    assert cost.flops == 0 and cost.time_s == pytest.approx(8000 / 1e6)
    fused = FusedElementwiseRates(Rates(memory_bandwidth=1e6))
    assert op_roofline(fused, add, (x, 1), {}, out, [x, out]).time_s == 0.0
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    mm = op_roofline(fused, torch.ops.aten.mm.default, (a, b), {}, a @ b, [a, b, a @ b])
    assert mm.flops == 2 * 8 * 8 * 8 and mm.time_s > 0  # matmuls keep their time under fusion


def test_the_tracker_charges_each_phase_the_roofline_of_its_ops() -> None:
    rates = Rates(fp32_flops=1e6, memory_bandwidth=1e12)
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with LiveBytesTracker(rates) as tracker:
        tracker.begin_phase("matmul")
        torch.mm(a, b)
        torch.mm(a, b)
    matmul = tracker.phases()[-1]
    assert matmul.flops == 2 * (2 * 64 * 32 * 16)
    assert matmul.time_s == pytest.approx(matmul.flops / 1e6)


class _Doubled(torch.nn.Module):
    """A forward that runs its layers on a tensor subclass holding two tensors (torch's TwoTensor), as torchao's
    float8 training runs its linears on Float8TrainingTensor: each op on it is two ops inside, unseen by a mode."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.testing._internal.two_tensor import TwoTensor

        return self.second(torch.relu(self.first(TwoTensor(x, x.clone())))).a


def test_a_tensor_subclass_that_hides_its_ops_is_refused_not_undercounted() -> None:
    """Under the tracker, an op on a traceable wrapper subclass runs its inner ops out of the tracker's sight: the
    simulation would not count what they hold. Planning says so, and what to do, in one ProfileError."""
    import autoplan
    from autoplan.errors import ProfileError

    model = _Doubled()
    assert model(torch.randn(8, 16)).shape == (8, 4)  # the model itself runs
    with pytest.raises(ProfileError, match=r"TwoTensor, a tensor subclass .* predict less than the step holds.* plan the model without it"):
        autoplan.plan(model, "1GB", example_inputs=(torch.randn(8, 16),), device="cpu")
    with LiveBytesTracker(Rates()):  # plain tensors pass
        torch.ones(4) + 1
