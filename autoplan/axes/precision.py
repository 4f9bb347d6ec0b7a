"""The precision axis: what a unit's ops compute in, one precision per file in `axes/precisions/`.

Every module of `axes/precisions/` defines `KIND`, a `PrecisionKind` (the autocast ones an `Autocast`, `axes.precisions`): its name (`Choice.precision`,
`--precision`, the report's column), torch's dtype, whether a device can run it, how a unit runs in it
(a context around the unit's forward: autocast, or a swap of its modules while it runs), the rate its
matmuls are priced at, and the report's words for it. A new precision is a new file there and its tests:
this module finds them, and everything else asks it (`kind(name)`, `names()`, `choices_for(setting, device)`).

The setting "auto" lets the solver choose per unit between fp32 and the device's preferred low
precision (`low_precision`: bf16, or fp16 on a card without bf16).

No torch at import: the command line lists the names before torch is loaded (`kinds()` imports none).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pkgutil
from typing import TYPE_CHECKING, Protocol, cast

from autoplan.axes import DeviceLike
from autoplan.errors import OptionError

if TYPE_CHECKING:
    import torch

Precision = str  # a name of `names()`: "fp32", "bf16", "fp16", "float8", "float8-rowwise"
AUTO = "auto"  # the setting that lets the solver choose per unit
AUTO_FLOAT8 = "auto-float8"  # the same, float8 (torchao's tensorwise recipe) among the choices


class PrecisionKind(Protocol):
    """One precision, as its file in `axes/precisions/` defines it."""

    name: str  # "bf16"
    dtype_name: str  # torch's dtype, by name: "bfloat16" (torch is imported where it is used)
    order: int  # where it stands in `names()`
    rewriting: int  # how much running in it changes a unit (fp32: 0, as written): ties go to the least
    auto_preference: int | None  # among the low precisions "auto" may pick, lower first; None: never picked by "auto"
    grad_scaler: bool  # its gradients need torch.amp.GradScaler in the training loop (fp16's range)
    words: str  # the report's name for the step to it: "bf16 autocast"
    around_the_model: bool  # forced on every unit, it runs outside them too (autocast); float8 swaps the units' linears only

    def unsupported(self, device: DeviceLike) -> str:
        """Why `device` cannot run it ("" when it can)."""
        ...

    def running(self, module: torch.nn.Module, device_type: str) -> contextlib.AbstractContextManager:
        """The context a unit's forward runs in, in this precision (on tensors of `device_type`)."""
        ...

    def flops(self, device: DeviceLike, allow_tf32: bool) -> float:
        """Peak FLOP/s of its matmuls on `device`: what the roofline prices its compute at."""
        ...


def _discovered() -> tuple[PrecisionKind, ...]:
    """Every precision of `axes/precisions/`, in their `order`: each module there defines one `KIND`."""
    from autoplan.axes import precisions

    found = [cast(PrecisionKind, importlib.import_module(f"{precisions.__name__}.{module.name}").KIND)
             for module in pkgutil.iter_modules(precisions.__path__)]
    return tuple(sorted(found, key=lambda found_kind: found_kind.order))


# Found once, at import: a planned unit asks for its precision in every forward, under torch.compile too, where
# Dynamo traces plain lookups but not a walk of the file system
_KINDS = _discovered()


def kinds() -> tuple[PrecisionKind, ...]:
    """Every precision, in their `order`."""
    return _KINDS


def names() -> tuple[Precision, ...]:
    return tuple(found.name for found in kinds())


def settings() -> tuple[str, ...]:
    """What the precision option takes: "auto" or "auto-float8" (a choice per unit), or one precision for every unit."""
    return (AUTO, AUTO_FLOAT8, *names())


def kind(name: str) -> PrecisionKind:
    """The precision called `name`; an OptionError listing the precisions for any other."""
    for found in kinds():
        if found.name == name:
            return found
    raise OptionError(f"unknown precision {name!r}; expected one of {names()}")


class PrecisionAxis:
    """The `ChoiceAxis` of precisions (`Choice.precision`)."""

    field = "precision"

    def values(self) -> tuple[Precision, ...]:
        return names()

    def check(self, value: object) -> Precision:
        if isinstance(value, str):
            return kind(value).name
        raise OptionError(f"unknown precision {value!r}; expected one of {names()}")

    def unsupported(self, value: str, device: DeviceLike) -> str:
        return kind(value).unsupported(device)

    def rewriting(self, value: str) -> int:
        return kind(value).rewriting

    def words(self, value: str) -> str:
        return value


PRECISION = PrecisionAxis()


def low_precision(device: DeviceLike) -> PrecisionKind:
    """The low precision "auto" picks on `device`: the preferred one it runs (bf16; fp16 without bf16)."""
    candidates = [found for found in kinds() if found.auto_preference is not None and not found.unsupported(device)]
    return min(candidates, key=lambda found: cast(int, found.auto_preference))


def check_setting(setting: object, device: DeviceLike) -> str:
    """The precision option, once it is a setting `device` runs (the one check of a precision against a device)."""
    if not isinstance(setting, str) or setting not in settings():
        listed = ", ".join(repr(name) for name in settings()[:-1]) + f" or {settings()[-1]!r}"
        raise OptionError(f"precision must be {listed}; got {setting!r}")
    why = "" if setting == AUTO else kind("float8" if setting == AUTO_FLOAT8 else setting).unsupported(device)
    if why:
        low = low_precision(device).name
        raise OptionError(f"precision {setting!r} (--precision {setting}): {why}; use {low!r}"
                          f"{' (with a GradScaler)' if kind(low).grad_scaler else ''} or 'auto', which picks {low} there")
    return setting


def choices_for(setting: str, device: DeviceLike) -> tuple[Precision, ...]:
    """The precisions the solver may choose from: "auto" means fp32 or the device's low precision, "auto-float8"
    those or float8."""
    checked = check_setting(setting, device)
    if checked == AUTO:
        return ("fp32", low_precision(device).name)
    if checked == AUTO_FLOAT8:
        return ("fp32", low_precision(device).name, "float8")
    return (setting,)


def rest_precision(setting: str) -> Precision:
    """What runs outside the units (the embeddings, the loss head): the one precision forced where it runs around
    the model (`around_the_model`), else fp32 (a choice per unit; float8, which converts the units' linears only)."""
    if setting in (AUTO, AUTO_FLOAT8) or not kind(setting).around_the_model:
        return "fp32"
    return setting


def dtype_of(name: str) -> torch.dtype:
    """torch's dtype of the precision called `name`."""
    import torch

    return getattr(torch, kind(name).dtype_name)


@functools.cache
def _by_dtype() -> dict[torch.dtype, PrecisionKind]:
    import torch

    by_dtype = {dtype_of(found.name): found for found in kinds()}
    # a kind's other dtypes: float8's gradients are cast to e5m2, and its matmuls on them run at its rate
    by_dtype.update({getattr(torch, name): found for found in kinds() for name in getattr(found, "other_dtype_names", ())})
    return by_dtype


def flops_for(device: DeviceLike, dtype: torch.dtype, *, allow_tf32: bool = False) -> float:
    """Peak FLOP/s for matmuls in `dtype` on `device`: its precision's rate; a dtype that is no precision of
    ours (ints, float64) runs at the fp32 rate."""
    found = _by_dtype().get(dtype)
    return found.flops(device, allow_tf32) if found is not None else device.peak_flops["fp32"]


def low_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes of every precision below fp32: what a low-precision unit's outputs may come out in."""
    return tuple(dtype_of(found.name) for found in kinds() if found.order > 0)
