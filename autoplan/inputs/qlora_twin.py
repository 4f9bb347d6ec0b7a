"""The QLoRA twin of a Hugging Face model on the meta device: what a real 4-bit load would hold, no weights.

    twin = qlora_twin(model_from_config("llama-3-8b"))      # seconds, no memory, nothing downloaded

A person fine-tuning with QLoRA loads the checkpoint with `BitsAndBytesConfig(load_in_4bit=True, ...)`
(transformers replaces every `nn.Linear` but the output head by a bitsandbytes `Linear4bit` and packs its
weight), calls `peft.prepare_model_for_kbit_training` (freezes everything, upcasts the fp16/bf16 weights
left unquantized — embeddings, norms, head — to fp32) and `peft.get_peft_model` with a `LoraConfig`
(trainable low-rank adapters beside every quantized Linear). The twin takes the same steps with the same
libraries on the meta device; only the packing is not real: `bitsandbytes.functional.quantize_4bit` runs
on a meta weight, which gives the tensors a real load holds — the packed weight (numel/2 bytes of uint8),
the quant state (absmax per 64-weight block: fp32, or with double quantization uint8 plus an fp32 absmax
per 256 blocks, a 256-entry fp32 code and an offset; the 16-entry fp32 NF4/FP4 map) — with shapes and
no values. `tests/report/test_ladder.py` checks that the twin plans to the byte as a real small 4-bit load.

bitsandbytes, peft and transformers are optional (`pip install -e ".[qlora]"`): without them
`require_qlora` raises `MissingExtraError` with that line.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch

from autoplan.axes.precision import dtype_of
from autoplan.errors import MissingExtraError, OptionError
from autoplan.inputs.hf_models import HFModel

QLORA_EXTRA = 'pip install -e ".[qlora]"'  # pyproject's qlora extra: bitsandbytes, peft, trl
QLORA_PACKAGES = ("bitsandbytes", "peft", "trl")


@dataclass(frozen=True)
class QLoraSettings:
    """The QLoRA recipe the twin is built with (the QLoRA paper's: NF4, double quantization, LoRA on all linears)."""

    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "bf16"  # bnb_4bit_compute_dtype: what the dequantized weight multiplies in
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: str = "all-linear"

    def bits_and_bytes_arguments(self) -> str:
        return (f'load_in_4bit=True, bnb_4bit_quant_type="{self.quant_type}", bnb_4bit_use_double_quant={self.double_quant}, '
                f"bnb_4bit_compute_dtype={dtype_of(self.compute_dtype)}")  # str(torch.bfloat16): "torch.bfloat16"

    def lora_arguments(self) -> str:
        return (f'r={self.rank}, lora_alpha={self.alpha}, lora_dropout={self.dropout}, target_modules="{self.target_modules}", '
                'task_type="CAUSAL_LM"')


def missing_extra_message(package: str, needed_for: str) -> str:
    """The one line that says which extra to install for a package that is not there."""
    return f"{needed_for} needs {package}, which is not installed: {QLORA_EXTRA} (bitsandbytes, peft, trl)"


def require_extra(package: str, needed_for: str) -> ModuleType:
    """`package` imported, or MissingExtraError naming the qlora extra (an import hook that refuses it counts as missing)."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise MissingExtraError(missing_extra_message(package, needed_for)) from None


def check_qlora_installed(needed_for: str) -> None:
    """MissingExtraError unless bitsandbytes and peft can be imported; imports nothing (bitsandbytes logs as it loads)."""
    for package in ("bitsandbytes", "peft"):
        try:
            found = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise MissingExtraError(missing_extra_message(package, needed_for))


def require_qlora(needed_for: str = "the 4-bit QLoRA rung") -> tuple[ModuleType, ModuleType, ModuleType]:
    """bitsandbytes, peft and transformers, or MissingExtraError for the first one missing."""
    return tuple(require_extra(name, needed_for) for name in ("bitsandbytes", "peft", "transformers"))  # type: ignore[return-value]


def checkpoint_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the checkpoint's weights are stored in: the config's (`dtype`), else bf16.

    A 4-bit layer's quant state remembers it (the backward dequantizes to it), and the weights left
    unquantized load in it before peft upcasts them. Presets carry no dtype; the published
    checkpoints of the models autoplan has presets for are bf16.
    """
    dtype = getattr(model.config, "dtype", None)  # transformers 5's name (torch_dtype is deprecated)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16


def with_attention(model: HFModel, implementation: str) -> torch.nn.Module:
    """A copy of the Hugging Face `model` (on the meta device: a copy costs nothing) using this attention.

    "eager" saves the T×T attention probabilities for backward, "sdpa" (F.scaled_dot_product_attention)
    does not; a model that cannot use it is a ValueError from transformers.
    """
    variant: HFModel = copy.deepcopy(model)
    variant.set_attn_implementation(implementation)
    return variant


def qlora_twin(model: torch.nn.Module, settings: QLoraSettings = QLoraSettings()) -> torch.nn.Module:
    """A meta-device copy of the Hugging Face `model` as a QLoRA load of its checkpoint would be: a PeftModel.

    `model` must be on the meta device (hf.model_from_config builds it so); it is not changed.
    """
    bnb, peft, transformers = require_qlora()
    if any(not p.is_meta for p in model.parameters()):
        raise OptionError("qlora_twin() takes a model on the meta device (autoplan.hf.model_from_config); "
                          "load a real one with BitsAndBytesConfig instead")
    twin = copy.deepcopy(model)
    stored = checkpoint_dtype(model)
    _quantize_linears(twin, bnb, transformers, settings, stored)
    twin = peft.prepare_model_for_kbit_training(twin, use_gradient_checkpointing=False)  # autoplan checkpoints
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=settings.target_modules, task_type="CAUSAL_LM")
    return peft.get_peft_model(twin, config)


def _quantize_linears(model: torch.nn.Module, bnb, transformers, settings: QLoraSettings, stored: torch.dtype) -> None:
    """transformers' own 4-bit quantizer swaps the Linears as a load does; each Linear4bit then gets a packed meta weight."""
    from transformers.quantizers import AutoHfQuantizer

    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=settings.quant_type, bnb_4bit_use_double_quant=settings.double_quant,
        bnb_4bit_compute_dtype=dtype_of(settings.compute_dtype))
    quantizer = AutoHfQuantizer.from_config(quantization, pre_quantized=False)
    for param in model.parameters():  # a real load reads the stored weights in their dtype
        param.data = param.data.to(stored)
    with torch.device("meta"):  # the Linear4bit modules allocate their (unquantized) weight on creation
        quantizer.preprocess_model(model, device_map=None)
    # bitsandbytes caches its 8-bit map on the device of the first tensor it quantizes: make it a CPU one,
    # or the meta packing below would leave a meta map that a real load's double quantization cannot copy
    bnb.functional.name2qmap.setdefault("dynamic", bnb.functional.create_dynamic_map())
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = module.weight
            packed = bnb.nn.Params4bit(torch.empty(weight.shape, dtype=stored, device="meta"), requires_grad=False,
                                       blocksize=weight.blocksize, compress_statistics=weight.compress_statistics,
                                       quant_type=weight.quant_type, quant_storage=weight.quant_storage, module=module)
            module.weight = packed._quantize("meta")  # quantize_4bit's meta kernels: the shapes, no values
            if module.bias is not None:
                module.bias = torch.nn.Parameter(module.bias.data.to(stored), requires_grad=False)
    quantizer.postprocess_model(model)  # config.quantization_config, is_loaded_in_4bit: what peft reads
    model.hf_quantizer = quantizer
