"""Parameter shapes as FSDP2 shards them (dim 0, padded to a multiple of the world size), recorded
per unit by the profile so the per-rank memory model needs no model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamShape:
    """One parameter as FSDP2 shards it."""

    rows: int  # size of dim 0, the dim FSDP2 shards
    row_numel: int  # elements per row (1 for a vector)
    itemsize: int  # bytes per element

    @staticmethod
    def of(tensor: torch.Tensor) -> "ParamShape":
        rows = tensor.shape[0] if tensor.dim() else 1
        return ParamShape(rows, tensor.numel() // max(rows, 1), tensor.element_size())

    def shard_bytes(self, ranks: int) -> int:
        return -(-self.rows // ranks) * self.row_numel * self.itemsize


def layout_of(params) -> tuple[ParamShape, ...]:
    """Shapes of the distinct parameters among `params` (tied weights once)."""
    seen: dict[int, ParamShape] = {}
    for param in params:
        seen.setdefault(id(param.untyped_storage()), ParamShape.of(param))
    return tuple(seen.values())
