"""Profile stage: what every unit costs, in bytes and time, under every choice it can take.

Two kinds of measurement, both under fake tensors (no real memory, any machine):
- the *timeline*: training step 2 (after an optimizer-only step 1) of a fake twin of the model with
  every unit at its base choice (keep, in the base precision), split into phases at unit boundaries;
- each *unit alone*, called with inputs shaped like the ones it received in the timeline, under
  each choice: the peak of its forward, the bytes it keeps for backward, the peak of its backward
  (recomputation included), and roofline time and FLOPs of both.
Identical units (same class, parameter shapes and input shapes) are measured once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten

from autoplan.errors import OptionTypeError
from autoplan.inputs.devices import Device
from autoplan.inputs.loop import TrainingLoop, check_loop
from autoplan.axes.checkpoint import MODES
from autoplan.axes.placement import HostMemory, measure_host_twins
from autoplan.axes.precision import kind
from autoplan.plan import Choice, Precision
from autoplan.profile.layout import ParamShape, layout_of
from autoplan.profile.menu import DEFAULT_MENU_SIZE, PolicyWords, dominated, measure_or_refuse, menu_points, record_ops
from autoplan.profile.named_policies import named_choices
from autoplan.profile.recorder import TensorSpec, UnitCall, materialize_inputs
from autoplan.profile.simulation import base_timelines, simulation_model
from autoplan.profile.timeline import Timeline
from autoplan.instruments.target import as_the_target_runs
from autoplan.instruments.fake import new_fake_mode
from autoplan.units import Unit
from autoplan.vocabulary.names import unit_module
from autoplan.vocabulary.tensors import tensors_of, unique_storage_bytes
from autoplan.instruments.accumulation import accumulating_adds
from autoplan.instruments.tracker import FusedElementwiseRates, LiveBytesTracker, RooflineRates
from autoplan.training.step_parts import optimizer_name
from autoplan.planned.wrappers import PlannedForward
from autoplan.trace.tracer import Traced


@dataclass(frozen=True)
class UnitCost:
    """One unit under one choice, measured alone."""

    fwd_peak_bytes: int  # peak of its forward above what was live when it began
    held_bytes: int  # what it keeps from forward to backward, beyond its inputs and outputs
    bwd_peak_bytes: int  # peak of its backward (recomputation included) above what was live when it began
    fwd_time_s: float
    bwd_time_s: float  # backward plus recomputation
    fwd_flops: int
    bwd_flops: int
    holds_inputs: tuple[bool, ...] = ()  # per tensor leaf of its inputs: still alive after forward
    holds_outputs: tuple[bool, ...] = ()  # per tensor leaf of its output: saved by itself for backward
    attention_bytes: int = 0  # T×T attention matrices (softmax outputs and same-shaped dropout/views) it saves; keep mode only
    spent_bytes: int = 0  # what its graph still holds after its backward (tensors autograd functions keep as attributes,
    # as bitsandbytes' 8-bit matmul keeps its input): alive until the loop drops the graph, in the next forward
    host_bytes: int = 0  # offloaded: pinned host memory it holds from its forward until its backward
    transfer_s: float = 0.0  # offloaded: both copies over the host link
    exposed_transfer_s: float = 0.0  # the part of transfer_s its own forward and backward do not hide
    written_buffers: tuple[str, ...] = ()  # recomputed: the buffers its forward writes, kept updated once (planned.buffers)

    @property
    def time_s(self) -> float:
        return self.fwd_time_s + self.bwd_time_s + self.exposed_transfer_s


@dataclass(frozen=True)
class UnitProfile:
    unit: Unit
    options: Mapping[Choice, UnitCost]  # every choice this unit may take
    base: Choice  # the choice it had in the timeline
    param_bytes: int = 0  # its parameters (what FSDP gathers to run it), tied weights once
    param_layout: tuple[ParamShape, ...] = ()  # its parameters' shapes, as FSDP shards them
    policies: Mapping[Choice, PolicyWords] = field(default_factory=lambda: MappingProxyType({}))  # its menu points' policies in words (profile.menu)
    selective_refused: str = ""  # why torch's selective checkpointing refused it (keep and full only), "" when it did not

    @property
    def name(self) -> str:
        return self.unit.name

    def delta_held(self, choice: Choice) -> int:
        return self.options[choice].held_bytes - self.options[self.base].held_bytes

    def recompute_flops(self, choice: Choice) -> int:
        kept = self.options.get(Choice("keep", choice.precision))
        return max(0, self.options[choice].bwd_flops - kept.bwd_flops) if kept else 0


@dataclass(frozen=True)
class Profile:
    """What was measured of one model for one device and step: the simulated step (timelines) and every unit
    under every choice it was measured in. What the solver may then choose among is the request's
    (`solve.request.SolveRequest`: pins, segments, offload), not the profile's."""

    model_name: str
    device: Device
    optimizer: str
    rest_precision: Precision  # precision of everything outside the units
    timeline: Timeline  # every unit at its base choice
    reference: Timeline  # no plan at all: every unit keep/fp32, nothing under autocast
    units: tuple[UnitProfile, ...]  # forward order
    trace_method: str
    skip_edges: tuple[tuple[str, str], ...]
    time_source: str = "roofline"
    base_step_time_s: float | None = None  # measured whole step at the base choices (None: the timeline's roofline)
    reference_step_time_s: float | None = None  # measured whole step with no plan
    rest_param_layout: tuple[ParamShape, ...] = ()  # parameters outside the units: FSDP's root group
    buffer_bytes: int = 0  # buffers (FSDP does not shard them)
    routing: str = ""  # how data-dependent expert routing was profiled ("" when the model routes nothing)
    routing_assumed: str = ""  # in a word (Plan.moe_routing): "worst case", "capacity 1.25", "any", ""
    loop: TrainingLoop = TrainingLoop()  # the training loop the timelines simulate
    alternative: Timeline | None = None  # the step with the loss head the other way (fused or as written), where it can be fused
    batch_reads: tuple[str, ...] = ()  # batch inputs whose values the forward read (image grids, labels): planned for those values
    random_reads: int = 0  # values computed from random draws the forward read (LayerDrop): planned at the worst case

    def unit(self, name: str) -> UnitProfile:
        return next(u for u in self.units if u.name == name)


