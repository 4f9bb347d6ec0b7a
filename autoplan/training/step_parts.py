"""Training-step helpers every stage uses: the loss a step backpropagates, the optimizers autoplan
counts, timing, and putting a model back as it was after real steps (the step itself:
`training.runner.LoopRunner`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, cast

import torch

from autoplan.errors import LossError, OptionError
from autoplan.instruments.quantized import is_quantized_parameter
from autoplan.instruments.quantized_optim import BNB_OPTIMIZERS, bnb_optimizer_by_name, is_bnb_optimizer, rebuilt_bnb_optimizer
from autoplan.vocabulary.signatures import accepts_argument
from autoplan.vocabulary.tensors import tensors_of


def model_loss(output: Any) -> torch.Tensor | None:
    """The loss the model computed itself (`.loss`, or `["loss"]`, or the one scalar of a tuple such as nanoGPT's
    `(logits, loss)`), None when it computed none."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)):
        scalars = [item for item in output if isinstance(item, torch.Tensor) and item.dim() == 0 and item.is_floating_point()]
        # the loss only when it is the one scalar beside outputs that are not: two scalars could be a loss and a metric
        return scalars[0] if len(scalars) == 1 and len(output) > 1 else None
    return None


# What to do about a loss that is not one real number, in the words of both ways to pass one.
_REAL_SCALAR = ("return a real scalar loss from forward (of complex values, e.g. out.abs().pow(2).mean()), or pass loss_fn= "
                "to compute one from the output")


def sum_of_outputs(output: Any) -> torch.Tensor:
    """Every floating-point tensor of the output summed: each output gets a gradient of its size."""
    tensors = [t for t in tensors_of(output) if t.is_floating_point() and t is not model_loss(output)]
    if not tensors:
        complex_dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors_of(output) if t.is_complex()})
        if complex_dtypes:  # a complex sum has no gradient to start backward from: torch asks for a real scalar
            raise LossError(f"the model's output is complex ({', '.join(complex_dtypes)}), and the loss must be a real "
                            f"scalar: {_REAL_SCALAR}")
        raise LossError("the model's output has no floating-point tensor to backpropagate: return the loss (or the logits) from "
                        "forward, or pass loss_fn= to compute the loss from the output")
    return cast(torch.Tensor, sum(t.sum() for t in tensors))  # sum() starts from 0: a tensor after the first add


