"""What the solve stage is asked, as one value: `SolveRequest`.

The Planner makes one per budget and level of units, from the budget and the checked options; the
search, the program, the world-size search and the Plan's assembly each read what they need of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from autoplan.axes.placement import HostMemory
from autoplan.inputs.budget import Budget
from autoplan.mesh import Mesh
from autoplan.plan import Choice


@dataclass(frozen=True)
class SolveRequest:
    """The budget to fit and the rules of the search."""

    budget: Budget  # what the plan must fit: `usable_bytes`, the budget less its reserve
    pins: Mapping[str, tuple[Choice, ...]] | None = None  # per unit, the choices the person allows (None: any measured one)
    time_limit_s: float = 10.0  # per solve
    mesh: Mesh = Mesh()  # the devices the plan is for: one, or FSDP's ranks (every byte then per rank)
    fewest_ranks: bool = False  # world_size="auto": search the mesh's FSDP dimension for the fewest ranks that fit
    host: HostMemory | None = None  # offload allowed, within this pinned host memory; None: every saved tensor on the device
    segments: bool = True  # runs of consecutive units may be checkpointed as one region (one device only)

    @property
    def usable_bytes(self) -> int:
        return self.budget.usable_bytes
