"""The plan's vocabulary: what can be chosen for a unit, and the Plan a planning run returns.

A `Choice` is one value of each choice axis (`axes`: checkpoint mode, precision, placement). A `Plan` is everything a person (or the
rewrite stage) needs, in parts by concern: what was asked, the model and device, one decision per unit, the predicted peaks, breakdown
and step times, and how the search ended. `Plan.to_dict()` is the JSON schema: only plain numbers, strings, lists and dicts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from autoplan.axes.checkpoint import CHECKPOINT, Mode, checkpointed
from autoplan.axes.placement import PLACEMENT, HostMemory, Placement, check_offloadable
from autoplan.axes.precision import PRECISION, Precision
from autoplan.errors import OptionError
from autoplan.mesh import Mesh
from autoplan.units import Unit
from autoplan.vocabulary.fingerprint import Fingerprint

PhaseKind = Literal["fwd", "bwd", "step"]
PhasePosition = Literal["start", "in", "after", "optimizer", "zero_grad"]


@dataclass(frozen=True)
class Phase:
    """One moment of a training step, as the timeline splits it at unit boundaries.

    kind: forward, backward, or the optimizer's step. position: "in" a unit (its forward or
    backward), "after" a unit (the rest of the model between it and the next), at the "start" of
    forward or backward (before the first unit runs), or, for kind "step", "optimizer" (its step)
    or "zero_grad". `str(phase)` is the label reports print: "fwd:layers.3", "bwd:after layers.3",
    "fwd:start", "optimizer".
    """

    kind: PhaseKind
    unit: str | None = None  # the unit it is in or after; None at a start and in the step
    position: PhasePosition = "in"

    @property
    def running_unit(self) -> str | None:
        """The unit whose own forward or backward this is; None for the rest of the model."""
        return self.unit if self.position == "in" else None

    @property
    def in_rest_of_forward(self) -> bool:
        return self.kind == "fwd" and self.position in ("start", "after")

    def __str__(self) -> str:
        if self.kind == "step":
            return self.position
        if self.position == "start":
            return f"{self.kind}:start"
        if self.position == "after":
            return f"{self.kind}:after {self.unit}"
        return f"{self.kind}:{self.unit}"


FORWARD_START = Phase("fwd", None, "start")
BACKWARD_START = Phase("bwd", None, "start")
OPTIMIZER_STEP = Phase("step", None, "optimizer")
ZERO_GRAD = Phase("step", None, "zero_grad")


@functools.total_ordering  # by _order: <=, >, >= from < and the dataclass's ==
@dataclass(frozen=True)
class Choice:
    """How one unit runs: which activations it keeps for backward, and in which precision.

    `saves` names what a selective unit keeps, op by op: occurrences of aten ops within one
    forward of the unit, "aten.mm#0" for its first matmul, "aten.mm#3" for its fourth (a point
    of the unit's menu, see `profile.menu`); everything else is recomputed. None is the fixed
    rule: keep every matmul/conv/attention output.
    """

    mode: Mode = "keep"  # keep: save all; selective: save some op outputs (see `saves`); full: save inputs only
    precision: Precision = "fp32"  # fp32, or the device's autocast dtype
    saves: tuple[str, ...] | None = None  # selective only: the op occurrences it keeps; None: matmul/attention outputs
    placement: Placement = "device"  # host: what it saves for backward waits in pinned host memory (axes.placement)

    def __post_init__(self) -> None:
        CHECKPOINT.check(self.mode)
        PRECISION.check(self.precision)
        if self.saves is not None:
            if self.mode != "selective":
                raise OptionError(f"only selective mode names the ops it saves; got mode {self.mode!r} with saves")
            object.__setattr__(self, "saves", tuple(self.saves))
        PLACEMENT.check(self.placement)
        check_offloadable(self.mode, self.placement)

    @property
    def checkpointed(self) -> bool:
        return checkpointed(self.mode)

    @property
    def offloaded(self) -> bool:
        return self.placement == "host"

    def _order(self) -> tuple:
        # None (the fixed rule) sorts before any menu point; menu points by what they save
        return (self.mode, self.precision, self.saves is not None, self.saves or (), self.placement)

    @property
    def rewriting(self) -> int:
        """How much this choice changes the unit's run, every axis together (0: as written): what breaks ties."""
        return CHECKPOINT.rewriting(self.mode) + PRECISION.rewriting(self.precision) + PLACEMENT.rewriting(self.placement)

    def __lt__(self, other: Choice) -> bool:
        return self._order() < other._order()

    def __str__(self) -> str:
        mode = self.mode if self.saves is None else f"selective[{len(self.saves)} saved]"
        return f"{mode}/{self.precision}" + ("/host" if self.offloaded else "")


@dataclass(frozen=True)
class UnitDecision:
    """The plan's decision for one unit, with what it costs."""

    unit: Unit  # e.g. the module "transformer.h.3"; `name` is its name (patterns, JSON, reports)
    choice: Choice
    saved_bytes: int  # bytes this unit keeps alive from its forward until its backward
    recompute_flops: int  # extra FLOPs its backward spends recomputing the forward
    step_time_s: float  # its forward + backward (+ recompute) time under this choice
    policy: str = ""  # a menu point's policy op by op, by submodule: what it saves and what it recomputes
    policy_summary: str = ""  # the same in a person's words, by kind of op ("keeps the outputs of matmuls; recomputes norms")
    members: tuple[str, ...] = ()  # a segment (consecutive units checkpointed as one region): its units, in order
    host_bytes: int = 0  # offloaded: what it keeps in pinned host memory from its forward until its backward
    transfer_s: float = 0.0  # offloaded: its device-to-host and host-to-device copies at the host link's rate
    exposed_transfer_s: float = 0.0  # the part of transfer_s its own compute does not hide (in step_time_s)

    @property
    def name(self) -> str:
        return self.unit.name


CPU_PRECISION_NOTE = "precision: "  # how solve.assemble begins its note on a CPU plan's bf16 units (said by the headline)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Where the bytes are at the moment of the peak."""

    parameters: int  # parameters and buffers
    gradients: int  # gradients already produced at that moment
    optimizer: int  # optimizer state (AdamW: two fp32 tensors per trainable parameter)
    activations: int  # tensors saved for backward and live inputs/outputs at the start of that phase
    transient: int  # what the running op sequence allocates on top, up to the peak
    workspaces: int = 0  # what cuBLAS holds on a CUDA target from the first matmul on
    loop_held: int = 0  # what the loop keeps on the device beside the model: more micro-batches, frozen modules, tensors

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.activations + self.transient + self.workspaces
                + self.loop_held)


