"""FLOP formulas for the attention kernels torch's flop counter does not know, so the roofline prices them.

torch's `flop_registry` counts the CUDA kernels behind `F.scaled_dot_product_attention` (flash,
efficient, cuDNN) and FlexAttention, but not the CPU flash kernel the simulation runs on a CPU
(`_scaled_dot_product_flash_attention_for_cpu` and its backward), nor the out-of-tree backends'
`_scaled_dot_product_fused_attention_overrideable`, nor the fused inference kernels. Uncounted,
attention costs 0 FLOP: recomputing it looks free to the solver and a long-sequence step looks
faster than its attention alone. `attention_flop_formulas` gives them to torch's registry while
autoplan measures (`instruments.flop_formulas`), counted with torch's own `sdpa_flop_count` /
`sdpa_backward_flop_count` and so by the conventions of the kernels torch already counts: QK^T and
PV in the forward (4·B·Hq·Tq·Tk·D), the score recomputation and the four gradient matmuls in the
backward (2.5 times that), every query head counted under grouped-query attention (each one
multiplies with its shared key/value head), and a causal mask not discounted.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
import torch.utils.flop_counter as flop_counter
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten


def _sdpa_forward(query, key, value, *args, out_val=None, **kwargs) -> int:
    """Kernels whose schema starts (query, key, value), all [batch, heads, tokens, head_dim]."""
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _sdpa_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    """Backward kernels whose schema starts (grad_out, query, key, value)."""
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _cudnn_forward(query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, *args, out_val=None, **kwargs) -> int:
    if query.dim() == 4:
        return _sdpa_forward(query, key, value)
    # packed variable-length batches ([tokens, heads, head_dim] with offsets): torch's flash formula unpacks them
    return flop_registry[aten._flash_attention_forward.overloadpacket](query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)


def _cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k,
                    max_q, max_k, *args, out_val=None, **kwargs) -> int:
    if query.dim() == 4:
        return _sdpa_backward(grad_out, query, key, value)
    flash_backward = flop_registry[aten._flash_attention_backward.overloadpacket]
    return flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k)


def _flash_forward_into(out, query, key, value, *args, out_val=None, **kwargs) -> int:
    """The flash forward that writes into a given `out`: the same work as `_flash_attention_forward`."""
    return flop_registry[aten._flash_attention_forward.overloadpacket](query, key, value, *args, **kwargs)


def _multi_head_attention(query, key, value, embed_dim, num_head, *args, out_val=None, **kwargs) -> int:
    """nn.MultiheadAttention's fused inference kernel: the q, k, v projections, attention, the output projection."""
    batch = math.prod(query.shape[:-2]) if query.dim() > 2 else 1
    q_tokens, k_tokens = query.shape[-2], key.shape[-2]
    head_dim = embed_dim // num_head
    projections = 2 * batch * (2 * q_tokens + 2 * k_tokens) * embed_dim * embed_dim  # q and output: Tq rows; k and v: Tk rows
    q_shape, kv_shape = (batch, num_head, q_tokens, head_dim), (batch, num_head, k_tokens, head_dim)
    return projections + flop_counter.sdpa_flop_count(q_shape, kv_shape, kv_shape)


def _encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first, eps,
                   norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, *args, out_val=None, **kwargs) -> int:
    """nn.TransformerEncoderLayer's fused inference kernel: self-attention, then the two feed-forward matmuls."""
    rows = math.prod(src.shape[:-1])
    attention = _multi_head_attention(src, src, src, embed_dim, num_heads)
    return attention + 2 * 2 * rows * embed_dim * ffn_weight_1.shape[0]


def _formulas() -> dict[str, Callable[..., int]]:
    """aten op name -> formula over the op's arguments (tensors, not shapes: some must tell packed batches apart)."""
    return {
        "_scaled_dot_product_flash_attention_for_cpu": _sdpa_forward,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_backward,
        "_scaled_dot_product_fused_attention_overrideable": _sdpa_forward,
        "_scaled_dot_product_fused_attention_overrideable_backward": _sdpa_backward,
        "_scaled_dot_product_attention_math_for_mps": _sdpa_forward,
        "_cudnn_attention_forward": _cudnn_forward,
        "_cudnn_attention_backward": _cudnn_backward,
        "_flash_attention_forward_no_dropout_inplace": _flash_forward_into,
        "_native_multi_head_attention": _multi_head_attention,
        "_triton_multi_head_attention": _multi_head_attention,
        "_transformer_encoder_layer_fwd": _encoder_layer,
    }


def _with_key_value_heads_of_the_query(count: Callable[..., int]) -> Callable[..., int]:
    """torch's count over shapes (..., query, key, value) with key and value given the query's heads: the
    same FLOPs torch 2.12+ counts for grouped-query attention (every query head multiplies)."""
    def counted(*shapes):
        *before, query, key, value = shapes
        key, value = ((s[0], query[1], *s[2:]) for s in (key, value))
        return count(*before, query, key, value)
    counted.grouped_query = True  # type: ignore[attr-defined]
    return counted


def _count_grouped_query_attention() -> None:
    """torch before 2.12 asserts that key/value have the query's heads, so a transformers model with
    grouped-query attention (which calls SDPA with enable_gqa) fails to profile on a CUDA target; there the
    counter's two shape functions, which its registered kernels' formulas call by name, are given the key
    and value heads of the query. Newer torch counts such shapes itself and is left alone."""
    if getattr(flop_counter.sdpa_flop_count, "grouped_query", False):
        return
    try:
        flop_counter.sdpa_flop_count((1, 2, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1))
    except AssertionError:
        flop_counter.sdpa_flop_count = _with_key_value_heads_of_the_query(flop_counter.sdpa_flop_count)
        flop_counter.sdpa_backward_flop_count = _with_key_value_heads_of_the_query(flop_counter.sdpa_backward_flop_count)


@contextlib.contextmanager
def grouped_query_counting() -> Iterator[None]:
    """torch's two sdpa shape counters take grouped-query shapes while entered (`_count_grouped_query_attention`),
    and are put back on exit: they are torch's module attributes, every FlopCounterMode in the process reads them."""
    before = (flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count)
    _count_grouped_query_attention()
    ours = (flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count)
    try:
        yield
    finally:
        if (flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count) == ours:  # no one set others since
            flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count = before


def attention_flop_formulas() -> dict[Any, Callable[..., int]]:
    """The formulas above by op (overload packet), raw (over tensors); an op this torch lacks is left out."""
    found = ((getattr(aten, name, None), formula) for name, formula in _formulas().items())
    return {packet: formula for packet, formula in found if packet is not None}
