"""instruments.cpu_scratch: what a CPU kernel holds inside itself, read off one real call, and counted for a CPU target."""

from __future__ import annotations

import torch

import autoplan
from autoplan.instruments.cpu_scratch import scratch_bytes
from autoplan.instruments.fake import new_fake_mode
from autoplan.instruments.tracker import LiveBytesTracker

MM = torch.ops.aten.mm.default


def test_a_contiguous_matmul_holds_nothing_and_one_blas_cannot_take_is_copied():
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    assert scratch_bytes(MM, (a, b), {}) == 0
    expanded = torch.ones(()).expand(64, 32)  # strides (0, 0), as the gradient of a sum: the kernel copies it
    assert scratch_bytes(MM, (expanded, b), {}) == 64 * 32 * 4


def test_logsumexp_holds_an_input_sized_difference():
    x = torch.randn(256, 1000)
    assert scratch_bytes(torch.ops.aten.logsumexp.default, (x, [1]), {}) >= x.numel() * 4


def test_ops_whose_kernels_hold_nothing_are_not_run():
    state = torch.get_rng_state()
    assert scratch_bytes(torch.ops.aten.bernoulli.default, (torch.full((8,), 0.5),), {}) == 0
    assert torch.equal(state, torch.get_rng_state())


def test_a_simulated_step_counts_the_copy_of_an_operand_blas_cannot_take_on_the_cpu_and_on_a_gpu():
    """The CPU target reads it off the CPU kernel; a GPU target counts cuBLAS's copy (instruments.cuda_matmul)."""
    def peak(device: str) -> int:
        with new_fake_mode() as mode:
            expanded = mode.from_tensor(torch.ones(())).expand(64, 32)
            b = mode.from_tensor(torch.randn(32, 48))
            with LiveBytesTracker(autoplan.get_device(device)) as tracker:
                expanded @ b
        return tracker.phases()[0].peak_bytes

    output = 64 * 48 * 4
    assert peak("cpu") == peak("h100-80gb") == output + 64 * 32 * 4


def test_a_float8_matmuls_scratch_is_what_the_allocators_count_holds_inside_it():
    """The CPU `_scaled_mm` upcasts and scales its operands inside itself, and makes the product of its two scales (a
    0-dim tensor: one 512 B block) beside the scalar conversions a GPU would not make. Its scratch keeps and leaves out
    the blocks the allocator's count (verify) keeps and leaves out, by the one rule of instruments.host_blocks."""
    from autoplan.verify.allocator import AllocatorCount

    a = torch.randn(64, 256).to(torch.float8_e5m2)  # a weight gradient's call: the scale product is alive at its peak
    b = torch.randn(64, 256).to(torch.float8_e4m3fn).t()
    scales = (torch.tensor(0.5), torch.tensor(2.0))
    arguments, options = (a, b, *scales), {"out_dtype": torch.float32}
    scratch = scratch_bytes(torch.ops.aten._scaled_mm.default, arguments, options)
    with AllocatorCount(resident=[a, b, *scales]) as count:
        out = torch.ops.aten._scaled_mm.default(*arguments, **options)
    peak = count.stretches()[-1].peak_bytes - count.stretches()[-1].start_bytes
    assert scratch > 64 * 256 * 4  # at least an upcast operand
    assert scratch == peak - out.untyped_storage().nbytes()


def test_a_pointwise_op_on_two_dtypes_holds_the_cpus_promoted_copies_and_the_gpu_none():
    """TensorIterator on the CPU copies a bf16 operand into float32, and an in-place bf16 result into a float32
    temporary copied back (torchao's float8 backward scales a bf16 gradient in place by a float32 tensor): 8 bytes an
    element inside `mul_`, as the allocator's count holds them. A GPU kernel casts as it reads; same dtypes copy nothing."""
    from autoplan.verify.allocator import AllocatorCount

    def simulated_peak(device: str, other_dtype: torch.dtype) -> int:
        with new_fake_mode() as mode:
            grad = mode.from_tensor(torch.ones(128, 64, dtype=torch.bfloat16))
            scale = mode.from_tensor(torch.ones(128, 64, dtype=other_dtype))
            with LiveBytesTracker(autoplan.get_device(device)) as tracker:
                grad.mul_(scale)
        return tracker.phases()[0].peak_bytes

    grad, scale = torch.ones(128, 64, dtype=torch.bfloat16), torch.ones(128, 64)
    with AllocatorCount(resident=[grad, scale]) as count:
        grad.mul_(scale)
    counted = count.stretches()[-1].peak_bytes - count.stretches()[-1].start_bytes
    assert counted == simulated_peak("cpu", torch.float32) == 128 * 64 * 8
    assert simulated_peak("h100-80gb", torch.float32) == simulated_peak("cpu", torch.bfloat16) == 0
