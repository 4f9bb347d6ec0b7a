"""Training-step helpers every stage uses: the loss a step backpropagates, the optimizers autoplan
counts, one real training step, timing, and putting a model back as it was after real steps.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch

from autoplan.runtime.tensors import tensors_of


def default_loss(output: Any) -> torch.Tensor:
    """The scalar a profiling step backpropagates: the model's own loss, else the sum of its outputs.

    An output with a `.loss` (or a dict with "loss") that is not None is used as is; otherwise every
    floating-point tensor in the output is summed, which gives each output a gradient of its size.
    """
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in tensors_of(output) if t.is_floating_point()]
    if not tensors:
        raise ValueError("the model's output has no floating-point tensor to backpropagate: return the loss (or the logits) from "
                         "forward, or pass loss_fn= to compute the loss from the output")
    return sum(t.sum() for t in tensors)


OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum")


def optimizer_name(optimizer: str | torch.optim.Optimizer) -> str:
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer).__name__
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS} or a torch.optim.Optimizer")
    return optimizer


def make_optimizer(optimizer: str | torch.optim.Optimizer, params: list, *, foreach: bool) -> torch.optim.Optimizer:
    """An optimizer over `params` that allocates what the real one would on the target device.

    On CUDA, torch's optimizers default to the foreach implementation, whose temporaries are the
    size of all parameters; on the CPU they default to a per-parameter loop. Fake tensors live on
    the CPU, so the implementation is chosen explicitly: `foreach` for a CUDA target.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        defaults = dict(optimizer.defaults)
        if "foreach" in defaults and defaults["foreach"] is None and not defaults.get("fused"):
            defaults["foreach"] = foreach
        return type(optimizer)(params, **defaults)
    factories: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "adamw": lambda: torch.optim.AdamW(params, foreach=foreach),
        "adam": lambda: torch.optim.Adam(params, foreach=foreach),
        "sgd": lambda: torch.optim.SGD(params, lr=1e-3, foreach=foreach),
        "sgd-momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach),
    }
    return factories[optimizer_name(optimizer)]()


def model_device(model: torch.nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


@contextlib.contextmanager
def preserved(model: torch.nn.Module) -> Iterator[None]:
    """Run real steps on `model` and put its parameters, buffers, gradients and the RNG back."""
    params = list(model.parameters())
    saved = [t.detach().to("cpu", copy=True) for t in params + list(model.buffers())]
    grads = [p.grad for p in params]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(params + list(model.buffers()), saved):
                tensor.copy_(value)
        for param, grad in zip(params, grads):
            param.grad = grad
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def train_step(model, args, kwargs, opt, loss_fn=None, record_loss: Callable[[float], None] | None = None) -> None:
    """One real training step as the plan models it: loss, backward, optimizer.step(), zero_grad.

    The loss is dropped before the optimizer steps; `record_loss` gets its value first.
    """
    loss = (loss_fn or default_loss)(model(*args, **kwargs))
    if record_loss is not None:
        record_loss(float(loss.detach()))
    loss.backward()
    del loss
    opt.step()
    opt.zero_grad(set_to_none=True)


class Timer:
    """Median seconds of a callable: CUDA events on a GPU (the GPU's own time), else the clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, function: Callable[[], Any]) -> tuple[float, Any]:
        if not self.cuda:
            started = time.perf_counter()
            result = function()
            return time.perf_counter() - started, result
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = function()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3, result


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors an optimizer keeps between steps (AdamW: exp_avg, exp_avg_sq, step)."""
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def parameter_count(model: torch.nn.Module) -> int:
    """Elements of the model's parameters, tied weights once (model.parameters() already dedups)."""
    return sum(p.numel() for p in model.parameters())
