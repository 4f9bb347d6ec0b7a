"""A CUDA card of the user's own numbers: `--device custom:memory=48GiB,fp32_tflops=91.6,...` or a JSON file of them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from autoplan.errors import DeviceError
from autoplan.inputs.device_model import TERA, Device, context_of
from autoplan.vocabulary.sizes import parse_size

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
    "interconnect": "link to the card's peers per direction, e.g. 450GB/s for NVLink 4 (default: the host link)",
    "network": "link between nodes per GPU per direction, e.g. 50GB/s for one 400 Gb/s port a GPU (default 12.5GB/s)",
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
    rates = {name: _positive(values[f"{name}_tflops"], f"{name}_tflops", fail) * TERA
             for name in ("fp32", "bf16", "fp16", "tf32", "float8") if f"{name}_tflops" in values}
    rates.setdefault("fp16", rates.get("bf16", rates["fp32"]))
    host = _per_second(values.get("host_bandwidth", "32GB"), "host_bandwidth", fail)
    capability = _capability(str(values.get("capability", "8.0" if "bf16" in rates else "7.0")), fail)
    return Device(
        name=str(values.get("name", "custom")), description=str(values.get("description", f"custom card ({spec})")), kind="cuda",
        memory_bytes=_size(values["memory"], "memory", fail), peak_flops=rates,
        memory_bandwidth=_per_second(values["bandwidth"], "bandwidth", fail),
        source=f"given: {spec}", compute_capability=capability, **context_of(capability), host_bandwidth=host,
        interconnect_bandwidth=_per_second(values["interconnect"], "interconnect", fail) if "interconnect" in values else host,
        network_bandwidth=_per_second(values.get("network", "12.5GB"), "network", fail),
    )


def key_values(text: str) -> dict[str, str]:
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


def json_object(path: str) -> dict[str, object]:
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


def _per_second(value: object, key: str, fail) -> float:
    """A bandwidth given as a size per second ("864GB/s", "864GB"), in bytes per second."""
    return float(_size(str(value).removesuffix("/s"), key, fail))


def _capability(text: str, fail) -> tuple[int, int]:
    major, dot, minor = text.partition(".")
    if not (major.isdigit() and (not dot or minor.isdigit())):
        raise fail(f"capability is major.minor, e.g. 8.9; got {text!r}")
    return int(major), int(minor or 0)