@dataclass(frozen=True)
class ShardedPeak:
    """Rank 0's peak under FSDP2 on `world_size` ranks, each training its own batch with the same choices."""

    world_size: int
    phase: Phase  # the moment of the step where this rank peaks
    parameters: int  # this rank's shards of the parameters (1/N, padded), and the buffers
    gradients: int  # gradients alive at that moment: shards of reduced units, the root's still unsharded
    optimizer: int  # this rank's shard of the optimizer state (1/N)
    gathered_parameters: int  # unsharded parameters: the root, the running unit and the prefetched one
    communication_buffers: int  # FSDP's flat all-gather outputs / reduce-scatter inputs alive then
    activations: int  # everything else: batch-dependent bytes, not sharded (optimizer temporaries in "step", 1/N)

    @property
    def total(self) -> int:
        return (
            self.parameters + self.gradients + self.optimizer
            + self.gathered_parameters + self.communication_buffers + self.activations
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"phase": str(self.phase), "total": self.total}


@dataclass(frozen=True)
class WorldSizePoint:
    """One point of the per-rank peak against the number of GPUs."""

    world_size: int
    lowest_peak_bytes: int  # per rank, with the choices that keep least (everything turned on)
    no_plan_peak_bytes: int  # per rank, every unit keep/fp32
    fits: bool  # lowest_peak_bytes within the usable budget


