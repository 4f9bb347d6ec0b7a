"""Verify under fake tensors: simulate one whole training step of the rewritten model.

The linear memory model (`memory.model`) adds up per-unit measurements; this checks its sum
against a simulation of the whole rewritten model (every op, every tensor, the optimizer step),
so a plan is called feasible only when that simulation fits. `verify.real` does the same with
real steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from autoplan.inputs.devices import Device
from autoplan.instruments.caching_allocator import expandable_from_environment, least_limit_bytes, steady_reserved_bytes
from autoplan.inputs.loop import TrainingLoop
from autoplan.memory.sharded import on_rank
from autoplan.plan import Choice, Phase, Precision
from autoplan.profile.simulation import run_timeline
from autoplan.profile.stack import shortened_step
from autoplan.profile.timeline import Timeline
from autoplan.units import Unit
from autoplan.trace.tracer import Traced


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int  # peak live bytes of step 2
    peak_phase: Phase  # the phase where it happened
    step_time_s: float  # roofline time of the whole step
    host_peak_bytes: int = 0  # pinned host memory the offloaded units hold at most (not device memory)
    allocation_log: tuple = field(default=(), compare=False, repr=False)  # one GPU: the step's allocations in order

    @property
    def reserved_bytes(self) -> int:
        """One GPU: what the caching allocator holds reserved in steady state (0: not predicted). Replayed on
        demand: the search simulates many choices and wants the figure for the chosen ones only."""
        if not self.allocation_log:
            return 0
        return steady_reserved_bytes(self.allocation_log, expandable_segments=expandable_from_environment())

    @property
    def least_limit_bytes(self) -> int:
        """One GPU: the smallest memory limit the steps run under, the allocator giving its cache back (0: not predicted)."""
        if not self.allocation_log:
            return 0
        return least_limit_bytes(self.allocation_log, expandable_segments=expandable_from_environment())


def simulate_plan(
    traced: Traced,
    choices: Mapping[Unit, Choice],
    *,
    device: Device,
    optimizer: str | torch.optim.Optimizer,
    rest_precision: Precision,
    loss_fn: Callable | None = None,
    rank_offsets: Mapping[Phase, int] | None = None,
    loop: TrainingLoop | None = None,
    fused_loss: bool = False,
    start_extras: Mapping[Phase, int] | None = None,
    shortcut: bool = False,
) -> Simulation:
    """Simulate a training step of `traced.model` rewritten with `choices`.

    rank_offsets: per phase, what FSDP changes on one rank (`memory.sharded.rank_offsets`): the
    simulated activations with FSDP's shards, gathered parameters and buffers, for a per-rank peak.
    loop: the training loop to run (default: the common loop). fused_loss: the loss head fused (planned.loss_head).
    shortcut: a long stack of identical layers is simulated a few layers deep and the whole step solved from those
    (`profile.stack`); only where no allocation log is wanted (a CPU target, or per rank), as it makes none.
    """
    def simulated(dropped: frozenset[str] = frozenset()) -> Timeline:
        return run_timeline(traced, choices, device=device, optimizer=optimizer, rest_precision=rest_precision, loss_fn=loss_fn,
                            loop=loop, fused_loss=fused_loss, dropped=dropped)

    timeline = shortened_step(traced, choices, simulated) if shortcut else None
    return simulation_of(timeline or simulated(), rank_offsets, start_extras)


def simulation_of(timeline: Timeline, rank_offsets: Mapping[Phase, int] | None = None,
                  start_extras: Mapping[Phase, int] | None = None) -> Simulation:
    """The Simulation of a simulated step (`simulate_plan`'s, or a profile's own timeline: the step with every unit
    at its base choice), per rank with `rank_offsets` and `start_extras` (`memory.sharded.phase_offsets`)."""
    offsets, extras = rank_offsets or {}, start_extras or {}

    def bytes_of(sample) -> int:
        return on_rank(sample.peak_bytes, sample.start_bytes, offsets.get(sample.phase, 0), extras.get(sample.phase, 0))

    peak = max(timeline.phases, key=bytes_of)
    log = () if any(offsets.values()) else timeline.allocation_log  # FSDP's gathers and frees are not in the log
    return Simulation(bytes_of(peak), peak.phase, timeline.step_time_s, timeline.host_peak_bytes, log)


def reserved_peak(peak_bytes: int, simulated_peak_bytes: int, simulated_reserved_bytes: int) -> int:
    """The predicted reserved peak: the simulated step's, raised by what the predicted (allocated) peak lies
    above the simulated one (the linear model's sum can be the higher); 0 where none was simulated."""
    if not simulated_reserved_bytes:
        return 0
    return max(peak_bytes, simulated_reserved_bytes + max(0, peak_bytes - simulated_peak_bytes))

