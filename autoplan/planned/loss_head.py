"""The output head's cross-entropy, fused: its gradients are computed chunk by chunk in the forward.

A language model's last Linear (`lm_head`, `output`) makes logits of N tokens × V classes, and
`F.cross_entropy` on them saves their log-softmax (N×V) for backward, whose first step then holds
two more N×V tensors (the gradient of the log-softmax and of the logits). That is three times the
logits at the very moment every layer's activations are still held: often the largest single
term of a language model's peak, and no checkpoint policy lowers it (the head's backward runs
first). Written by hand it is a fused linear cross-entropy (as in Liger-Kernel); here:

`LossHeadMode` watches a forward (a TorchFunctionMode). It notes the inputs of the latest `F.linear`,
follows its output through reshapes that keep the class dimension and row order (`flatten`,
`view(-1, V)`, `.float()`), and when `F.cross_entropy` receives such a tensor it computes, in
chunks of rows, the loss and at once the gradients of the Linear's input, weight and bias
(`softmax - one_hot`, the same matmuls the backward would run: no extra FLOPs). Only those
gradients are saved (N×D + V×D); backward scales them by the loss's gradient. The logits the
Linear made are used as they are and freed when the forward drops them.

Anything else runs as written: `reduction="none"`, class weights, label smoothing, probability
targets, a class dimension not last, no gradient needed, or torch.compile tracing the forward.
A second derivative of the loss is refused (the saved gradients are constants).
"""

from __future__ import annotations

import inspect
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

_CROSS_ENTROPY = inspect.signature(F.cross_entropy)
# ops after which row r of the logits is still row r of the result, when the class dimension is kept
_RESHAPES = {torch.Tensor.flatten, torch.flatten, torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.contiguous}
_CASTS = {torch.Tensor.float, torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.bfloat16, torch.Tensor.half}