def _signature(module: torch.nn.Module, call: UnitCall) -> tuple:
    leaves, spec = tree_flatten(call.inputs)
    described = tuple(leaf if isinstance(leaf, (TensorSpec, int, float, bool, str, type(None))) else type(leaf) for leaf in leaves)
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers())
    return (type(module).__qualname__, params, buffers, described, str(spec))


def _materialize(spec: TensorSpec) -> torch.Tensor:
    """A fake input like the one recorded; one that needs grad is made by an op, as in the real
    step, so that only the unit's own saved tensors (not autograd's leaf bookkeeping) keep it alive."""
    return spec.materialize().clone() if spec.requires_grad else spec.materialize()


class _OutputGradients(torch.autograd.Function):
    """A root for a unit's backward that hands it fresh output gradients, as the next layer would.

    Gradients we held ourselves would stay alive through the whole backward; made here, autograd
    frees each once the unit has consumed it, as in the real step. The backward phase begins when
    they exist, like a unit's phase in the whole step begins when its output gradient is ready.
    """

    @staticmethod
    def forward(ctx, on_backward: Callable[[], None], shapes: tuple, *outputs: torch.Tensor) -> torch.Tensor:
        ctx.on_backward, ctx.shapes = on_backward, shapes
        # a real root even for a complex unit (a filter on complex signals): backward starts only from a real scalar
        return outputs[0].new_zeros((), dtype=outputs[0].dtype.to_real())

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):
        grads = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes)
        ctx.on_backward()
        return (None, None, *grads)