def real_scalar(loss: Any) -> torch.Tensor:
    """The loss a step backpropagates, checked: one real number (torch's own error, "grad can be implicitly created only
    for real scalar outputs", names neither the loss nor what to do)."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss
    what = (f"a {str(loss.dtype).removeprefix('torch.')} tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
            else f"a {type(loss).__name__}")
    raise LossError(f"the loss must be a real scalar to backpropagate, and it is {what}: {_REAL_SCALAR}")


def default_loss(output: Any) -> torch.Tensor:
    """The scalar a profiling step backpropagates: the model's own loss, else the sum of its outputs.

    An output with a `.loss` (or a dict with "loss") that is not None is used as is; otherwise every
    floating-point tensor in the output is summed, which gives each output a gradient of its size.
    """
    loss = model_loss(output)
    return loss if loss is not None else sum_of_outputs(output)


def loss_function(
    loss_fn: Callable[[Any], torch.Tensor] | None, loss_in_model: bool | None, default: Callable[[Any], torch.Tensor] = default_loss
) -> Callable[[Any], torch.Tensor]:
    """What the training loop backpropagates, as a function of the model's output.

    loss_in_model (a TrainingLoop's): True, the output's own `.loss`, an error when it has none;
    False, `loss_fn` (default: the sum of the floating-point outputs); None, `loss_fn` when given,
    else `default` (the model's own loss, else the sum).
    """
    if loss_in_model is None:
        return loss_fn if loss_fn is not None else default  # never bool(): a compiled loss module answers with len()
    if loss_in_model is False:
        return loss_fn if loss_fn is not None else sum_of_outputs

    def own_loss(output: Any) -> torch.Tensor:
        loss = model_loss(output)
        if loss is None:
            raise LossError(
                f"the loop says the model computes its loss (loss_in_model=True), but its {type(output).__name__} output "
                "has no .loss: pass the labels in the batch, or TrainingLoop(loss_in_model=False) with loss_fn="
            )
        return loss

    return own_loss


# torch's, then bitsandbytes' 8-bit and paged ones (runtime.quantized_optim: what their state holds)
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", *BNB_OPTIMIZERS)


def optimizer_name(optimizer: str | torch.optim.Optimizer) -> str:
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer).__name__
    if optimizer not in OPTIMIZERS:
        raise OptionError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS} or a torch.optim.Optimizer")
    return optimizer


OPTIMIZER_IMPLEMENTATION_FLAGS: dict[str, dict[str, Any]] = {
    "foreach": {"foreach": True, "fused": False},
    "fused": {"foreach": False, "fused": True},
    "for-loop": {"foreach": False, "fused": False},
}


def make_optimizer(
    optimizer: str | torch.optim.Optimizer, params: list, *, implementation: str, device_kind: str = "cpu"
) -> torch.optim.Optimizer:
    """An optimizer over `params` that allocates what the real one would in the person's loop.

    implementation: "foreach" (torch's CUDA default: temporaries the size of all parameters at
    once), "for-loop" (its CPU default: one parameter at a time) or "fused" (one kernel, no
    temporaries). Fake tensors live on the CPU, so it is always chosen explicitly; an instance
    keeps `foreach`/`fused` when its owner set them. device_kind: the target's ("cuda" or "cpu");
    under fake tensors a paged bitsandbytes optimizer for "cuda" keeps its paged state off the device.
    """
    flags = OPTIMIZER_IMPLEMENTATION_FLAGS[implementation]
    if isinstance(optimizer, torch.optim.Optimizer):
        cls = type(optimizer)
        # defaults can hold entries the constructor does not take (torch 2.13's AdamW keeps
        # decoupled_weight_decay): pass only what it accepts
        defaults = {key: value for key, value in optimizer.defaults.items() if accepts_argument(cls.__init__, key, through_kwargs=False)}
        if defaults.get("foreach") is None and not defaults.get("fused"):
            defaults.update({key: value for key, value in flags.items() if key in defaults})
        if is_bnb_optimizer(optimizer):
            return rebuilt_bnb_optimizer(optimizer, params, defaults, device_kind=device_kind)
        return cls(params, **defaults)
    name = optimizer_name(optimizer)
    if name in BNB_OPTIMIZERS:
        return bnb_optimizer_by_name(name, params, device_kind=device_kind)
    factories: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "adamw": lambda: torch.optim.AdamW(params, **flags),
        "adam": lambda: torch.optim.Adam(params, **flags),
        "sgd": lambda: torch.optim.SGD(params, lr=1e-3, **flags),
        "sgd-momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9, **flags),
    }
    return factories[name]()


def model_device(model: torch.nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


@contextlib.contextmanager
def preserved(model: torch.nn.Module) -> Iterator[None]:
    """Run real training steps on `model` (in training mode, as planned) and put its parameters,
    buffers, gradients, train/eval modes and the RNG back.

    A quantized base's packed weights are frozen and left alone: bitsandbytes' parameter classes
    re-quantize on `.to()`, and nothing in a training step writes them.
    """
    params = [p for p in model.parameters() if not is_quantized_parameter(p)]
    saved = [t.detach().to("cpu", copy=True) for t in params + list(model.buffers())]
    grads = [p.grad for p in params]
    modes = [(module, module.training) for module in model.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    model.train()
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(params + list(model.buffers()), saved):
                tensor.copy_(value)
        for param, grad in zip(params, grads):
            param.grad = grad
        for module, training in modes:
            module.training = training
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


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
    """The tensors an optimizer keeps between steps (AdamW: exp_avg, exp_avg_sq, step; bitsandbytes'
    8-bit ones: state1, state2, absmax1, absmax2 and the shared qmap1, qmap2, counted once by storage)
    on the device: a paged optimizer's paged buffers (`is_paged`, in CUDA unified memory) are left out."""
    return [t for state in optimizer.state.values() for t in state.values()
            if isinstance(t, torch.Tensor) and not getattr(t, "is_paged", False)]


def parameter_count(model: torch.nn.Module) -> int:
    """Elements of the model's parameters, tied weights once (model.parameters() already dedups)."""
    return sum(p.numel() for p in model.parameters())
