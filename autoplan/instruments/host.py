"""Host memory and the host link, as the live-bytes tracker sees them.

Offloaded units (`axes.placement`) copy what they save into pinned host memory and back. When a
GPU step is simulated on the CPU every tensor is a CPU tensor, so the tracker cannot tell host
copies from device tensors by their device: the offload hooks say so instead, by allocating their
host copies inside `on_host()`. The tracker counts what is made there as host bytes, apart from the
device's, and charges no device time for it; `over_the_link()` marks the copies back to the device
(device bytes, no device time: the copy engine moves them while the compute stream runs).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_state = threading.local()


@contextlib.contextmanager
def _made_where(where: str) -> Iterator[None]:
    previous = getattr(_state, "where", None)
    _state.where = where
    try:
        yield
    finally:
        _state.where = previous


HOST_ALLOCATIONS = "autoplan.host_allocations"  # how a profile of a real step names them (verify.allocator counts them apart)


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Tensors made in here are host memory (pinned copies of saved activations)."""
    # a record of torch's profiler (no dispatched op), so that a count of the allocator's blocks can tell these
    # apart too: on a CPU both are the CPU allocator's, on a GPU the pinned ones are not the device's
    with _made_where("host"), torch._C._profiler._RecordFunctionFast(HOST_ALLOCATIONS):
        yield


def over_the_link() -> contextlib.AbstractContextManager[None]:
    """Tensors made in here are device memory filled by a host-to-device copy."""
    return _made_where("link")


def allocating_on_host() -> bool:
    return getattr(_state, "where", None) == "host"


def moving_over_the_link() -> bool:
    """Inside `on_host` or `over_the_link`: the ops are copies of the host link, not device compute."""
    return getattr(_state, "where", None) is not None
