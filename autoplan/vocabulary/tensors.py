"""Tensors and their bytes: the one flattening helper, and storage sizes as the CUDA allocator rounds them."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten

ALLOCATION_GRANULE = 512  # the CUDA caching allocator rounds every block up to this many bytes
# questions about a tensor, not ops on its data: no memory, no time, no read. A fake tensor asks its mode for
# its device (prim.device), so half of a simulated step's dispatches are these (benchmarks/instruments.py)
METADATA_OPS = frozenset((torch.ops.prim.device.default, torch.ops.prim.layout.default))
DEVICE_ASK = torch.ops.prim.device.default


def fake_device_answer(args: tuple) -> torch.device | None:
    """prim.device of one fake tensor, answered as FakeTensorMode answers it (torch's `_device_handler`: the device
    it stands for, meta inside a kernel); None for anything else. The modes above the fake mode answer it here
    instead of passing it down: it is most of the dispatches a simulation sees (benchmarks/instruments.py: ops
    against ops on data)."""
    if len(args) != 1 or type(args[0]) is not FakeTensor:
        return None
    tensor = args[0]
    return torch.device("meta") if tensor.fake_mode.in_kernel_invocation else tensor.fake_device


def rounded_bytes(nbytes: int) -> int:
    return -(-nbytes // ALLOCATION_GRANULE) * ALLOCATION_GRANULE


def storage_bytes(tensor: torch.Tensor) -> int:
    return rounded_bytes(tensor.untyped_storage().nbytes())


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[id(storage)] = rounded_bytes(storage.nbytes())
    return sum(seen.values())


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a pytree (args, kwargs, a model's output), in flattening order.

    An output that is a plain object (a dataclass transformers does not register as a pytree) is
    read through its attributes.
    """
    found: list[torch.Tensor] = []
    if _collect_plain(tree, found):
        return found
    if not isinstance(tree, (torch.Tensor, dict, list, tuple)) and hasattr(tree, "__dict__"):
        tree = dict(vars(tree))
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


# leaves that hold no tensor, as an op's arguments are made of
_PLAIN_LEAVES = (int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)


def _collect_plain(tree: Any, found: list[torch.Tensor]) -> bool:
    """The tensors of a tree of plain tuples, lists and dicts, appended to `found` in pytree's order; False (and
    `found` to be discarded) at anything else, which `tree_flatten` then reads. Every op the tracker sees comes
    here with its arguments: pytree's generic walk was a tenth of a plan's time."""
    kind = type(tree)
    if kind is tuple or kind is list or kind is dict:
        for item in tree.values() if kind is dict else tree:  # loops, not all(...): this runs for every op
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif not _collect_plain(item, found):
                return False
        return True
    if isinstance(tree, torch.Tensor):
        found.append(tree)
        return True
    return isinstance(tree, _PLAIN_LEAVES)
