"""CUDA's autocast rules, on the CPU tensors that simulate a GPU target.

`torch.autocast` keeps a list per device of the ops it runs in fp32. CUDA's is longer than the
CPU's: under CUDA autocast, `layer_norm`, `group_norm`, `softmax`, `log_softmax`, `exp`, `pow`,
`rsqrt`, `sum`, the losses and more return fp32 from bf16/fp16 inputs, while CPU autocast runs
them in the low precision. A bf16 unit's saved softmax probabilities, for one, are fp32 on the
card and half that on the CPU. A plan for a GPU is simulated under CPU autocast on fake CPU
tensors, so while `CudaAutocastRules` is entered, kernels registered at the AutocastCPU dispatch
key give those ops CUDA's rule: floating inputs cast to fp32 ("fp32" ops), or the output dtype set
to fp32 where the op takes one ("fp32 output" ops). On exit they are removed. Ops both lists run
in fp32 already (cross-entropy, nll_loss, mse_loss) need nothing. The list follows ATen's
`autocast_mode.cpp` for CUDA; ops a training step rarely runs (upsampling, norms of matrices) are
left out and run as CPU autocast runs them.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_map_only

_LOW = (torch.float16, torch.bfloat16)

# CUDA autocast's fp32 ops that CPU autocast runs in low precision
_FP32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "hinge_embedding_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss",
    "triplet_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "renorm", "logsumexp",
)
# ... and those it runs with their output dtype set to fp32 (when the caller set none)
_FP32_OUTPUT_OPS = ("softmax.int", "log_softmax.int", "cumprod", "cumsum", "prod", "sum", "sum.dim_IntList", "linalg_vector_norm")


def _to_fp32(args):
    return tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype in _LOW else t, args)


def _fp32_kernel(op):
    def kernel(keyset, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            return op(*_to_fp32(args), **_to_fp32(kwargs))

    return kernel


def _fp32_output_kernel(op):
    def kernel(keyset, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            low = any(isinstance(a, torch.Tensor) and a.dtype in _LOW for a in args)
            if low and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


class CudaAutocastRules:
    """While entered, CPU autocast follows CUDA autocast's fp32 rules (process-wide, like TargetAttention)."""

    def __init__(self) -> None:
        self._library: torch.library.Library | None = None

    def __enter__(self) -> "CudaAutocastRules":
        with warnings.catch_warnings():  # torch warns that kernels are overridden: that is the point
            warnings.simplefilter("ignore")
            self._library = torch.library.Library("aten", "IMPL")
            for names, make in ((_FP32_OPS, _fp32_kernel), (_FP32_OUTPUT_OPS, _fp32_output_kernel)):
                for name in names:
                    self._library.impl(name, make(_overload(name)), "AutocastCPU", with_keyset=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._library is not None:  # entered
            self._library._destroy()
        self._library = None