class _AttentionSaved(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of T×T attention matrices saved for backward: what SDPA/FlashAttention would not keep.

    A saved tensor counts when its last two dims are equal and it has the shape of a saved softmax
    output (the probabilities) or as many elements laid out T×T (dropout's mask and output, the
    view `probs @ v` saves). Each storage counts once.
    """

    def __init__(self) -> None:
        self.saved: list[torch.Tensor] = []
        self.total_bytes = 0
        super().__init__(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() >= 3 and tensor.shape[-1] == tensor.shape[-2] > 1:
            self.saved.append(tensor)
        return tensor

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        softmax = {(t.shape[-1], t.numel()) for t in self.saved if "Softmax" in type(t.grad_fn).__name__}
        self.total_bytes = unique_storage_bytes([t for t in self.saved if (t.shape[-1], t.numel()) in softmax])
        self.saved = []  # hold no tensors: the unit's own references decide what stays alive


def _backward_root(tracker: LiveBytesTracker, needs_grad: list[torch.Tensor]) -> tuple[torch.Tensor | None, int]:
    """The root of a unit's backward (None: no output needs a gradient) and its own bytes. The root and its gradient
    seed are this harness's, not the unit's, so they are made in a phase of their own ("seed"): made in the forward's,
    they raised a keep unit's forward peak (set at its end) by 1,024 B that the whole step never holds."""
    tracker.begin_phase("seed")
    shapes = tuple((t.shape, t.dtype, t.device) for t in needs_grad)
    root = _OutputGradients.apply(lambda: tracker.begin_phase("bwd"), shapes, *needs_grad) if needs_grad else None
    return root, unique_storage_bytes([root]) if root is not None else 0


def _measure_unit(
    module: torch.nn.Module, call: UnitCall, choice: Choice, rest: Precision, device: RooflineRates, fake_mode: FakeTensorMode
) -> UnitCost:
    tracker = LiveBytesTracker(device)
    planned = PlannedForward(module, choice)
    outer = kind(rest).running(module, "cpu")  # fake CPU tensors stand in for the target's
    for param in module.parameters():
        param.grad = None
    with fake_mode, as_the_target_runs(device), tracker:
        args, kwargs = materialize_inputs(call.inputs, _materialize)
        inputs = tensors_of((args, kwargs))
        input_refs = [weakref.ref(t.untyped_storage()) for t in inputs]
        input_storages = {id(t.untyped_storage()) for t in inputs}
        tracker.begin_phase("fwd")
        # Checkpointed units save through torch.utils.checkpoint's own hooks, which hide their
        # tensors from ours; only keep mode shows what the unit's ops save.
        attention = _AttentionSaved() if choice.mode == "keep" else contextlib.nullcontext()
        with outer, attention:
            output = planned(*args, **kwargs)
        written = planned.buffer_writes.written_names() if planned.buffer_writes is not None else ()
        outputs = tensors_of(output)
        new_outputs = [t for t in outputs if id(t.untyped_storage()) not in input_storages]
        held = tracker.live_bytes - tracker.phases()[-1].start_bytes - unique_storage_bytes(new_outputs)
        host_bytes = tracker.host_bytes
        output_refs = [weakref.ref(t.untyped_storage()) for t in outputs]
        needs_grad = [t for t in outputs if t.requires_grad]
        root, root_bytes = _backward_root(tracker, needs_grad)
        # Drop every reference of ours but to inputs the step never frees (the batch, parameters and buffers handed in)
        inputs = [t for t, kept in zip(inputs, call.resident_inputs) if kept]
        del output, outputs, new_outputs, needs_grad, args, kwargs
        holds_inputs = tuple(ref() is not None for ref in input_refs)
        holds_outputs = tuple(ref() is not None for ref in output_refs)
        spent = 0
        if root is None:
            tracker.begin_phase("bwd")
        else:
            with accumulating_adds(tracker, root):
                root.backward()
            after_backward = tracker.live_bytes
            del root
            spent = after_backward - tracker.live_bytes - root_bytes  # what the unit's graph holds, not the root itself
        fwd, _seed, bwd = tracker.phases()[-3:]
    for param in module.parameters():
        param.grad = None
    return UnitCost(
        fwd_peak_bytes=fwd.peak_bytes - fwd.start_bytes,
        held_bytes=held,
        bwd_peak_bytes=bwd.peak_bytes - bwd.start_bytes,
        fwd_time_s=fwd.time_s,
        bwd_time_s=bwd.time_s,
        fwd_flops=fwd.flops,
        bwd_flops=bwd.flops,
        holds_inputs=holds_inputs,
        holds_outputs=holds_outputs,
        attention_bytes=attention.total_bytes if isinstance(attention, _AttentionSaved) else 0,
        spent_bytes=spent,
        host_bytes=host_bytes,
        written_buffers=written,
    )


def _measure_options(module, call: UnitCall, precisions, rest: Precision, device: Device, fake_mode: FakeTensorMode, menu_size: int,
                     host: HostMemory | None = None, named: str = ""):
    """Every choice of one unit measured: the three modes × precisions, their host twins when offload is allowed
    (`axes.placement`), its menu points (policies in words), and a named policy it is pinned to (`named_policies`)."""
    costs, refused = measure_or_refuse(unit_choices(precisions), lambda choice: _measure_unit(module, call, choice, rest, device, fake_mode))
    if host is not None:
        costs |= measure_host_twins(costs, lambda twin: _measure_unit(module, call, twin, rest, device, fake_mode), host.bandwidth)
    points = {}
    for precision in precisions if menu_size > 0 and not refused else ():
        menu = {point.choice: point.policy for point in _menu(module, call, precision, device, fake_mode, menu_size)}
        kept, _ = measure_or_refuse(menu, lambda choice: _measure_unit(module, call, choice, rest, device, fake_mode))
        points.update({choice: (cost, menu[choice]) for choice, cost in kept.items()})  # a point torch refuses is left out
    policies = {}
    measured = list(points.items())
    for index, (choice, (cost, policy)) in enumerate(measured):
        rivals = [c for other, c in costs.items() if other.precision == choice.precision]
        # of two points that measure the same, the first stays
        rivals += [c for later, (other, (c, _)) in enumerate(measured) if other.precision == choice.precision
                   and later != index and (later < index or (c.held_bytes, c.time_s) != (cost.held_bytes, cost.time_s))]
        if not dominated(cost, rivals):  # a point no better than another only slows the solver
            costs[choice] = cost
            policies[choice] = policy
    if named:  # pinned: kept whatever it is worth against the rest
        inputs, measure = functools.partial(materialize_inputs, call.inputs, _materialize), functools.partial(
            _measure_unit, module, call, rest=rest, device=device, fake_mode=fake_mode)
        for choice, (cost, policy) in named_choices(module, call.name, named, precisions, refused, inputs, measure, device, fake_mode).items():
            costs[choice], policies[choice] = cost, policy
    return MappingProxyType(costs), MappingProxyType(policies), refused


def _menu(module, call: UnitCall, precision: Precision, device: Device, fake_mode: FakeTensorMode, size: int):
    """The unit's menu points in `precision`, from one recorded forward with inputs like the timeline's."""
    with fake_mode, as_the_target_runs(device):
        args, kwargs = materialize_inputs(call.inputs, _materialize)
        ops = record_ops(module, args, kwargs, precision, device)
    for param in module.parameters():
        param.grad = None
    return menu_points(ops, precision, size)


def unit_choices(precisions: tuple[Precision, ...]) -> list[Choice]:
    return [Choice(mode, precision) for precision in precisions for mode in MODES]


def _profile_units(model, timeline: Timeline, base, precisions, rest, rates, fake_mode, menu_size, say,
                   host: HostMemory | None = None, named: Mapping[str, str] = MappingProxyType({})) -> list[UnitProfile]:
    """Every unit alone under every choice; identical units (class, parameter and input shapes, named policy) measured once."""
    measured: dict[tuple, tuple[Mapping[Choice, UnitCost], Mapping[Choice, PolicyWords], str]] = {}
    units_by_name = {unit.name: unit for unit in base}
    units = []
    for index, call in enumerate(timeline.unit_calls):
        unit = units_by_name[call.name]
        module = unit_module(model, unit)
        key = (_signature(module, call), named.get(call.name, ""))
        if key not in measured:
            say(f"profiling unit {index + 1}/{len(timeline.unit_calls)}: {call.name}")
            measured[key] = _measure_options(module, call, precisions, rest, rates, fake_mode, menu_size, host, named.get(call.name, ""))
        params = list(module.parameters())
        costs, policies, refused = measured[key]
        units.append(UnitProfile(unit, costs, base[unit], unique_storage_bytes(params), layout_of(params), policies, refused))
    return units


def profile(
    traced: Traced,
    device: Device,
    *,
    optimizer: str | torch.optim.Optimizer = "adamw",
    precisions: tuple[Precision, ...] = ("fp32",),
    rest_precision: Precision = "fp32",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    progress: Callable[[str], None] | None = None,
    menu_size: int = DEFAULT_MENU_SIZE,
    compile: bool = False,
    loop: TrainingLoop | None = None,
    fuse_loss: bool = True,
    host: HostMemory | None = None,
    named: Mapping[str, str] = MappingProxyType({}),
) -> Profile:
    """Measure the timeline and every unit under every choice in `precisions` × checkpoint modes.

    `rest_precision` is what runs outside the units, and each unit's base choice (keep in it).
    `menu_size`: per unit and precision, up to this many selective policies of its own on top of
    keep/selective/full (`profile.menu`); 0 for the three modes only. `compile`: price the units
    as torch.compile runs them (`instruments.tracker.FusedElementwiseRates`: ops without FLOPs cost
    no time), so recomputing elementwise ops is free and the menu saves only matmul/attention outputs.
    `loop` is the training loop the timeline simulates (default: the common loop); a unit alone
    costs the same in any loop. `fuse_loss`: the output head's cross-entropy may be fused;
    `alternative` is then the step the other way, for the solve to plan too (`profile.simulation`).
    `host`: offload allowed: keep and full may also hold their saved tensors in host memory, priced by
    its host link (`axes.placement`). `named`: unit name -> a named checkpoint policy it is pinned to
    (`profile.named_policies`), measured besides the rest.
    """
    loop = check_loop(loop)
    if not isinstance(traced, Traced):
        raise OptionTypeError("profile() takes the Traced result of autoplan.trace.trace(); run trace first")
    rest = rest_precision  # each unit's base: keep in it, or in the one precision forced where that does not run outside (float8)
    base = {unit: Choice("keep", rest if rest in precisions else precisions[0]) for unit in traced.units}
    say = progress or (lambda message: None)
    say("simulating a training step")
    timeline_mode = new_fake_mode(traced.routing, traced.draws)
    rates = FusedElementwiseRates(device) if compile else device  # the whole step too: its time is the units' base
    timelines = base_timelines(traced, base, device=device, optimizer=optimizer, rest_precision=rest, loss_fn=loss_fn,
                               fake_mode=timeline_mode, loop=loop, fuse_loss=fuse_loss, rates=rates)
    fake_mode = new_fake_mode(traced.routing, traced.draws)
    model = simulation_model(traced, fake_mode, {}, "fp32")
    units = _profile_units(model, timelines.timeline, base, precisions, rest, rates, fake_mode, menu_size, say, host, named)
    in_units = {id(p) for unit in units for p in unit_module(model, unit.unit).parameters()}
    return Profile(
        model_name=type(traced.model).__name__, device=device, optimizer=optimizer_name(optimizer), rest_precision=rest,
        timeline=timelines.timeline, reference=timelines.reference, alternative=timelines.alternative, units=tuple(units),
        trace_method=traced.method, skip_edges=traced.skip_edges,
        time_source="roofline, compiled (elementwise fused)" if compile else "roofline",
        rest_param_layout=layout_of(p for p in model.parameters() if id(p) not in in_units),
        buffer_bytes=unique_storage_bytes(list(model.buffers())),
        routing="; ".join(filter(None, (timeline_mode.routing_note(), timeline_mode.unused_capacity_note(traced.routing)))),
        routing_assumed=timeline_mode.routing_assumed(), loop=loop,
        batch_reads=timeline_mode.values.batch_reads(), random_reads=timeline_mode.values.random_reads,
    )


def with_choices(traced: Traced, measured: Profile, extra: Iterable[Choice], *, compile: bool = False) -> Profile:
    """`measured` with `extra` choices measured for every unit as well (identical units once).

    For studies of the plan space (benchmarks/flop_bound.py prices every subset of a unit's
    matmuls); planning itself measures only the menu `profile` builds.
    """
    extra = tuple(extra)
    fake_mode = new_fake_mode(traced.routing, traced.draws)
    model = simulation_model(traced, fake_mode, {}, "fp32")
    rates = FusedElementwiseRates(measured.device) if compile else measured.device
    by_signature: dict[tuple, dict[Choice, UnitCost]] = {}
    units = []
    for call, unit in zip(measured.timeline.unit_calls, measured.units):
        module = unit_module(model, unit.unit)
        key = _signature(module, call)
        if key not in by_signature:
            by_signature[key] = {c: _measure_unit(module, call, c, measured.rest_precision, rates, fake_mode) for c in extra}
        units.append(dataclasses.replace(unit, options=MappingProxyType({**unit.options, **by_signature[key]})))
    return dataclasses.replace(measured, units=tuple(units))