@dataclass(frozen=True)
class LinearCall:
    """Where a tensor of logits came from: `F.linear(hidden, weight, bias)`, made in `dtype`."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype


def chunk_rows(rows: int, classes: int, width: int) -> int:
    """Rows per chunk: a chunk's logits about as large as the Linear's whole input (Liger's rule)."""
    return max(1, math.ceil(rows / max(1, math.ceil(classes / max(1, width)))))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Loss of logits (given, N×V) against `target`; gradients of hidden (N×D), weight and bias, computed now."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, logits, target, ignore_index: int, mean: bool, dtype: torch.dtype):
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        valid = target != ignore_index
        scale = 1.0 / valid.sum() if mean else torch.ones((), device=logits.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        step = chunk_rows(logits.shape[0], logits.shape[1], hidden.shape[1])
        with torch.autocast(logits.device.type, enabled=False):
            matrix = weight.to(dtype)
            for start in range(0, logits.shape[0], step):
                rows = slice(start, start + step)
                chunk, keep = logits[rows].float(), valid[rows]
                picked = torch.where(keep, target[rows], 0).unsqueeze(1)
                # the softmax by hand, not torch.logsumexp: its kernel holds a chunk-sized temporary inside that
                # no dispatched op shows, so the simulation could not count it; here that chunk is `grad` itself
                maxes = chunk.amax(dim=1, keepdim=True)
                # in place wherever it can: each temporary here is a chunk, and the peak of the head is made of them
                grad = (chunk - maxes).exp_()
                sums = grad.sum(dim=1, keepdim=True)
                log_total = (sums.log() + maxes).squeeze(1)
                total += torch.where(keep, log_total - chunk.gather(1, picked).squeeze(1), 0.0).sum()
                grad.div_(sums).scatter_add_(1, picked, -torch.ones_like(picked, dtype=grad.dtype))
                grad = grad.mul_(keep.unsqueeze(1) * scale).to(dtype)
                if grad_hidden is not None:  # need_hidden
                    grad_hidden[rows] = grad @ matrix
                if grad_weight is not None:  # need_weight; accumulated in fp32 without a weight-sized temporary per chunk
                    torch.addmm(grad_weight, grad.t().float(), hidden[rows].float(), out=grad_weight)  # addmm_ escapes FlopCounterMode
                if grad_bias is not None:  # need_bias
                    grad_bias += grad.float().sum(0)
        ctx.save_for_backward(
            grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None if grad_bias is None else grad_bias.to(bias.dtype)
        )
        return (total * scale).to(logits.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grads = tuple(None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors)
        return (*grads, None, None, None, None, None)


def fused_linear_cross_entropy(source: LinearCall, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, mean: bool):
    """The loss of `logits` (N×V, made from `source` by a row-preserving reshape), with the fused gradients."""
    hidden = source.hidden.reshape(-1, source.hidden.shape[-1])
    return _FusedLinearCrossEntropy.apply(
        hidden, source.weight, source.bias, logits.detach(), target, ignore_index, mean, source.dtype
    )


class LossHeadMode(TorchFunctionMode):
    """During one forward: follows F.linear outputs and fuses the cross-entropy taken of one (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        # Which F.linear call made a tensor (by number), weakly: following them must not keep tensors alive.
        # Only the latest call's inputs are held, so what this holds does not depend on when Python frees a
        # tensor object (fake and real tensors differ there) and the simulated step matches the real one.
        self.sources: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.latest: tuple[int, LinearCall] | None = None
        self.calls = 0
        self.fused: list[str] = []  # per fused loss, the shape of its logits (what the plan reports)
        # whether holding the latest call's inputs kept one alive past where the step as written frees it: a step
        # that then fuses nothing holds more than the same step run without this mode
        self.held_longer = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            fused = self._fuse(args, kwargs)
            if fused is not None:
                return fused
        result = func(*args, **kwargs)
        if func is F.linear and torch.is_grad_enabled() and isinstance(result, torch.Tensor):
            hidden, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            self.calls += 1
            self._let_go()
            if weight.dim() == 2 and hidden.dim() >= 2:
                self.latest = (self.calls, LinearCall(hidden, weight, bias, result.dtype))
                self.sources[result] = self.calls
        elif (func in _RESHAPES or func in _CASTS) and args and isinstance(args[0], torch.Tensor) and args[0] in self.sources:
            self._follow(func, args[0], result)
        return result

    def __exit__(self, *exc):
        self._let_go()
        return super().__exit__(*exc)

    def _let_go(self) -> None:
        """Drop the latest call's inputs, noting whether nothing else held its input (this mode kept it alive)."""
        if self.latest is not None:
            storage = weakref.ref(self.latest[1].hidden.untyped_storage())
            self.latest = None
            self.held_longer = self.held_longer or storage() is None

    def _follow(self, func, tensor: torch.Tensor, result: Any) -> None:
        if not isinstance(result, torch.Tensor) or result.dim() < 1 or result.shape[-1] != tensor.shape[-1] or result.numel() != tensor.numel():
            return
        if func in _RESHAPES and result.dtype != tensor.dtype:
            return  # view(dtype) reinterprets the bytes
        if func in _CASTS and (not result.is_floating_point() or result.device != tensor.device):
            return
        self.sources[result] = self.sources[tensor]

    def _fuse(self, args, kwargs) -> torch.Tensor | None:
        try:
            bound = _CROSS_ENTROPY.bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        given = bound.arguments
        logits, target = given["input"], given["target"]
        call = self.sources.get(logits) if isinstance(logits, torch.Tensor) else None
        source = self.latest[1] if call is not None and self.latest is not None and self.latest[0] == call else None
        plain = (
            given["weight"] is None and given["size_average"] is None and given["reduce"] is None
            and given["reduction"] in ("mean", "sum") and given["label_smoothing"] == 0.0
        )
        if source is None or not plain or logits.dim() != 2 or not isinstance(target, torch.Tensor):
            return None
        if target.dim() != 1 or target.dtype != torch.int64 or torch.compiler.is_compiling():
            return None
        if not any(t is not None and t.requires_grad for t in (source.hidden, source.weight, source.bias)):
            return None
        self.fused.append(f"{logits.shape[0]}×{logits.shape[1]}")
        return fused_linear_cross_entropy(source, logits, target, int(given["ignore_index"]), given["reduction"] == "mean")


@dataclass
class FusedLossForward:
    """A model's forward run under a `LossHeadMode`, set on the instance like a unit's PlannedForward.

    `fused` holds the logits' shapes of the losses its last forward fused (the profile reads it to
    say whether the plan has a fused head). Under torch.compile the forward runs as written.
    """

    module: torch.nn.Module
    original: Any = None
    fused: tuple[str, ...] = ()
    held_longer: bool = False  # its last forward's mode kept a linear's input alive longer (`LossHeadMode.held_longer`)

    def _forward(self):
        return self.original if self.original is not None else type(self.module).forward.__get__(self.module)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._forward())  # libraries read forward's parameters (transformers' generate() does)

    def __call__(self, *args, **kwargs):
        forward = self._forward()
        if torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        mode = LossHeadMode()
        with mode:
            result = forward(*args, **kwargs)
        self.fused, self.held_longer = tuple(mode.fused), mode.held_longer
        return result
