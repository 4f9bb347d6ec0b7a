"""Quantized bases (bitsandbytes 4-bit and 8-bit layers): the tensors they hold, their fake twins,
and what their matmuls allocate and compute that the dispatcher does not show.

A bitsandbytes `Linear4bit` holds its weight packed (`Params4bit`, two 4-bit codes a byte) with a
`QuantState` beside it (the blockwise absmax, a 16-entry code, with double quantization the absmax
itself quantized to 8 bits with a second state); a `Linear8bitLt` holds int8 rows (`Int8Params`,
whose `CB` moves into the module's `MatmulLtState` on the first forward) and their fp32 row scales
(`SCB`). None of these state tensors is a parameter or a buffer, so everything that counts a
model's resident bytes (the simulation, the real-step measurement, the fake copy) asks this module.

`bitsandbytes::gemm_4bit` is one opaque op: on the GPU at training batch sizes (more than 1536 rows)
and on the CPU it dequantizes the weight into a temporary of the weight's full shape in the input's
dtype (and, with double quantization, the absmax into two fp32 temporaries), then runs `F.linear`.
The dispatcher shows only its output, so `hidden_temporary_bytes` gives the tracker what it holds
inside, and `quantized_flop_formulas` gives torch's flop counter its FLOPs (`instruments.flop_formulas`).
"""

from __future__ import annotations

import importlib
import sys

import copy
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from autoplan.vocabulary.tensors import rounded_bytes

_PARAMS_4BIT_FIELDS = ("blocksize", "compress_statistics", "quant_type", "quant_storage", "bnb_quantized")
_QUANT_STATE_TENSORS = ("absmax", "code", "offset")


def is_quantized_parameter(tensor: torch.Tensor) -> bool:
    """A bitsandbytes packed weight (`Params4bit`, `Int8Params`), or a fake twin of one (it carries the same state)."""
    return type(tensor).__module__.startswith("bitsandbytes") or getattr(tensor, "_autoplan_quantized", False)


def is_4bit(tensor: torch.Tensor) -> bool:
    return is_quantized_parameter(tensor) and getattr(tensor, "quant_state", None) is not None


def _quant_state_tensors(state: Any) -> Iterator[torch.Tensor]:
    if state is None:
        return
    for name in _QUANT_STATE_TENSORS:
        value = getattr(state, name, None)
        if isinstance(value, torch.Tensor):
            yield value
    yield from _quant_state_tensors(getattr(state, "state2", None))


def quantization_state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor a quantized layer holds besides its parameters: 4-bit quant states, 8-bit row scales
    and the int8 matrix the layer's matmul state keeps (the weight's own storage once it ran)."""
    tensors: list[torch.Tensor] = []
    for module in model.modules():
        for param in module.parameters(recurse=False):
            tensors.extend(_quant_state_tensors(getattr(param, "quant_state", None)))
            tensors.extend(t for t in (getattr(param, "CB", None), getattr(param, "SCB", None)) if isinstance(t, torch.Tensor))
        matmul_state = getattr(module, "state", None)
        if matmul_state is not None and type(matmul_state).__name__ == "MatmulLtState":
            tensors.extend(t for t in (matmul_state.CB, matmul_state.SCB) if isinstance(t, torch.Tensor))
        # Linear4bit keeps its weight's state as its own attribute too: the same object, unless the model was deep-copied
        # (Params4bit.__deepcopy__ copies the weight's outside deepcopy's memo, so the layer's copy is a second one)
        tensors.extend(_quant_state_tensors(_layer_quant_state(module)))
    return tensors


def _layer_quant_state(module: torch.nn.Module) -> Any:
    state = module.__dict__.get("quant_state")
    return state if type(state).__name__ == "QuantState" else None


def resident_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What a model holds on its device whatever the step does: parameters, buffers, quantization state, and the
    layers outside it that its 4-bit weights keep alive (`stray_quantized_tensors`)."""
    return list(model.parameters()) + list(model.buffers()) + quantization_state_tensors(model) + stray_quantized_tensors(model)


