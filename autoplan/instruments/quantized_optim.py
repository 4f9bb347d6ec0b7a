"""bitsandbytes' 8-bit and paged optimizers, built so that their step runs under fake tensors too.

bitsandbytes keeps, per trainable parameter of at least `min_8bit_size` (4096) elements, its
moments blockwise quantized: `state1` (and `state2` for two-moment optimizers) as uint8 of the
parameter's shape, `absmax1`/`absmax2` as one fp32 per block of 256 elements, and the two shared
256-entry fp32 quantization maps (`qmap1` signed, `qmap2` unsigned) that the optimizer creates
once and every parameter's state points to. Smaller parameters (and the 32-bit optimizers) keep
fp32 state of the parameter's shape. A paged optimizer asks for `state1`/`state2` of parameters of
at least 1e5 elements in CUDA unified memory (`get_paged`: a tensor marked `is_paged` over managed
memory, which the CUDA caching allocator, and so `max_memory_allocated`, never sees); smaller
parameters' state, the absmax and the maps stay ordinary device tensors. On the CPU bitsandbytes
falls back to ordinary tensors (with a warning), so there paged and unpaged state are the same bytes.
For a GPU target the simulation makes the paged buffers as fakes the tracker does not count, marked
`is_paged` as bitsandbytes marks its own, and `optimizer_state_tensors` leaves every paged tensor out
of the device's bytes: the plan assumes the driver pages them in and out of unified memory.

Everything an optimizer step allocates is therefore ordinary torch allocation that the live-bytes
tracker sees, except one thing: the quantization maps are computed with `.tolist()`, which fake
tensors cannot answer. `fake_safe_quantization_maps` computes them outside fake mode (they are
constants) and hands back a tensor of the same shape made in the current mode, so the fake step
allocates what the real one does.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Iterator

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes

from autoplan.errors import MissingExtraError
from autoplan.instruments.quantized import load_bitsandbytes_backends

# bitsandbytes' Optimizer8bit: a torch Optimizer with `args`, `is_paged`, `get_state_buffer`, ...; the package ships
# no types, so its own attributes are read as Any
BnbOptimizer = Any

# the names autoplan takes (API `optimizer=`, CLI `--optimizer`) and bitsandbytes' class for each
BNB_OPTIMIZERS: dict[str, str] = {
    "adamw8bit": "AdamW8bit",
    "adam8bit": "Adam8bit",
    "paged-adamw": "PagedAdamW",
    "paged-adamw8bit": "PagedAdamW8bit",
    "paged-adamw32bit": "PagedAdamW32bit",
    "lion8bit": "Lion8bit",
}
INSTALL_HINT = 'pip install -e ".[qlora]"'
PAGED_MIN_NUMEL = 100_000  # bitsandbytes pages the state of parameters of at least 1e5 elements (get_state_buffer)


def bitsandbytes_available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def is_bnb_optimizer(optimizer: Any) -> bool:
    """An instance of a bitsandbytes optimizer (they all derive from `Optimizer8bit`)."""
    return type(optimizer).__module__.startswith("bitsandbytes")


def _bnb_optim() -> Any:
    if not bitsandbytes_available():
        raise MissingExtraError(f"the bitsandbytes optimizers need bitsandbytes: {INSTALL_HINT}")
    with _disable_current_modes():  # importing it makes tensors: none of them is the step's
        import bitsandbytes.optim
    load_bitsandbytes_backends()
    return bitsandbytes.optim


def bnb_optimizer_by_name(name: str, params: list, *, device_kind: str = "cpu") -> torch.optim.Optimizer:
    """bitsandbytes' optimizer for `name` (a key of BNB_OPTIMIZERS) with its default settings, for a
    `device_kind` target ("cuda": paged state off the device)."""
    cls = getattr(_bnb_optim(), BNB_OPTIMIZERS[name])
    with fake_safe_quantization_maps():
        return _as_on_target(cls(params), device_kind)


def rebuilt_bnb_optimizer(
    optimizer: BnbOptimizer, params: list, defaults: dict, *, device_kind: str = "cpu"
) -> torch.optim.Optimizer:
    """A fresh optimizer of `optimizer`'s class and settings over `params`.

    Besides its `defaults`, a bitsandbytes optimizer keeps its bits, `min_8bit_size` and the like in
    `args`, and paging in `is_paged`; they decide what state it allocates, so they are passed on.
    """
    cls = type(optimizer)
    extra = {"args": optimizer.args, "is_paged": optimizer.is_paged}
    with fake_safe_quantization_maps():
        try:
            built = cls(params, **defaults, **extra)
        except TypeError:  # a class whose constructor fixes paging itself (PagedAdamW8bit, ...)
            built = cls(params, **defaults, args=optimizer.args)
    return _as_on_target(built, device_kind)


def _as_on_target(optimizer: BnbOptimizer, device_kind: str) -> torch.optim.Optimizer:
    """Under fake tensors (which live on the CPU), an optimizer that allocates as bitsandbytes does on the target."""
    if detect_fake_mode() is None:
        return optimizer
    if device_kind != "cuda":
        return optimizer  # on the CPU the maps `__init__` builds in host memory are on the device: all of them count
    if optimizer.is_paged:
        _pages_off_device(optimizer)
    return _without_unused_map(optimizer)


def _pages_off_device(optimizer: BnbOptimizer) -> None:
    """Large parameters' moments made as bitsandbytes' `get_paged` makes them on a GPU: outside the device's memory."""
    ordinary = optimizer.get_state_buffer

    def get_state_buffer(p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if p.numel() < PAGED_MIN_NUMEL:
            return ordinary(p, dtype=dtype)
        fake_mode = detect_fake_mode()
        with _disable_current_modes():  # no op dispatched: the tracker does not see it
            elem = torch.empty(p.shape, dtype=dtype, device="meta")
        buffer = FakeTensor(fake_mode, elem, p.device)
        setattr(buffer, "is_paged", True)  # bitsandbytes' mark of a paged buffer, on a FakeTensor that declares none
        return buffer

    optimizer.get_state_buffer = get_state_buffer
    # prefetching asks the driver to move pages (a C call on the buffer's address): it allocates no tensor
    optimizer.prefetch_state = lambda p: None


def _without_unused_map(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`__init__` builds both maps, in host memory, and a parameter's 8-bit state moves the ones it
    points to onto its device; the device never holds a map no state points to. A one-moment optimizer
    (Lion8bit) points only to the signed one; with no parameter of `min_8bit_size` elements (LoRA
    adapters: every state fp32) nothing points to either. Under fake tensors for a GPU target those are
    dropped, so the simulation holds only the maps the state points to, as the card does. (For a CPU
    target host memory is the device's: every map is kept, as the CPU allocator counts them.) A parameter
    that does need one later finds it gone and bitsandbytes builds it again (`init_state` calls
    `fill_qmap` when it is missing)."""
    from bitsandbytes.optim.optimizer import Optimizer1State

    maps: dict = getattr(optimizer, "name2qmap", {})
    smallest_8bit = getattr(getattr(optimizer, "args", None), "min_8bit_size", 0)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if smallest_8bit and not any(p.numel() >= smallest_8bit for p in params):
        maps.pop("dynamic", None)
        maps.pop("udynamic", None)
    elif isinstance(optimizer, Optimizer1State):
        maps.pop("udynamic", None)
    return optimizer


@contextlib.contextmanager
def fake_safe_quantization_maps() -> Iterator[None]:
    """While inside, bitsandbytes' `create_dynamic_map` works under fake tensors.

    The map is computed for real (it is a 256-entry constant built with `.tolist()`), then, when a
    fake mode is active, replaced by an uninitialized tensor of its shape and dtype made in that
    mode: the step only needs its shape, and the tracker sees it allocated as the real one is.
    """
    if not bitsandbytes_available():
        yield
        return
    import bitsandbytes.functional as bnb_functional

    original = bnb_functional.create_dynamic_map

    def create_dynamic_map(*args: Any, **kwargs: Any) -> torch.Tensor:
        # every mode off, the tracker too: the real map's making is no allocation of the step (bitsandbytes caches
        # it, so only a first simulation in a process would have counted it, and kept it counted)
        with unset_fake_temporarily() as fake_mode, _disable_current_modes():
            real = original(*args, **kwargs)
        if fake_mode is None:
            return real
        return torch.empty(real.shape, dtype=real.dtype)

    bnb_functional.create_dynamic_map = create_dynamic_map
    try:
        yield
    finally:
        bnb_functional.create_dynamic_map = original