@dataclass(frozen=True)
class OutsideUnits:
    """What a plan decides for the model outside its units, which every rewrite of it applies."""

    precision: Precision = "fp32"  # everything outside the units; low: autocast around the whole forward
    fused_loss: bool = False  # the output head's cross-entropy fused (autoplan.planned.loss_head)


class TrainingLoopLike(Protocol):
    """The training loop a plan's peak is for: an `autoplan.TrainingLoop` (`autoplan.inputs.loop`, a frozen
    dataclass). The vocabulary imports no stage, so the plan names it by what is read of it here."""
    __dataclass_fields__: ClassVar[dict[str, Any]]  # to_dict writes its fields; verify and the simulation read them
    def describe(self, optimizer: str = "the") -> str: ...  # the report's line, "outputs kept through backward, ..."


@dataclass(frozen=True)
class Request:
    """What was asked: the budget and what it leaves, the optimizer, the devices, the training loop, offload."""
    budget_bytes: int  # the budget as given
    usable_bytes: int  # budget minus the reserve (CUDA context, fragmentation)
    optimizer: str  # the optimizer whose state was counted
    mesh: Mesh = Mesh()  # the devices the plan is for; on more than one every byte of the plan is per rank (FSDP2, tensor parallel)
    loop: TrainingLoopLike | None = None  # the training loop the peak was predicted for
    host: HostMemory | None = None  # offload allowed: the host link and the pinned host memory the plan may use; None: off
    arguments: tuple[tuple[str, Any], ...] = ()  # plan()'s arguments that shaped it, as given (budget first); None: a caller's object
    context_bytes: int = 0  # the reserve's part that is the CUDA context (the rest: fragmentation allowance); 0 on a CPU
    context_source: str = ""  # where its figure comes from (inputs.cuda_context): measured, estimated, given

    @property
    def world_size(self) -> int:  # devices in the mesh (the `world_size` option)
        return self.mesh.size

    @property
    def offload(self) -> bool:  # units were allowed to hold their saved tensors in pinned host memory
        return self.host is not None

    @property
    def host_budget_bytes(self) -> int:  # with offload: the pinned host memory the plan may use (0 without)
        return self.host.budget_bytes if self.host is not None else 0


@dataclass(frozen=True)
class PlannedModel:
    """The model the plan is for, as it was traced."""
    name: str  # the model's class name
    trace_method: str  # "symbolic_trace", "export", "hooks", or "none" when units were named and tracing failed
    parameter_count: int = 0  # trainable and frozen parameters, tied weights once
    state_bytes: int = 0  # parameters + gradients + optimizer state on one GPU, before sharding
    fingerprint: Fingerprint | None = None  # the model and batch it was made for; None (built by hand): apply checks nothing
    batch_values: tuple[str, ...] = ()  # batch inputs whose values the forward read (image grids, labels): planned for those values
    random_control_flow: bool = False  # the forward decides on random draws (LayerDrop): planned at the worst case
    moe_routing: str = ""  # mixture-of-experts routing assumed: "worst case", "capacity 1.25", "any" (shapes do not depend on it), "" (none)


@dataclass(frozen=True)
class DeviceTarget:
    """The device planned for and what its precision asks of the training loop."""
    device: str  # the device profile planned for, e.g. "h100-80gb"
    low_precision: Precision  # the low precision a unit uses on this device ("auto" picks it: `axes.precision.low_precision`)
    needs_grad_scaler: bool = False  # fp16 units need torch.amp.GradScaler in the training loop


