"""instruments.accumulation: the engine adds two gradients in place in a real step; the simulation counts it so."""

from __future__ import annotations

import contextlib

import torch

import autoplan
from autoplan.instruments.accumulation import accumulating_adds
from autoplan.instruments.fake import new_fake_mode
from autoplan.instruments.tracker import LiveBytesTracker
from autoplan.verify.allocator import AllocatorCount


def _two_paths(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w  # h's gradient comes from two paths, each one multiplication: the engine adds them at the peak
    return (h * 2.0).sum() + (h * 3.0).sum()


def _real_backward_peak() -> int:
    x, w = torch.randn(4096, 16), torch.randn(16, 16, requires_grad=True)
    with AllocatorCount() as count:  # no mode: the engine adds in place
        loss = _two_paths(x, w)
        count.mark("backward")
        loss.backward()
    backward = count.stretches()[-1]
    return backward.peak_bytes - backward.start_bytes


def _simulated_backward_peak(watch: bool) -> int:
    with new_fake_mode() as mode:
        x, w = mode.from_tensor(torch.randn(4096, 16)), mode.from_tensor(torch.randn(16, 16)).requires_grad_()
        with LiveBytesTracker(autoplan.get_device("h100-80gb")) as tracker:
            loss = _two_paths(x, w)
            tracker.begin_phase("backward")
            start = tracker.live_bytes
            with accumulating_adds(tracker, loss) if watch else contextlib.nullcontext():
                loss.backward()
    return tracker.phases()[-1].peak_bytes - start


def test_the_simulation_counts_the_engines_sum_in_place_as_a_real_step_makes_it():
    real = _real_backward_peak()
    assert _simulated_backward_peak(watch=True) == real
    # under the tracker the engine adds out of place: one more gradient of h (4096×16 fp32) at that moment
    assert _simulated_backward_peak(watch=False) == real + 4096 * 16 * 4


def test_a_sum_whose_operands_stay_alive_counts_out_of_place():
    with new_fake_mode() as mode:
        a, b = mode.from_tensor(torch.randn(1024)), mode.from_tensor(torch.randn(1024))
        with LiveBytesTracker(autoplan.get_device("h100-80gb")) as tracker:
            tracker.engine_accumulates = True  # as between two nodes of a backward
            total = a + b  # both operands held here: the real engine could not add in place
            tracker.engine_accumulates = False
            del total
    assert tracker.phases()[0].peak_bytes == 4096
