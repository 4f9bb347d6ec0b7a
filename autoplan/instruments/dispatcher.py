"""A Python kernel over one of ATen's composite ops, while a simulation runs: how a GPU target's kernels stand in.

A composite op (`scaled_dot_product_attention`, `dropout`) decomposes above the fake-tensor and tracker
modes, by its CPU rules on CPU tensors; registering a kernel of our own for it in torch's dispatcher makes
every call, nested ones and checkpoint recomputations included, take the card's path instead. Removed on
exit: the op is as it was. Process-wide for that time: plan one model at a time per process.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator

import torch


@contextlib.contextmanager
def composite_overridden(op: str, kernel: Callable) -> Iterator[None]:
    """`aten::<op>` runs `kernel` while entered."""
    with warnings.catch_warnings():  # torch warns that a kernel is overridden: that is the point
        warnings.simplefilter("ignore")
        library = torch.library.Library("aten", "IMPL")
        library.impl(op, kernel, "CompositeImplicitAutograd")
    try:
        yield
    finally:
        library._destroy()