@dataclass(frozen=True)
class Decisions:
    """What the plan decided: one decision per unit, and for the model outside them."""

    units: tuple[UnitDecision, ...]  # in execution order
    rest_precision: Precision = "fp32"  # everything outside the units (autocast around the forward if low)
    fused_loss: bool = False  # the output head's cross-entropy is fused with it (autoplan.planned.loss_head)
    fused_logits: str = ""  # with fused_loss: the logits it fuses, "4096×32000 logits"

    def __post_init__(self) -> None:
        if self.fused_logits and not self.fused_loss:
            raise OptionError(f"fused_logits {self.fused_logits!r} names the logits of a fused loss head, but fused_loss is False")

    @property
    def outside_units(self) -> OutsideUnits:
        return OutsideUnits(self.rest_precision, self.fused_loss)

    @property
    def transfer_s(self) -> float:  # the offloaded units' copies over the host link, both ways (0 without offload)
        return sum(unit.transfer_s for unit in self.units)

    @property
    def exposed_transfer_s(self) -> float:  # the part of `transfer_s` their own compute does not hide (in the step time)
        return sum(unit.exposed_transfer_s for unit in self.units)

    def choices(self) -> dict[str, Choice]:
        return {unit.name: unit.choice for unit in self.units}

    def choices_by_unit(self) -> dict[Unit, Choice]:
        """`choices()` keyed by the units themselves: what the planned forwards apply (`planned.forwards`)."""
        return {unit.unit: unit.choice for unit in self.units}

    def unit_choices(self) -> dict[str, Choice]:
        """Per unit, its choice; a segment's units each with the segment's (full: what each does in forward)."""
        return {name: unit.choice for unit in self.units for name in unit.members or (unit.name,)}


@dataclass(frozen=True)
class Prediction:
    """What one training step under the decisions is predicted to hold and take."""
    peak_bytes: int  # the higher of the linear memory model's peak and the simulated step's
    simulated_peak_bytes: int  # peak of one real training step of the rewritten model, under fake tensors
    baseline_peak_bytes: int  # simulated peak with no plan (every unit keep/fp32)
    minimum_peak_bytes: int  # the lowest peak any choice reaches (everything turned on)
    minimum_budget_bytes: int  # the budget that peak needs after the reserve
    breakdown: MemoryBreakdown  # at the predicted peak
    peak_phase: Phase  # the moment of the step where the predicted peak happens
    step_time_s: float  # forward + backward + recompute + optimizer, roofline estimate or measured
    baseline_step_time_s: float  # the same with no plan
    fastest_step_time_s: float  # the fastest choice that ignores memory
    time_source: str  # "roofline" (FLOPs and bytes over device peak rates) or "measured"
    fsdp: ShardedPeak | None = None  # with world_size > 1: the predicted per-rank peak in FSDP's terms
    world_size_curve: tuple[WorldSizePoint, ...] = ()  # per-rank peak against N (world_size="auto" searched it)
    host_peak_bytes: int = 0  # what the offloaded units hold in host memory at once (before the first backward)
    simulated_host_peak_bytes: int = 0  # the same, from the whole-step simulation
    # one GPU: what torch's caching allocator is predicted to hold reserved (max_memory_reserved) in steady state,
    # segments whose free space the step could not use included (instruments.caching_allocator); 0: not predicted
    reserved_peak_bytes: int = 0
    # one GPU: the smallest memory limit the step runs under, giving cached segments back at it (caching_allocator); 0: not predicted
    least_limit_bytes: int = 0


@dataclass(frozen=True)
class Outcome:
    """How the search ended."""
    feasible: bool  # the simulated peak of one training step fits the usable budget
    solver_status: str  # pulp's status of the final solve, e.g. "Optimal"
    solve_time_s: float  # wall time spent in the ILP solver, all re-solves included
    resolves: int = 0  # how often verification tightened the budget and solved again
    # "simulation": solved and checked by a simulated step; "state count": the states alone were over the budget,
    # counted without simulating (solve.states_bound): no unit decisions, the peak a lower bound
    decided_by: str = "simulation"

    @property
    def counted_only(self) -> bool:
        return self.decided_by != "simulation"


