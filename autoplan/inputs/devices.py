"""Hardware descriptions the planner prices plans against.

A ``Device`` holds a device's memory capacity, dense peak FLOP/s per
precision, memory bandwidth and the memory lost outside the allocator.
``DEVICES`` is a table of common accelerators taken from vendor datasheets;
``get_device`` resolves a name, an alias or the machine's current device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

from autoplan.axes.precision import PRECISION, dtype_of, flops_for, low_precision
from autoplan.errors import DeviceError
from autoplan.inputs.cuda_context import default_context
from autoplan.vocabulary.sizes import parse_size

if TYPE_CHECKING:  # torch is imported where a device needs it: naming a profile (`--device h100`) costs no torch import
    import torch

_GB = 2**30  # datasheet "80GB" of GPU memory is 80 GiB (nvidia-smi counts MiB)
_T = 1e12


@dataclass(frozen=True)
class Device:
    """One kind of device; rates are dense (no structured sparsity)."""

    name: str
    description: str
    kind: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    context_bytes: int
    source: str
    # CUDA compute capability (major, minor): which attention kernels the card runs
    # (instruments.attention); None for the CPU
    compute_capability: tuple[int, int] | None = None
    # the host link, bytes per second each way: what copies of offloaded activations move at
    # (the card's PCIe generation, or NVLink-C2C); 0: no host link (the CPU)
    host_bandwidth: float = 0.0
    context_source: str = ""  # where context_bytes comes from (inputs.cuda_context): measured, estimated, or given

    def __post_init__(self) -> None:
        # A plain dict would let callers mutate a "frozen" device's rates.
        if not isinstance(self.peak_flops, types.MappingProxyType):
            object.__setattr__(
                self, "peak_flops", types.MappingProxyType(dict(self.peak_flops))
            )

    @property
    def supports_bf16(self) -> bool:
        return not PRECISION.unsupported("bf16", self)

    @property
    def low_precision_name(self) -> str:
        """The low precision `precision="auto"` picks here (`axes.precision.low_precision`): bf16, or fp16 without it."""
        return low_precision(self).name

    @property
    def low_precision_dtype(self) -> torch.dtype:
        return dtype_of(self.low_precision_name)

    def flops_for(self, dtype: torch.dtype, *, allow_tf32: bool = False) -> float:
        """Peak FLOP/s for matmuls in ``dtype`` (`axes.precision.flops_for`).

        A precision the hardware lacks runs at the fp32 rate (emulated or
        upcast), and so do dtypes without a tensor-core path (ints, float64).
        """
        return flops_for(self, dtype, allow_tf32=allow_tf32)


def _cuda(
    name: str,
    description: str,
    memory_gb: float,
    flops_tera: Mapping[str, float],
    bandwidth_bytes: float,
    source: str,
    compute_capability: tuple[int, int],
    host_bandwidth: float,
) -> Device:
    return Device(
        name=name,
        description=description,
        kind="cuda",
        memory_bytes=int(memory_gb * _GB),
        peak_flops={k: v * _T for k, v in flops_tera.items()},
        memory_bandwidth=bandwidth_bytes,
        source=source,
        compute_capability=compute_capability,
        host_bandwidth=host_bandwidth,
        **_context_of(compute_capability),
    )


# Host links, per direction, from the interface's specification (x16 lanes): real pinned copies
# reach less (to be measured on a GPU); GH200's NVLink-C2C is 900 GB/s both ways together.
_PCIE3, _PCIE4, _PCIE5, _NVLINK_C2C = 16e9, 32e9, 64e9, 450e9


def _context_of(compute_capability: tuple[int, int]) -> dict[str, Any]:
    """A card's context fields (`Device.context_bytes`, `context_source`) by its architecture (inputs.cuda_context)."""
    context_bytes, context_source = default_context(compute_capability)
    return {"context_bytes": context_bytes, "context_source": context_source}


def _cpu() -> Device:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device(
        name="cpu",
        description="host CPU (rates are rough guesses, not a datasheet)",
        kind="cpu",
        memory_bytes=int(memory),
        peak_flops={"fp32": 1e12, "bf16": 1e12},
        memory_bandwidth=50e9,
        context_bytes=0,
        source="rough estimate for a multi-core server CPU; memory from sysconf",
    )


_A100 = {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}
_H100 = {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "float8": 1978.9}  # float8: dense e4m3 (sparse is twice)
_V100 = {"fp32": 15.7, "fp16": 125}

