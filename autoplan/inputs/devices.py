"""The devices the planner prices plans against: a table of common accelerators, and how a name finds one.

``DEVICES`` is the table, taken from vendor datasheets (a ``Device``, `inputs.device_model`, holds a
device's memory capacity, dense peak FLOP/s per precision, bandwidths and the memory lost outside the
allocator); ``get_device`` resolves a name, an alias, a custom card (`inputs.custom_devices`) or the
machine's current device.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import TYPE_CHECKING, TypeGuard

from autoplan.errors import DeviceError
from autoplan.inputs.custom_devices import CUSTOM_KEYS, custom_device, json_object, key_values
from autoplan.inputs.device_model import (NETWORK_200G, NETWORK_400G, NVLINK2, NVLINK3, NVLINK4, NVLINK_C2C, PCIE3, PCIE4, PCIE5,
                                          Device, context_of, cuda_card)

if TYPE_CHECKING:  # torch is imported where a device needs it: naming a profile (`--device h100`) costs no torch import
    import torch

# Device lives in inputs.device_model and CUSTOM_KEYS in inputs.custom_devices; both are read from here too
__all__ = ["CUSTOM_KEYS", "DEVICES", "Device", "get_device", "list_devices"]


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
    cuda_card("a100-40gb", "NVIDIA A100 SXM4 40GB HBM2", 40, _A100, 1555e9,
          "NVIDIA A100 Tensor Core GPU datasheet (SXM, 40GB)", (8, 0), PCIE4, NVLINK3, NETWORK_200G),
    cuda_card("a100-80gb", "NVIDIA A100 SXM4 80GB HBM2e", 80, _A100, 2039e9,
          "NVIDIA A100 Tensor Core GPU datasheet (SXM, 80GB)", (8, 0), PCIE4, NVLINK3, NETWORK_200G),
    cuda_card("h100-80gb", "NVIDIA H100 SXM5 80GB HBM3", 80, _H100, 3.35e12,
          "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)", (9, 0), PCIE5, NVLINK4, NETWORK_400G),
    cuda_card("h200", "NVIDIA H200 SXM 141GB HBM3e", 141, _H100, 4.8e12,
          "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)", (9, 0), PCIE5, NVLINK4, NETWORK_400G),
    # GeForce: fp16/bf16 (and float8) tensor rates with fp32 accumulate, as frameworks use.
    cuda_card("rtx-3090", "NVIDIA GeForce RTX 3090 24GB GDDR6X", 24,
          {"fp32": 35.6, "tf32": 35.6, "bf16": 71, "fp16": 71}, 936e9,
          "NVIDIA Ampere GA102 GPU Architecture whitepaper (RTX 3090)", (8, 6), PCIE4),
    cuda_card("rtx-4090", "NVIDIA GeForce RTX 4090 24GB GDDR6X", 24,
          {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "float8": 330.3}, 1008e9,
          "NVIDIA Ada GPU Architecture whitepaper (RTX 4090)", (8, 9), PCIE4),
    cuda_card("t4", "NVIDIA T4 16GB GDDR6", 16, {"fp32": 8.1, "fp16": 65}, 320e9,
          "NVIDIA T4 Tensor Core GPU datasheet", (7, 5), PCIE3),
    cuda_card("v100-16gb", "NVIDIA V100 SXM2 16GB HBM2", 16, _V100, 900e9,
          "NVIDIA Tesla V100 GPU datasheet (SXM2)", (7, 0), PCIE3, NVLINK2),
    cuda_card("v100-32gb", "NVIDIA V100 SXM2 32GB HBM2", 32, _V100, 900e9,
          "NVIDIA Tesla V100 GPU datasheet (SXM2)", (7, 0), PCIE3, NVLINK2),
    cuda_card("l4", "NVIDIA L4 24GB GDDR6", 24,
          {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "float8": 242.5}, 300e9,
          "NVIDIA L4 Tensor Core GPU datasheet", (8, 9), PCIE4),
    cuda_card("a10g", "NVIDIA A10G 24GB GDDR6 (AWS g5)", 24,
          {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125}, 600e9,
          "NVIDIA A10 Tensor Core GPU datasheet; AWS's A10G assumed at the A10's rates", (8, 6), PCIE4),
    cuda_card("rtx-a6000", "NVIDIA RTX A6000 48GB GDDR6", 48,
          {"fp32": 38.7, "tf32": 77.4, "bf16": 154.8, "fp16": 154.8}, 768e9,
          "NVIDIA RTX A6000 datasheet (dense tensor rates)", (8, 6), PCIE4),
    cuda_card("l40s", "NVIDIA L40S 48GB GDDR6", 48,
          {"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05, "float8": 733}, 864e9,
          "NVIDIA L40S GPU datasheet (dense tensor rates)", (8, 9), PCIE4),
    cuda_card("gh200", "NVIDIA GH200 Grace Hopper Superchip, 96GB HBM3", 96, _H100, 4e12,
          "NVIDIA GH200 Grace Hopper Superchip datasheet (96GB HBM3, NVLink-C2C)", (9, 0), NVLINK_C2C, NVLINK4, NETWORK_400G),
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
        return custom_device(key_values(spec.strip()[len("custom:"):]), spec)
    if spec.strip().lower().endswith(".json"):
        return custom_device(json_object(spec.strip()), spec)
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
            return dataclasses.replace(best, memory_bytes=memory_bytes, compute_capability=capability, **context_of(capability))
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
        **context_of(capability),
    )
