"""The copies a CUDA matmul makes of operands cuBLAS cannot read in place, for a GPU target's simulation.

cuBLAS reads a matrix whose elements are contiguous along one dimension, with the other's stride at
least that dimension's size (a plain or a transposed matrix). ATen's `mm`, `addmm`, `bmm` and
`baddbmm` on CUDA (`prepare_matrix_for_cublas` in aten/src/ATen/native/cuda/Blas.cpp) copy any other
operand to a contiguous temporary first: an expanded tensor (stride 0, the gradient of a `sum()` loss
reaching the output Linear), a slice with a gap. Under fake tensors the op allocates only its output,
so the simulation would count none of it; the card holds the copy while the matmul runs. Seen on an
H100 (benchmarks/results/h100_2026-11-27, blame.json): a GPT whose loss is the sum of its 8×1024×50304
fp32 logits held one logits-sized block more in backward than the simulation did. The CPU target
measures its kernels' own copies instead (`instruments.cpu_scratch`).
"""

from __future__ import annotations

import torch

from autoplan.vocabulary.tensors import rounded_bytes

aten = torch.ops.aten

# op -> the positions of its matrix operands
_OPERANDS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1), aten.baddbmm.default: (1, 2)}


def operand_copy_bytes(func, args: tuple, kwargs: dict) -> int:
    """Bytes of the contiguous copies CUDA's kernel of `func` makes of its matrix operands (0 for most calls)."""
    positions = _OPERANDS.get(func)
    if positions is None:
        return 0
    total = 0
    for position in positions:
        operand = args[position] if position < len(args) else None
        if isinstance(operand, torch.Tensor) and operand.dim() in (2, 3) and not _cublas_reads_in_place(operand):
            total += rounded_bytes(operand.numel() * operand.element_size())
    return total


def _cublas_reads_in_place(matrix: torch.Tensor) -> bool:
    """A plain or transposed matrix (the last two dimensions; a batch's own stride is passed as given)."""
    rows, columns = matrix.shape[-2:]
    row_stride, column_stride = matrix.stride()[-2:]
    if matrix.numel() == 0:
        return True
    plain = (column_stride == 1 or columns == 1) and row_stride >= max(1, columns)  # rows follow each other
    transposed = (row_stride == 1 or rows == 1) and column_stride >= max(1, rows)  # columns follow each other
    return plain or transposed
