"""The choice axes: a room per axis of a unit's `Choice`, each behind `ChoiceAxis`.

- `axes.checkpoint`: keep, selective, full: what a unit saves for backward (torch.utils.checkpoint);
- `axes.precision`: fp32, bf16, fp16: what its ops compute in (one file per precision in `precisions/`);
- `axes.placement`: device, host: where what it saves waits for its backward (saved-tensor hooks).

Each owns its values' names and their validation, what a device needs to run them, how a unit runs
under one, how that is priced and how the report words it. The plan's vocabulary (`Choice`) and every
stage ask the axis; none spells an axis's values out again.
"""

from __future__ import annotations

from typing import Mapping, Protocol


class DeviceLike(Protocol):
    """What an axis reads of a device profile (`inputs.devices.Device`, a later stage) to say whether it runs a value."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...  # "cuda" or "cpu"

    @property
    def peak_flops(self) -> Mapping[str, float]: ...  # FLOP/s by precision name: a precision the datasheet rates is one the card has

    @property
    def compute_capability(self) -> tuple[int, int] | None: ...

    @property
    def host_bandwidth(self) -> float: ...  # bytes per second each way over the host link; 0: none


class ChoiceAxis(Protocol):
    """One axis of a unit's choice: the small interface every axis module offers (`CHECKPOINT`, `PRECISION`, `PLACEMENT`)."""

    field: str  # the `Choice` field it sets, and the report's column: "mode", "precision", "placement"

    def values(self) -> tuple[str, ...]:
        """Every value, the one that rewrites least first."""
        ...

    def check(self, value: object) -> str:
        """`value` when it is one of `values()`; else an OptionError that lists them."""
        ...

    def unsupported(self, value: str, device: DeviceLike) -> str:
        """Why `device` cannot run `value` ("" when it can)."""
        ...

    def rewriting(self, value: str) -> int:
        """How much `value` changes the unit's run (0: as written): what breaks ties between equally fast choices."""
        ...

    def words(self, value: str) -> str:
        """The report's words for `value` in the units table."""
        ...
