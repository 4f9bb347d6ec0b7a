"""FLOPs of the attention kernels torch's flop counter does not know, for the roofline.

torch's `flop_registry` prices the CUDA kernels (flash, memory-efficient, cuDNN) and FlexAttention,
but not the CPU's flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu`, what SDPA runs
on the CPU without dropout) nor the out-of-tree backends' overrideable kernel. Unpriced, attention
cost 0 FLOP: recomputing it looked free to the solver and an attention-heavy step was predicted
faster than its attention alone. These get torch's own counts (`sdpa_flop_count`: Q·Kᵀ and P·V,
2 FLOPs a multiply-add; backward, the five matmuls of the recomputed scores and the gradients),
grouped-query attention included, causal masking not discounted, as for the CUDA kernels.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

_aten = torch.ops.aten


def _forward_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def register_attention_flops() -> None:
    """Register the missing attention kernels' FLOPs in torch's flop counter (once; idempotent)."""
    pairs = (
        ("_scaled_dot_product_flash_attention_for_cpu", _forward_flops),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _backward_flops),
        ("_scaled_dot_product_fused_attention_overrideable", _forward_flops),
        ("_scaled_dot_product_fused_attention_overrideable_backward", _backward_flops),
    )
    for name, formula in pairs:
        packet = getattr(_aten, name, None)
        if packet is not None and packet not in flop_registry:
            register_flop_formula(packet)(formula)