@dataclass(frozen=True)
class Plan:
    """What autoplan decided for one model, budget and device, and why it believes it fits: `request` (what
    was asked), `model` (what was traced), `target` (the device), `decisions` (per unit, and outside the
    units), `prediction` (peaks, breakdown, times) and `outcome` (feasible, the solver). `feasible`,
    `units` and `predicted_peak_bytes` read what most callers want directly."""

    request: Request
    model: PlannedModel
    target: DeviceTarget
    decisions: Decisions
    prediction: Prediction
    outcome: Outcome
    notes: tuple[str, ...] = field(default=())  # anything the person should know about this plan

    @property
    def feasible(self) -> bool:
        return self.outcome.feasible

    @property
    def units(self) -> tuple[UnitDecision, ...]:
        return self.decisions.units

    @property
    def predicted_peak_bytes(self) -> int:
        return self.prediction.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """The JSON schema (docs/api.md): one flat object, the parts' fields under their documented keys."""
        asked, model, target, decisions, predicted, outcome = (self.request, self.model, self.target, self.decisions, self.prediction, self.outcome)
        return {
            "model_name": model.name, "device": target.device, "low_precision": target.low_precision, "rest_precision": decisions.rest_precision,
            "fused_loss": decisions.fused_loss, "fused_loss_logits": decisions.fused_logits, "needs_grad_scaler": target.needs_grad_scaler,
            "optimizer": asked.optimizer, "feasible": outcome.feasible, "budget_bytes": asked.budget_bytes, "usable_bytes": asked.usable_bytes,
            "context_bytes": asked.context_bytes, "context_source": asked.context_source,
            "predicted_peak_bytes": predicted.peak_bytes, "simulated_peak_bytes": predicted.simulated_peak_bytes,
            "baseline_peak_bytes": predicted.baseline_peak_bytes, "minimum_peak_bytes": predicted.minimum_peak_bytes,
            "minimum_budget_bytes": predicted.minimum_budget_bytes, "predicted_step_time_s": predicted.step_time_s,
            "baseline_step_time_s": predicted.baseline_step_time_s, "fastest_step_time_s": predicted.fastest_step_time_s,
            "time_source": predicted.time_source, "breakdown": dataclasses.asdict(predicted.breakdown) | {"total": predicted.breakdown.total},
            "peak_phase": str(predicted.peak_phase), "units": [_unit_dict(unit) for unit in decisions.units],
            "solver_status": outcome.solver_status, "solve_time_s": outcome.solve_time_s, "resolves": outcome.resolves,
            "decided_by": outcome.decided_by, "trace_method": model.trace_method, "notes": list(self.notes), "world_size": asked.world_size,
            "reshard_after_forward": asked.mesh.reshard_as_given, "fsdp_mixed_precision": asked.mesh.param_dtype,
            "tensor_parallel": asked.mesh.tensor_parallel, "tensor_parallel_layout": [list(pair) for pair in asked.mesh.tp_layout],
            "sequence_parallel": asked.mesh.sequence_parallel, "fsdp": None if predicted.fsdp is None else predicted.fsdp.to_dict(),
            "parameter_count": model.parameter_count, "state_bytes": model.state_bytes, "world_size_curve": [dataclasses.asdict(point) for point in predicted.world_size_curve],
            "loop": None if asked.loop is None else dataclasses.asdict(asked.loop), "moe_routing": model.moe_routing,
            "request": dict(asked.arguments), "offload": asked.offload, "host_budget_bytes": asked.host_budget_bytes,
            "host_peak_bytes": predicted.host_peak_bytes, "simulated_host_peak_bytes": predicted.simulated_host_peak_bytes,
            "reserved_peak_bytes": predicted.reserved_peak_bytes, "least_limit_bytes": predicted.least_limit_bytes,
            "fingerprint": None if model.fingerprint is None else model.fingerprint.to_dict(),
            "batch_values": list(model.batch_values), "random_control_flow": model.random_control_flow,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _unit_dict(unit: UnitDecision) -> dict[str, Any]:
    """A unit's decision in the JSON schema: its choice's fields flat, then its costs, then a segment's members."""
    choice = unit.choice
    costs = {key: value for key, value in dataclasses.asdict(unit).items() if key not in ("unit", "choice", "members")}
    return {"name": unit.name, "mode": choice.mode, "precision": choice.precision, "saves": None if choice.saves is None else list(choice.saves),
            "placement": choice.placement} | costs | {"members": list(unit.members)}  # members: a segment's units, empty for one on its own

