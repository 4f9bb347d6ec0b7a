from torch.utils._pytree import tree_flatten
from typing import Any
import torch

ALLOCATION_GRANULE = 512  # the CUDA caching allocator rounds every block up to this many bytes



def rounded_bytes(nbytes: int) -> int:
    return -(-nbytes // ALLOCATION_GRANULE) * ALLOCATION_GRANULE



def storage_bytes(tensor: torch.Tensor) -> int:
    return rounded_bytes(tensor.untyped_storage().nbytes())



def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[id(storage)] = rounded_bytes(storage.nbytes())
    return sum(seen.values())


def tensors_of(output: Any) -> list[torch.Tensor]:
    if not isinstance(output, (torch.Tensor, dict, list, tuple)) and hasattr(output, "__dict__"):
        output = dict(vars(output))
    return [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
