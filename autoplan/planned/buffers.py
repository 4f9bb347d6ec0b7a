"""Buffers a recomputed unit writes in its forward are written once per step, and recomputed from what they were.

A forward may update its module's buffers in place: BatchNorm's running statistics and its
`num_batches_tracked`, a call counter (`self.calls += 1`), an exponential moving average
(`self.ema.mul_(0.9).add_(...)`). Recomputing such a unit in backward would apply the update a second
time, and would compute its outputs from the already-updated values, so that the recomputed
activations, and the gradients, differ from the forward's.

`BufferWrites` keeps a unit's buffers as if it ran once. Before each forward that may be recomputed it
copies the buffers the unit writes (which ones, it learns on the unit's first forward, when it copies
them all once: those whose version counter moved); the recomputation then runs on those copies, the
values the forward saw, and its writes land in them, which are dropped after: the module's own buffers
end the step updated once. The copies are made outside the checkpointed function, so they are
ordinary tensors of the step (the simulation counts them as the real step holds them) and selective
checkpointing sees no extra op when it replays the forward.

A BatchNorm (or InstanceNorm) in training is known, not copied: its outputs do not read its running
statistics, so its recomputation runs with momentum 0 (the kernel then writes each statistic back
unchanged) and its `num_batches_tracked` is stepped back after. Nothing is held from forward to
backward for it, as nothing is when a person checkpoints it by hand.

Not covered: a Python attribute that is not a registered buffer (`self.calls: int`), a buffer that
the first forward leaves alone and a later one writes, and a native kernel other than BatchNorm's
that writes a buffer without moving its version counter.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, cast

import torch
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import _disable_current_modes


@dataclass
class BufferSnapshot:
    """One forward's copies of the buffers its unit writes, by (module, buffer name); versions to learn which."""

    copies: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    versions: dict[tuple[int, str], int] = field(default_factory=dict)


class BufferWrites:
    """The buffers of `module` (and its submodules) that its forward writes, kept as if it ran once a step."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.owners = {id(owner): owner for owner in module.modules()}
        self.paths = {id(owner): path for path, owner in module.named_modules()}
        self.written: tuple[tuple[int, str], ...] | None = None  # None until the first forward has shown which

    def written_names(self) -> tuple[str, ...]:
        """The buffers the forward wrote, by their names within the module ("norm.running_mean")."""
        return tuple(".".join(filter(None, (self.paths[key], name))) for key, name in self.written or ())

    def _buffers(self, keys=None) -> dict[tuple[int, str], torch.Tensor]:
        found = {(key, name): buffer for key, owner in self.owners.items() for name, buffer in owner._buffers.items()
                 if buffer is not None}
        return found if keys is None else {key: found[key] for key in keys if key in found}

    def _running_statistics(self) -> set[tuple[int, str]]:
        """What a BatchNorm (or InstanceNorm) in training updates: its kernel writes them without bumping their
        version counters, so they are known by the module, not seen."""
        return {(key, name) for key, owner in self.owners.items()
                if isinstance(owner, _NormBase) and owner.training and owner.track_running_stats
                for name in ("running_mean", "running_var", "num_batches_tracked")}

    def before_forward(self) -> BufferSnapshot | None:
        """Copy what this forward may write; None when it writes nothing (known from an earlier forward)."""
        if self.written == ():
            return None
        known = self._running_statistics()
        buffers = self._buffers(None if self.written is None else [key for key in self.written if key not in known])
        with torch.no_grad():
            return BufferSnapshot({key: buffer.detach().clone() for key, buffer in buffers.items()},
                                  {key: buffer._version for key, buffer in buffers.items()})

    def after_forward(self, snapshot: BufferSnapshot | None) -> None:
        """On the first forward, learn which buffers it wrote, and keep only their copies."""
        if snapshot is None or self.written is not None:
            return
        buffers = self._buffers(snapshot.versions)
        # not by value: the simulation's buffers are fake tensors, and both must copy the same buffers
        self.written = tuple(key for key, buffer in buffers.items()
                             if buffer._version != snapshot.versions[key] or key in self._running_statistics())
        for key in set(snapshot.copies) - (set(self.written) - self._running_statistics()):
            del snapshot.copies[key]

    @contextlib.contextmanager
    def recomputing(self, snapshot: BufferSnapshot | None) -> Iterator[None]:
        """Run the recomputation on the forward's copies, BatchNorms with momentum 0; the module's buffers are
        left as they are."""
        if snapshot is None:
            yield
            return
        norms = [cast(_NormBase, self.owners[key]) for key, name in self.written or () if name == "num_batches_tracked"
                 and (key, name) in self._running_statistics()]
        swapped: dict[tuple[int, str], torch.Tensor | None] = {}
        momenta = [norm.momentum for norm in norms]
        for (key, name), copy in snapshot.copies.items():
            owner = self.owners[key]
            swapped[(key, name)] = owner._buffers[name]
            owner._buffers[name] = copy
        for norm in norms:
            norm.momentum = 0.0  # None (a cumulative average) would read num_batches_tracked: 0 writes nothing either
        try:
            yield
        finally:
            for (key, name), buffer in swapped.items():
                self.owners[key]._buffers[name] = buffer
            snapshot.copies.clear()  # a recomputation runs once; the copies go now, not with the graph
            for norm, momentum in zip(norms, momenta):
                norm.momentum = momentum
                # outside every mode: selective checkpointing replays only the forward's ops, and this allocates nothing
                with _disable_current_modes(), torch.no_grad():
                    cast(torch.Tensor, norm.num_batches_tracked).sub_(1)


def has_buffers(module: torch.nn.Module) -> bool:
    return any(True for _ in module.buffers())