_TABLE = (
    _cuda("a100-40gb", "NVIDIA A100 SXM4 40GB HBM2", 40, _A100, 1555e9,
          "NVIDIA A100 Tensor Core GPU datasheet (SXM, 40GB)", (8, 0), _PCIE4),
    _cuda("a100-80gb", "NVIDIA A100 SXM4 80GB HBM2e", 80, _A100, 2039e9,
          "NVIDIA A100 Tensor Core GPU datasheet (SXM, 80GB)", (8, 0), _PCIE4),
    _cuda("h100-80gb", "NVIDIA H100 SXM5 80GB HBM3", 80, _H100, 3.35e12,
          "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)", (9, 0), _PCIE5),
    _cuda("h200", "NVIDIA H200 SXM 141GB HBM3e", 141, _H100, 4.8e12,
          "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)", (9, 0), _PCIE5),
    # GeForce: fp16/bf16 (and float8) tensor rates with fp32 accumulate, as frameworks use.
    _cuda("rtx-3090", "NVIDIA GeForce RTX 3090 24GB GDDR6X", 24,
          {"fp32": 35.6, "tf32": 35.6, "bf16": 71, "fp16": 71}, 936e9,
          "NVIDIA Ampere GA102 GPU Architecture whitepaper (RTX 3090)", (8, 6), _PCIE4),
    _cuda("rtx-4090", "NVIDIA GeForce RTX 4090 24GB GDDR6X", 24,
          {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "float8": 330.3}, 1008e9,
          "NVIDIA Ada GPU Architecture whitepaper (RTX 4090)", (8, 9), _PCIE4),
    _cuda("t4", "NVIDIA T4 16GB GDDR6", 16, {"fp32": 8.1, "fp16": 65}, 320e9,
          "NVIDIA T4 Tensor Core GPU datasheet", (7, 5), _PCIE3),
    _cuda("v100-16gb", "NVIDIA V100 SXM2 16GB HBM2", 16, _V100, 900e9,
          "NVIDIA Tesla V100 GPU datasheet (SXM2)", (7, 0), _PCIE3),
    _cuda("v100-32gb", "NVIDIA V100 SXM2 32GB HBM2", 32, _V100, 900e9,
          "NVIDIA Tesla V100 GPU datasheet (SXM2)", (7, 0), _PCIE3),
    _cuda("l4", "NVIDIA L4 24GB GDDR6", 24,
          {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "float8": 242.5}, 300e9,
          "NVIDIA L4 Tensor Core GPU datasheet", (8, 9), _PCIE4),
    _cuda("a10g", "NVIDIA A10G 24GB GDDR6 (AWS g5)", 24,
          {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125}, 600e9,
          "NVIDIA A10 Tensor Core GPU datasheet; AWS's A10G assumed at the A10's rates", (8, 6), _PCIE4),
    _cuda("rtx-a6000", "NVIDIA RTX A6000 48GB GDDR6", 48,
          {"fp32": 38.7, "tf32": 77.4, "bf16": 154.8, "fp16": 154.8}, 768e9,
          "NVIDIA RTX A6000 datasheet (dense tensor rates)", (8, 6), _PCIE4),
    _cuda("l40s", "NVIDIA L40S 48GB GDDR6", 48,
          {"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05, "float8": 733}, 864e9,
          "NVIDIA L40S GPU datasheet (dense tensor rates)", (8, 9), _PCIE4),
    _cuda("gh200", "NVIDIA GH200 Grace Hopper Superchip, 96GB HBM3", 96, _H100, 4e12,
          "NVIDIA GH200 Grace Hopper Superchip datasheet (96GB HBM3, NVLink-C2C)", (9, 0), _NVLINK_C2C),
    _cpu(),
)

DEVICES: dict[str, Device] = {d.name: d for d in _TABLE}

_ALIASES = {
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h200-141gb": "h200",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "v100-16": "v100-16gb",
    "v100-32": "v100-32gb",
    "3090": "rtx-3090",
    "rtx3090": "rtx-3090",
    "4090": "rtx-4090",
    "rtx4090": "rtx-4090",
    "a10": "a10g",
    "a6000": "rtx-a6000",
    "rtxa6000": "rtx-a6000",
    "l40-s": "l40s",
}

# Tokens of torch.cuda.get_device_name() that identify a family; the member
# whose nominal memory is closest to the real one wins (A100 40/80, V100 16/32).
_FAMILIES = {
    "h100": ("h100-80gb",),
    "h200": ("h200",),
    "gh200": ("gh200",),
    "a100": ("a100-40gb", "a100-80gb"),
    "v100": ("v100-16gb", "v100-32gb"),
    "3090": ("rtx-3090",),
    "4090": ("rtx-4090",),
    "t4": ("t4",),
    "l4": ("l4",),
    "a10g": ("a10g",),
    "a10": ("a10g",),
    "a6000": ("rtx-a6000",),
    "l40s": ("l40s",),
}


def list_devices() -> list[Device]:
    """All known devices, sorted by name."""
    return sorted(DEVICES.values(), key=lambda d: d.name)


def get_device(spec: str | Device | torch.device | None = None) -> Device:
    """Resolve ``spec`` to a ``Device``.

    A ``Device`` is returned as is. A string is a device name or alias
    (case-insensitive, e.g. "h100", "4090"); a family sold with more than one
    memory size ("a100", "v100") must say which. ``device=None`` means the
    current CUDA device if CUDA is available, else the "cpu" device; a
    detected GPU reports its real memory from torch. A ``torch.device`` is the
    CPU profile or that CUDA device of this machine.
    """
    if isinstance(spec, Device):
        return spec
    if spec is None:
        return _current_device()
    if _is_torch_device(spec):
        return _torch_device(spec)
    if not isinstance(spec, str):
        raise DeviceError(f"device must be a name (see autoplan devices), a Device or a torch.device; got {spec!r}")
    if spec.strip().lower().startswith("custom:"):
        return custom_device(_key_values(spec.strip()[len("custom:"):]), spec)
    if spec.strip().lower().endswith(".json"):
        return custom_device(_json_object(spec.strip()), spec)
    key = re.sub(r"[\s_]+", "-", spec.strip().lower())
    if re.fullmatch(r"cuda(:\d+)?", key):  # this machine's GPU, as torch names it
        import torch

        return _torch_device(torch.device(key))
    key = _ALIASES.get(key, key)
    sizes = _FAMILIES.get(key, ())
    if key not in DEVICES and len(sizes) > 1:
        raise DeviceError(f"{spec!r} comes with different memory sizes: name one of {', '.join(sizes)}")
    if key not in DEVICES:
        known = ", ".join(sorted(DEVICES))
        raise DeviceError(f"unknown device {spec!r}. Known devices: {known}")
    return DEVICES[key]


CUSTOM_KEYS = {
    "memory": "the card's memory, e.g. 48GiB (required)",
    "fp32_tflops": "dense fp32 TFLOP/s (required)",
    "bandwidth": "memory bandwidth, e.g. 864GB/s (required)",
    "bf16_tflops": "dense bf16 tensor TFLOP/s (none: the card has no bf16, fp16 is its low precision)",
    "fp16_tflops": "dense fp16 tensor TFLOP/s (default: the bf16 rate, else the fp32 rate)",
    "tf32_tflops": "dense TF32 tensor TFLOP/s (default: none)",
    "float8_tflops": "dense float8 (e4m3) tensor TFLOP/s (none: the card has no float8)",
    "capability": "CUDA compute capability, e.g. 8.9 (default 8.0 with bf16, else 7.0)",
    "host_bandwidth": "host link per direction, e.g. 32GB/s (default 32GB/s, PCIe Gen4 x16)",
    "name": "what the report calls it (default: custom)", "description": "a line for the report",
}
_REQUIRED = ("memory", "fp32_tflops", "bandwidth")


def custom_device(values: Mapping[str, object], spec: str = "custom") -> Device:
    """A CUDA card from its numbers (`CUSTOM_KEYS`): `--device custom:memory=48GiB,fp32_tflops=91.6,...` or a JSON file."""
    def fail(reason: str) -> DeviceError:
        keys = "; ".join(f"{key}: {meaning}" for key, meaning in CUSTOM_KEYS.items())
        return DeviceError(f"device {spec!r}: {reason}. Keys: {keys}")

    unknown = sorted(set(values) - set(CUSTOM_KEYS))
    missing = [key for key in _REQUIRED if key not in values]
    if unknown or missing:
        raise fail(f"unknown key(s) {', '.join(unknown)}" if unknown else f"missing {', '.join(missing)}")
    rates = {name: _positive(values[f"{name}_tflops"], f"{name}_tflops", fail) * _T
             for name in ("fp32", "bf16", "fp16", "tf32", "float8") if f"{name}_tflops" in values}
    rates.setdefault("fp16", rates.get("bf16", rates["fp32"]))
    capability = _capability(str(values.get("capability", "8.0" if "bf16" in rates else "7.0")), fail)
    return Device(
        name=str(values.get("name", "custom")), description=str(values.get("description", f"custom card ({spec})")), kind="cuda",
        memory_bytes=_size(values["memory"], "memory", fail), peak_flops=rates,
        memory_bandwidth=float(_size(str(values["bandwidth"]).removesuffix("/s"), "bandwidth", fail)),
        source=f"given: {spec}", compute_capability=capability, **_context_of(capability),
        host_bandwidth=float(_size(str(values.get("host_bandwidth", "32GB")).removesuffix("/s"), "host_bandwidth", fail)),
    )


def _key_values(text: str) -> dict[str, str]:
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    if any(not sep or not value.strip() for _, sep, value in pairs):
        raise DeviceError(f"a custom device is key=value pairs separated by commas (custom:memory=48GiB,fp32_tflops=91.6,"
                          f"bandwidth=864GB/s); got {text!r}")
    return _unique([(key.strip().lower(), value.strip()) for key, _, value in pairs], f"the custom device {text!r}")


def _unique(pairs: list[tuple[str, Any]], where: str) -> dict[str, Any]:
    """The pairs as a dict; a key given twice is refused (a dict would keep the last, silently)."""
    keys = [key for key, _ in pairs]
    twice = next((key for key in keys if keys.count(key) > 1), None)
    if twice is not None:
        raise DeviceError(f"{where} gives {twice!r} twice: give each key once")
    return dict(pairs)


def _json_object(path: str) -> dict[str, object]:
    try:
        with open(path, encoding="utf-8") as file:
            values = json.load(file, object_pairs_hook=lambda pairs: _unique(pairs, f"the device file {path!r}"))
    except DeviceError:
        raise
    except (OSError, ValueError) as error:
        raise DeviceError(f"cannot read the device file {path!r}: {error}") from error
    if not isinstance(values, dict):
        raise DeviceError(f"the device file {path!r} must hold one JSON object of {', '.join(CUSTOM_KEYS)}")
    return values


def _positive(value: object, key: str, fail) -> float:
    try:
        if not isinstance(value, (int, float, str)):
            raise TypeError(value)
        number = float(value)
    except (TypeError, ValueError):
        raise fail(f"{key} must be a number, got {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise fail(f"{key} must be positive, got {value!r}")
    return number


def _size(value: object, key: str, fail) -> int:
    return parse_size(value, None, allow_zero=False, what=key, fail=lambda reason: fail(f"{key}: {reason}"))


def _capability(text: str, fail) -> tuple[int, int]:
    major, dot, minor = text.partition(".")
    if not (major.isdigit() and (not dot or minor.isdigit())):
        raise fail(f"capability is major.minor, e.g. 8.9; got {text!r}")
    return int(major), int(minor or 0)


def _is_torch_device(spec: object) -> TypeGuard[torch.device]:
    torch = sys.modules.get("torch")  # not imported: spec cannot be one of its devices
    return torch is not None and isinstance(spec, torch.device)


def _torch_device(device: torch.device) -> Device:
    import torch

    if device.type == "cpu":
        return DEVICES["cpu"]
    if device.type != "cuda":
        raise DeviceError(f"autoplan plans for CUDA GPUs and the CPU; got torch.device({str(device)!r})")
    if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
        raise DeviceError(f"{device} is not a CUDA device of this machine: name the GPU to plan for, e.g. 'h100-80gb'")
    index = torch.cuda.current_device() if device.index is None else device.index
    props = torch.cuda.get_device_properties(index)
    return _match_gpu(torch.cuda.get_device_name(index), int(props.total_memory), index, (props.major, props.minor))


def _current_device() -> Device:
    import torch

    if not torch.cuda.is_available():
        return DEVICES["cpu"]
    return _torch_device(torch.device("cuda", torch.cuda.current_device()))


def _match_gpu(name: str, memory_bytes: int, index: int, capability: tuple[int, int]) -> Device:
    """Map a CUDA device name to a table entry, keeping its real memory."""
    # Whole tokens only, so "L40S" does not pass for "L4".
    tokens = set(re.split(r"[^a-z0-9]+", name.lower()))
    for token, members in _FAMILIES.items():
        if token in tokens:
            best = min((DEVICES[m] for m in members), key=lambda d: abs(d.memory_bytes - memory_bytes))
            return dataclasses.replace(best, memory_bytes=memory_bytes, compute_capability=capability, **_context_of(capability))
    return _unknown_gpu(name, memory_bytes, index, capability)


def _unknown_gpu(name: str, memory_bytes: int, index: int, capability: tuple[int, int]) -> Device:
    h100 = DEVICES["h100-80gb"]
    rates = dict(h100.peak_flops)
    if capability[0] < 8:
        # bf16 and tf32 arrived with Ampere (compute capability 8.0).
        rates.pop("bf16", None)
        rates.pop("tf32", None)
    return dataclasses.replace(
        h100,
        name=f"cuda:{index}",
        description=f"{name} (rates unknown; H100 rates assumed)",
        memory_bytes=memory_bytes,
        peak_flops=rates,
        source="torch.cuda device properties; rates copied from H100 SXM",
        compute_capability=capability,
        **_context_of(capability),
    )
