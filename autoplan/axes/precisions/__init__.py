"""One file per precision, each defining `KIND` (an `axes.precision.PrecisionKind`); `axes.precision` finds them all.

`Autocast` is the kind of every precision a unit runs in under torch.autocast (bf16, fp16); a precision applied
otherwise (a module swap) defines a kind of its own in its file.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from autoplan.axes import DeviceLike

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Autocast:
    """A low precision a unit runs in under `torch.autocast`: its matmuls and convolutions in `dtype_name`
    (bf16 and fp16 are each one, in their own files)."""

    name: str
    dtype_name: str
    order: int
    auto_preference: int | None
    grad_scaler: bool
    words: str
    missing: Callable[[DeviceLike], str]  # why a device cannot run it ("" when it can)
    rewriting: int = 1  # an autocast around the unit
    around_the_model: bool = True  # forced on every unit, an autocast around the whole forward

    def unsupported(self, device: DeviceLike) -> str:
        return self.missing(device)

    def running(self, module: torch.nn.Module, device_type: str) -> contextlib.AbstractContextManager:
        import torch

        # The weight cache would keep low-precision weight copies alive until the outermost autocast
        # exits, which defeats checkpointing; without it each use casts, and the cast is what is saved.
        return torch.autocast(device_type, dtype=getattr(torch, self.dtype_name), cache_enabled=False)

    def flops(self, device: DeviceLike, allow_tf32: bool) -> float:
        # a precision the datasheet does not rate runs at the fp32 rate (emulated or upcast)
        return device.peak_flops.get(self.name, device.peak_flops["fp32"])