def stray_quantized_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of layers outside `model` that its 4-bit weights keep alive.

    A `Params4bit` points to the layer that holds it (`.module`), and bitsandbytes' `Params4bit.__deepcopy__`
    (0.50) hands the copy the original's layer there: a `copy.deepcopy` of a 4-bit model keeps every original
    layer, its packed weight and quant state included, alive for as long as the copy lives. That memory is on the
    device whatever the step does. A fake twin carries the fakes of these (`_autoplan_stray`, set by
    `fake_quantized_entries`), so the simulation counts what the real model holds.
    """
    owned = {id(module) for module in model.modules()}
    found: dict[int, torch.Tensor] = {}
    for param in model.parameters():
        tensors = getattr(param, "_autoplan_stray", None)
        if tensors is None:
            layer = _stray_layer(param, owned)
            tensors = _layer_tensors(layer) if layer is not None else []
        for tensor in tensors:
            found.setdefault(id(tensor), tensor)
    return list(found.values())


def _stray_layer(param: torch.Tensor, owned: set[int]) -> torch.nn.Module | None:
    layer = getattr(param, "__dict__", {}).get("module")
    return layer if isinstance(layer, torch.nn.Module) and id(layer) not in owned else None


def _layer_tensors(layer: torch.nn.Module) -> list[torch.Tensor]:
    return list(layer.parameters()) + list(layer.buffers()) + quantization_state_tensors(layer)


def has_quantized_base(model: torch.nn.Module) -> bool:
    return any(is_quantized_parameter(p) for p in model.parameters())


def int8_layers(model: torch.nn.Module) -> list[str]:
    """Names of the bitsandbytes 8-bit (LLM.int8()) layers of a model."""
    return [name for name, module in model.named_modules() if type(module.__dict__.get("state")).__name__ == "MatmulLtState"]


def settle_first_forward(model: torch.nn.Module) -> None:
    """Do now what a 4-bit layer's first forward does to itself: cast its bias to the compute dtype.

    `Linear4bit.forward` replaces `bias.data` with a compute-dtype copy the first time it runs, so
    the first forward runs one cast that no later one (nor a checkpointed unit's recompute) runs.
    A selective checkpoint matches saved outputs to recomputed ops by their order, so that extra
    cast would hand the recompute a bias where it expects an activation. Settled before planning
    and applying, every forward runs the same ops; the values are the ones bitsandbytes uses.
    """
    for module in model.modules():
        compute = getattr(module, "compute_dtype", None)
        bias = getattr(module, "bias", None)
        weight = getattr(module, "weight", None)
        if compute is None or not isinstance(bias, torch.Tensor) or weight is None or not is_4bit(weight):
            continue
        if bias.dtype != compute:
            bias.data = bias.data.to(compute)


def fake_quantized_entries(model: torch.nn.Module, fake_of: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, Any]:
    """deepcopy memo entries that give every quantized parameter and its state a fake twin.

    `fake_of` makes a fake over a tensor's storage (one fake storage per real one), so the int8
    matrix that is both a weight's data and its layer's `CB` stays one storage. The twin of a packed
    weight is a plain fake Parameter carrying the attributes bitsandbytes' forward reads: fake
    tensors cannot be re-wrapped in bitsandbytes' parameter subclasses.
    """
    memo: dict[int, Any] = {}
    owned = {id(module) for module in model.modules()}

    def twin(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in memo:
                memo[id(value)] = fake_of(value)
            return memo[id(value)]
        if type(value).__name__ == "QuantState":
            if id(value) not in memo:
                state = copy.copy(value)
                for name in _QUANT_STATE_TENSORS:
                    if isinstance(getattr(value, name, None), torch.Tensor):
                        setattr(state, name, twin(getattr(value, name)))
                state.state2 = twin(value.state2) if getattr(value, "state2", None) is not None else None
                memo[id(value)] = state
            return memo[id(value)]
        return value

    for module in model.modules():
        for param in module.parameters(recurse=False):
            if not is_quantized_parameter(param) or id(param) in memo:
                continue
            fake = _named_like(torch.nn.Parameter(fake_of(param), requires_grad=param.requires_grad), param)
            setattr(fake, "_autoplan_quantized", True)  # a mark of ours on a torch Parameter, which declares no such field
            for name in _PARAMS_4BIT_FIELDS + ("has_fp16_weights",):
                if hasattr(param, name):
                    setattr(fake, name, getattr(param, name))
            for name in ("quant_state", "CB", "SCB"):
                if hasattr(param, name):
                    setattr(fake, name, twin(getattr(param, name)))
            stray = _stray_layer(param, owned)
            if stray is not None:  # the original layer a deep copy's weight keeps alive (stray_quantized_tensors)
                setattr(fake, "_autoplan_stray", [twin(tensor) for tensor in _layer_tensors(stray)])
            memo[id(param)] = fake
        matmul_state = getattr(module, "state", None)
        if matmul_state is not None and type(matmul_state).__name__ == "MatmulLtState":
            for value in (matmul_state.CB, matmul_state.SCB):
                twin(value)
        layer_state = _layer_quant_state(module)
        if layer_state is not None:
            twin(layer_state)
    return memo


_TWIN_CLASSES: dict[str, type] = {}


def _named_like(fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The twin, its class named as the real parameter's (`Params4bit`, `Int8Params`).

    peft tells a 4-bit weight from an 8-bit one by its class's name when it dequantizes it (DoRA's
    weight norm, merging), so a twin of another name would be dequantized as the wrong kind. The
    class is a FakeTensor subclass that adds nothing: the fake mode treats the twin as any fake.
    """
    if not isinstance(fake, FakeTensor):
        return fake
    name = type(real).__name__
    if name not in _TWIN_CLASSES:
        _TWIN_CLASSES[name] = type(name, (FakeTensor,), {"__module__": __name__, "__doc__": f"A fake twin of bitsandbytes' {name}."})
    fake.__class__ = _TWIN_CLASSES[name]
    return fake


def is_quantized_matmul(func) -> bool:
    """bitsandbytes' fused 4-bit matmul: a matmul to the selective policy and the roofline."""
    return getattr(func, "namespace", "") == "bitsandbytes" and func is _gemm_4bit()


def hidden_temporary_bytes(func, args, kwargs) -> int:
    """Bytes an op holds inside itself, beyond its output, that no dispatched op allocates (0 for most ops)."""
    if not is_quantized_matmul(func):
        return 0
    a, _b, shape_b = args[:3]
    absmax_8bit = args[7] if len(args) > 7 else kwargs.get("absmax_8bit")
    dequantized = rounded_bytes(int(shape_b[0]) * int(shape_b[1]) * a.element_size())
    # double quantization: the absmax dequantized to fp32, then offset into a second fp32 tensor
    absmax = 2 * rounded_bytes(absmax_8bit.numel() * 4) if absmax_8bit is not None else 0
    return dequantized + absmax


def _gemm_4bit():
    ops = getattr(torch.ops, "bitsandbytes", None)
    try:
        return ops.gemm_4bit.default if ops is not None else None
    except AttributeError:
        return None


def load_bitsandbytes_backends() -> None:
    """Import bitsandbytes' backend modules now, if bitsandbytes is in use: it imports them on the first op it runs,
    and they make lookup tables (`_NF4_QUANT_TABLE`) at import, which under a tracker would be counted as the step's
    and stay counted for the process (a first plan in a process was 1,024 B above the same plan made again)."""
    if "bitsandbytes" not in sys.modules:
        return
    with _disable_current_modes():  # outside every mode, wherever this is called from
        for module in ("bitsandbytes.backends.utils", "bitsandbytes.backends.default.ops", "bitsandbytes.backends.cpu.ops"):
            try:
                importlib.import_module(module)
            except ImportError:  # another release lays its backends out otherwise
                pass


def _gemm_4bit_flops(a, b, shape_b, *args, out_val=None, **kwargs) -> int:
    """Its matmul work is that of the F.linear it runs: 2·M·N·K."""
    rows = 1
    for size in a.shape[:-1]:
        rows *= size
    return 2 * rows * int(shape_b[0]) * int(shape_b[1])


def quantized_flop_formulas() -> dict[Any, Callable[..., int]]:
    """The FLOPs of bitsandbytes' fused 4-bit matmul, by op, for torch's flop counter (raw: over tensors).

    Empty until bitsandbytes is loaded (its ops exist only then); the other bitsandbytes matmuls
    dispatch aten matmuls the counter sees.
    """
    gemm = _gemm_4bit()
    return {} if gemm is None else {gemm.overloadpacket: _gemm_4bit_flops}
