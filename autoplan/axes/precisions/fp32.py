"""fp32: the model as written, outside any autocast (a unit in fp32 turns off an autocast around it)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from autoplan.axes import DeviceLike

if TYPE_CHECKING:
    import torch


class Fp32:
    name = "fp32"
    dtype_name = "float32"
    order = 0
    rewriting = 0  # the unit as written
    auto_preference = None  # "auto" chooses between fp32 and a low precision
    grad_scaler = False
    words = "fp32"
    around_the_model = True

    def unsupported(self, device: DeviceLike) -> str:
        return ""

    def running(self, module: torch.nn.Module, device_type: str) -> contextlib.AbstractContextManager:
        import torch

        if torch.is_autocast_enabled(device_type):
            return torch.autocast(device_type, enabled=False)
        return contextlib.nullcontext()

    def flops(self, device: DeviceLike, allow_tf32: bool) -> float:
        fp32 = device.peak_flops["fp32"]
        return device.peak_flops.get("tf32", fp32) if allow_tf32 else fp32


KIND = Fp32()
