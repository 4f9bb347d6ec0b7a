"""Profile once, plan at many budgets: `Planner(model, **options).plan(budget)`.

`autoplan.plan(model, budget, **options)` is `Planner(model, **options).plan(budget)`. A Planner checks its
options when made, traces and profiles at its first `plan()`, and keeps what it measured and every step it
simulated; each later `plan()` only solves and simulates a chosen step it has not simulated yet
(benchmarks/sweep.py). A sweep of budgets (step time against memory, a budget between the lowest peak and
no plan) so profiles once. Each `plan(budget)` returns the Plan `autoplan.plan` returns for that budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Mapping

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from typing_extensions import Unpack

from autoplan.axes.precision import choices_for, rest_precision
from autoplan.axes.precisions.float8 import FLOAT8_ON_A_GPU, check_converted, is_float8, check_one_device, check_some_run_in_float8
from autoplan.deciding import decide_loss_head
from autoplan.errors import (
    MissingExtraError, OptionError, PlanMismatchError, ProfileError, RepeatedUnitError, SparseGradientError, TraceError,
)
from autoplan.inputs.batch import training_batch
from autoplan.inputs.budget import make_budget
from autoplan.inputs.devices import DEVICES, Device, get_device
from autoplan.inputs.options import PlanKeywords, PlanOptions, with_options
from autoplan.inputs.settings import SearchSpace, StepOptions, flag, settle
from autoplan.instruments.quantized import int8_layers, settle_first_forward
from autoplan.mesh import FSDP, MAX_RANKS, Mesh
from autoplan.plan import Choice, Plan
from autoplan.profile.profiler import Profile
from autoplan.profile.profiler import profile as profile_units
from autoplan.profile.states import CountedStates, count_states
from autoplan.profile.timing import measure_times
from autoplan.report.reported import ReportedPlan, reported
from autoplan.solve.assemble import best_level
from autoplan.solve.request import SolveRequest
from autoplan.solve.states_bound import every_unit_runs, states_bound_plan, states_over_budget
from autoplan.solve.search import checkpoint_policies, pinned_choices, requested_modes
from autoplan.trace.discovery import UnitLevel, unit_levels
from autoplan.trace.tracer import FAKE_TENSOR_HINT, Traced, trace
from autoplan.training.step_parts import model_device, optimizer_name, parameter_count
from autoplan.inputs.sequence_parallel import SequenceLayout, resolve_sequence_layout
from autoplan.inputs.tensor_parallel import degrees_to_plan, rank_model
from autoplan.solve.degrees import DegreeFit, can_beat, chosen_degree, degrees_note
from autoplan.solve.worlds import fewest_gpus, points_key
from autoplan.vocabulary.names import unit_module
from autoplan.vocabulary.fingerprint import batch_values, describe_tensor, first_difference, fingerprint_of
from autoplan.vocabulary.formatting import first_line, where_in_user_code
from autoplan.vocabulary.sizes import Size


@dataclass(frozen=True)
class ProfiledLevel:
    """One level of units (`trace.discovery.unit_levels`), traced and profiled: all a solve needs but the budget."""

    level: UnitLevel
    traced: Traced
    measured: Profile
    pins: Mapping[str, tuple[Choice, ...]]
    # the whole-step simulations this level's plans ran, kept for the next budget: the same choices simulate the
    # same step (the floor's choices are simulated again at every budget of a sweep otherwise)
    simulated: dict = dataclasses.field(default_factory=dict, compare=False)


@dataclass
class RankSlice:
    """One tensor-parallel degree of the model as a plan sees it: the linears split, the model one rank runs (the model
    itself at degree 1; made when first planned), and its levels, profiled at the first plan() that needs them."""

    degree: int
    layout: tuple[tuple[str, str], ...]
    whole: torch.nn.Module
    sequence: SequenceLayout | None = None  # sequence parallelism's layout, where asked for (a degree > 1)
    levels: list[ProfiledLevel] | None = None
    _model: torch.nn.Module | None = None
    failed: str = ""  # searched (world_size="auto") and its slice would not run: why, and it is not planned again
    tried: int = 0  # levels of units found, those planned (`levels`) and those that could not be

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            self._model = rank_model(self.whole, self.layout, self.degree, self.sequence) if self.layout else self.whole
        return self._model


def _compiled_code_runs_as_written(method):
    """`method` with torch.compile'd code run as written (`torch.compiler.set_stance("force_eager")`, torch 2.6+).

    Planning runs the caller's model under dispatch modes (fake tensors, the tracker). Dynamo, called under
    one, gives up on the frame and marks its code to be skipped for the rest of the process: a torch.compile'd
    model, once planned, trained without compiling (issue 39). Forced eager, Dynamo is not called at all.
    """
    @functools.wraps(method)
    def run(*args, **kwargs):
        set_stance = getattr(torch.compiler, "set_stance", None)
        with set_stance("force_eager") if set_stance is not None else contextlib.nullcontext():
            return method(*args, **kwargs)
    return run


class Planner:
    """The model and every option of `autoplan.plan` but the budget; `plan(budget)` plans for one.

    Options are checked here, before minutes of work. The first `plan()` traces and profiles the model
    (every level of units); each later one solves again from what was measured. A model whose
    parameters change in the meantime (shape, dtype, device, requires_grad) is refused: make a new Planner.
    """

    @_compiled_code_runs_as_written
    @torch.enable_grad()  # a training step is planned: the caller's no_grad (or a factory's) is not the step's
    @with_options
    def __init__(self, model: torch.nn.Module, **options: Unpack[PlanKeywords]) -> None:
        """A Planner of `model` with `options` (those of `autoplan.plan`), each checked now."""
        given = PlanOptions.given(options, "Planner")
        settings = settle(given)
        self._settings, self._options = settings, dataclasses.replace(given, loop=settings.step.loop)  # the loop as checked
        _check_model(model, settings.device)
        check_converted(model, settings.device.kind, settings.device.name, settings.space.precision)
        check_one_device(settings.space.precision, settings.ranks, settings.tensor_parallel)
        requested_modes(settings.space.checkpoint)  # a misspelt mode or policy is said now, not after the profile
        settle_first_forward(model)
        self._model = model
        # what one rank holds and runs, per tensor-parallel degree planned: the model itself, or its slice
        degrees = degrees_to_plan(model, settings.tensor_parallel, settings.tp_layout_given)
        self._slices = [RankSlice(degree, layout, model, resolve_sequence_layout(model, layout) if settings.sequence_parallel and layout else None)
                        for degree, layout in degrees]
        self._batch = training_batch(model, given.example_inputs, given.batch_size, given.seq_len)
        self._fingerprint = fingerprint_of(model, self._batch)  # before planning: what apply and verify check the plan against
        self._parameters = _parameter_states(model)
        self._say = given.progress if given.progress is not None else (lambda message: None)
        self._counted: CountedStates | None = None  # the states, counted at the first plan()
        self._every_unit_runs: bool | None = None  # traced where the count alone would decide
        self._count_first = flag("count_first", given.count_first)

    @_compiled_code_runs_as_written
    @torch.enable_grad()
    def plan(self, budget: str | int | Size) -> ReportedPlan:
        """Decide, per unit, the checkpoint mode and precision that fit `budget` fastest (autoplan.plan's docstring)."""
        settings = self._settings
        device, ranks, space = settings.device, settings.ranks, settings.space
        asked = SolveRequest(make_budget(budget, device, settings.reserve, allow_over_device=settings.allow_over_device),
                             time_limit_s=settings.time_limit_s, mesh=Mesh.fsdp(1 if ranks == "auto" else ranks, *settings.fsdp_policy),
                             fewest_ranks=ranks == "auto", host=space.host, segments=space.segments)
        arguments = (("budget", asked.budget.given), *self._options.arguments(device.name if device.name in DEVICES else None))
        self._check_unchanged()
        if self._slices[0].levels is None:
            first = dataclasses.replace(asked, mesh=self._mesh_of(self._slices[0], asked))
            counted = self._states_decide(first)
            if counted is not None:
                return reported(self._states_bound(counted, first, arguments))
        piece, note = self._slices[0], None
        if len(self._slices) > 1:  # tensor_parallel="auto": the degree on the fewest GPUs is planned
            found = self._degree_fits(asked)
            chosen_fit = chosen_degree(found)
            piece, note = next(p for p in self._slices if p.degree == chosen_fit.degree), degrees_note(found, chosen_fit)
        chosen, measured = self._plan_slice(piece, dataclasses.replace(asked, mesh=self._mesh_of(piece, asked)))
        if note is not None:
            chosen = dataclasses.replace(chosen, notes=(*chosen.notes, note))
        if device.kind == "cuda" and any(is_float8(choice.precision) for choice in chosen.decisions.choices().values()):
            chosen = dataclasses.replace(chosen, notes=(*chosen.notes, FLOAT8_ON_A_GPU))
        if self._options.on_profile is not None:
            self._options.on_profile(measured)
        fingerprint = dataclasses.replace(self._fingerprint, values=batch_values(self._batch, measured.batch_reads))
        traced_as = dataclasses.replace(chosen.model, moe_routing=measured.routing_assumed, fingerprint=fingerprint,
                                        batch_values=measured.batch_reads, random_control_flow=measured.random_reads > 0)
        return reported(dataclasses.replace(chosen, request=dataclasses.replace(chosen.request, arguments=arguments), model=traced_as))

    def _mesh_of(self, piece: RankSlice, asked: SolveRequest) -> Mesh:
        """The request's mesh with `piece`'s tensor-parallel dimension."""
        return Mesh.fsdp(asked.mesh.along(FSDP), *self._settings.fsdp_policy, piece.degree, piece.layout, piece.sequence is not None)

    def _degree_fits(self, asked: SolveRequest) -> list[DegreeFit]:
        """Each degree's fewest GPUs (the world-size search on each level's profile, no simulation), in order; a degree
        that cannot need fewer than one found is not searched, a searched one whose slice does not run is left out."""
        found: list[DegreeFit] = []
        for piece in self._slices:
            if piece.failed or not can_beat(piece.degree, found):
                found.append(DegreeFit(piece.degree, failed=piece.failed))
                continue
            try:
                piece.levels = piece.levels if piece.levels is not None else self._profile_levels(piece)
            except (ProfileError, TraceError) as error:
                if piece is self._slices[0]:
                    raise
                piece.failed = first_line(error).split(" — ")[0]  # searched, not asked for: the other degrees answer
                found.append(DegreeFit(piece.degree, failed=piece.failed))
                continue
            request = dataclasses.replace(asked, mesh=self._mesh_of(piece, asked))
            fewest = min((fit.world_size for fit in found if fit.fits), default=None)  # to beat: at most one GPU fewer
            largest = (fewest - 1) // piece.degree if fewest is not None else MAX_RANKS
            meshes = [fewest_gpus(level.measured, dataclasses.replace(request, pins=level.pins), largest,
                                  level.simulated.setdefault(points_key(level.measured, request), {})) for level in piece.levels]
            fits = [(mesh, next(p.fits for p in curve if p.world_size == mesh.size)) for mesh, curve in meshes]
            mesh, fit = min(fits, key=lambda item: (not item[1], item[0].size))
            found.append(DegreeFit(piece.degree, mesh.size, fit, mesh.split_words))
        return found

    def _plan_slice(self, piece: RankSlice, asked: SolveRequest) -> tuple[Plan, Profile]:
        """`piece`'s best plan over its levels (profiled now if not yet). Where blocks nest (stages of blocks), every
        level is planned and the best kept (`best_level`); within a level, segments of consecutive blocks are
        candidates of the same program."""
        if piece.levels is None:
            piece.levels = self._profile_levels(piece)
        planned = [decide_loss_head(level.traced, level.measured, dataclasses.replace(asked, pins=level.pins), self._settings.step,
                                    self._say, level.simulated) for level in piece.levels]
        return best_level(planned, [level.level for level in piece.levels], tried=piece.tried)

    def _states_decide(self, asked: SolveRequest) -> CountedStates | None:
        """The counted states, where they alone decide (over the usable budget on one device), else None.

        Counted once per Planner (seconds, no forward). A model whose forward leaves a unit unrun (a tower the batch
        does not use) is simulated instead: its parameters get no gradient there, and so no state.
        """
        settings = self._settings
        if not self._count_first:
            return None
        if self._counted is None:
            try:
                self._counted = count_states(self._slices[0].model, device=settings.device, optimizer=settings.step.optimizer,
                                             loop=settings.step.loop)
            except Exception:  # noqa: BLE001 - no shortcut: the whole pipeline runs the same step and says what failed
                self._count_first = False
                return None
        if not states_over_budget(self._counted, asked):
            return None
        if self._every_unit_runs is None:
            self._every_unit_runs = every_unit_runs(self._slices[0].model, self._batch, self._options.units, settings.step.routing)
        return self._counted if self._every_unit_runs else None

    def _states_bound(self, counted: CountedStates, asked: SolveRequest, arguments) -> Plan:
        """The plan that says, from the count alone, that nothing fits (`solve.states_bound`)."""
        settings = self._settings
        decided = states_bound_plan(counted, asked, device=settings.device, model_name=type(self._model).__name__,
                                    optimizer=optimizer_name(settings.step.optimizer), loop=settings.step.loop,
                                    parameter_count=parameter_count(self._slices[0].model))
        model = dataclasses.replace(decided.model, fingerprint=self._fingerprint)
        return dataclasses.replace(decided, model=model, request=dataclasses.replace(decided.request, arguments=arguments))

    def _profile_levels(self, piece: RankSlice) -> list[ProfiledLevel]:
        """Every level of `piece`'s units traced and profiled; a level whose Sequential run is called twice is skipped."""
        settings = self._settings
        if len(self._slices) > 1:
            self._say(f"tensor parallel {piece.degree}" if piece.degree > 1 else "FSDP alone")
        levels, profiled = unit_levels(piece.model, self._options.units), list[ProfiledLevel]()
        piece.tried = len(levels)
        for number, level in enumerate(levels, 1):
            if len(levels) > 1:
                self._say(f"level {number} of {len(levels)}: {level.source}, {len(level.units)} units")
            try:
                traced, measured = _trace_and_profile(piece.model, self._batch, settings.profile, settings.device, level.units,
                                                      settings.step, settings.space, self._say, self._traced_whole(piece, level))
            except RepeatedUnitError:
                if number == len(levels) and not profiled:
                    raise
                continue  # a Sequential run called twice: the other levels are the plan space
            except ProfileError as error:
                if not piece.layout:
                    raise
                raise ProfileError(f"{error} — under tensor_parallel={piece.degree}, one rank's slice of the model ran (its "
                                   "split linears 1/N wide): linears whose outputs meet must be split alike (gate and up projections "
                                   "both column-wise), and the forward must reshape heads with -1, not a head count") from error
            space = settings.space  # pins, a named policy's as the profile measured it
            pins = pinned_choices(list(traced.unit_names), choices_for(space.precision, settings.device), space.keep_fp32, space.checkpoint, measured)
            profiled.append(ProfiledLevel(level, traced, measured, pins))
        return profiled

    def _traced_whole(self, piece: RankSlice, level: UnitLevel) -> Traced | None:
        """The whole model's trace of `level`, for a tensor-parallel slice of it: the slice runs the same modules in the
        same order, only its split linears narrower, so the units and the dataflow between them are the whole model's
        (traced by a forward on fake tensors of the model itself, "hooks"; a graph is of its own modules). None where
        there is none to take: the slice is traced."""
        whole = self._slices[0]
        if piece is whole or whole.levels is None:
            return None
        traced = next((done.traced for done in whole.levels if done.level.units == level.units), None)
        return traced if traced is not None and traced.method == "hooks" and traced.model is whole.model else None

    def _check_unchanged(self) -> None:
        """The model is the one profiled: a parameter added, dropped, reshaped, moved, cast or (un)frozen is not."""
        difference = first_difference(self._parameters, _parameter_states(self._model), "parameter", "the profile")
        if difference:
            raise PlanMismatchError(f"the model changed since this Planner was made: {difference}; its profile is of the "
                                    "model as it was: make a new Planner (or call autoplan.plan) for the model as it is")


def _parameter_states(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter by name, with what a plan depends on: shape, dtype, device and whether it trains."""
    return {name: f"{describe_tensor(p)} on {p.device}, {'trained' if p.requires_grad else 'frozen'}"
            for name, p in model.named_parameters()}


def _check_model(model: torch.nn.Module, target: Device) -> None:
    """A model a training step can be planned for: something to train, and no 8-bit base for a GPU."""
    if not any(parameter.requires_grad for parameter in model.parameters()):
        raise OptionError(f"{type(model).__name__} has no trainable parameters (every requires_grad is False): a training "
                          "step would update nothing. Unfreeze what you train (model.requires_grad_(True), or add adapters)")
    _check_int8_target(model, target)
    _check_dense_gradients(model)


def _check_dense_gradients(model: torch.nn.Module) -> None:
    """Sparse gradients are not planned: the simulation's tracker reads every tensor's storage, which a sparse
    tensor has none of, and AdamW (the default optimizer) refuses them in the real step too."""
    sparse = [name or type(model).__name__ for name, module in model.named_modules()
              if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse]
    if sparse:
        raise SparseGradientError(
            f"{type(model).__name__} has {len(sparse)} embedding layer(s) with sparse gradients ({', '.join(sparse[:3])}"
            f"{', ...' if len(sparse) > 3 else ''}: sparse=True); autoplan plans dense gradients only: build them with "
            "sparse=False (the default), whose gradient is the whole table, as the plan counts it")


def _check_int8_target(model: torch.nn.Module, target: Device) -> None:
    """8-bit bases are planned for the CPU only: on a GPU, bitsandbytes' LLM.int8() training matmul keeps
    int8 copies of each input and its outlier columns, whose count depends on the batch's values, while
    the CPU path the simulation runs keeps the input alone; a GPU plan would count less than the GPU holds."""
    layers = int8_layers(model)
    if layers and target.kind != "cpu":
        raise ProfileError(
            f"{type(model).__name__} has {len(layers)} bitsandbytes 8-bit layers (e.g. {layers[0]}); autoplan plans 8-bit bases "
            f"for the CPU only, not for {target.name}: on a GPU their matmuls keep outlier columns whose size depends on the batch. "
            "Load the base in 4-bit (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')), which plans for any device")


def _trace_and_profile(model, batch, profile: str, device: Device, unit_names, step: StepOptions, space: SearchSpace,
                       say, traced_whole: Traced | None = None) -> tuple[Traced, Profile]:
    """The trace and profile stages: units found, and what each costs under every allowed choice. `traced_whole`: the
    trace of the model `model` is a tensor-parallel slice of, taken for it (`Planner._traced_whole`)."""
    precisions = choices_for(space.precision, device)
    if space.keep_fp32 and "fp32" not in precisions:
        precisions = (*precisions, "fp32")
    rest = rest_precision(space.precision)
    say("tracing")
    found = trace(model, batch, unit_names=unit_names, routing=step.routing) if traced_whole is None else dataclasses.replace(traced_whole, model=model)
    traced = dataclasses.replace(found, parameter_dtype=step.parameter_dtype)
    if any(is_float8(precision) for precision in precisions):
        check_some_run_in_float8({unit.name: unit_module(model, unit) for unit in traced.units}, space.precision)
    if space.compile and profile == "measure":
        raise OptionError("profile='measure' times eager runs; compile=True prices the compiled model by roofline: "
                          "use profile='roofline' or 'auto'")
    try:
        measured = profile_units(
            traced, device, optimizer=step.optimizer, precisions=precisions, rest_precision=rest, loss_fn=step.loss_fn,
            progress=say, loop=step.loop, menu_size=space.menu_size, compile=space.compile, fuse_loss=space.fuse_loss,
            host=space.host, named=checkpoint_policies(list(traced.unit_names), space.checkpoint),
        )
        if not space.compile and _should_measure(profile, model, device):
            measured = measure_times(measured, traced, optimizer=step.optimizer, loss_fn=step.loss_fn, progress=say)
    except (TraceError, ProfileError, OptionError, MissingExtraError):
        raise
    except Exception as error:  # noqa: BLE001 - the model's own code failed under the profile: say where
        raise _profile_failure(model, error) from error
    return traced, measured


_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


def _profile_failure(model: torch.nn.Module, error: Exception) -> ProfileError:
    """The error of a training step on fake tensors, with the line of the model it happened in."""
    hint = f" — {_meta_counter_hint(model) or FAKE_TENSOR_HINT}" if isinstance(error, _DATA_DEPENDENT) else ""
    return ProfileError(
        f"could not profile {type(model).__name__}: {type(error).__name__}: {first_line(error)}{where_in_user_code(error)}{hint}"
    )


def _meta_counter_hint(model: torch.nn.Module) -> str:
    """Why a BatchNorm with momentum=None cannot be simulated on the meta device ("" where the model has none): it
    divides by num_batches_tracked, whose value the simulation reads off the model, and a meta tensor has none."""
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.modules.batchnorm._NormBase)
             and module.momentum is None and module.track_running_stats and module.num_batches_tracked is not None
             and module.num_batches_tracked.device.type == "meta"]
    if not names:
        return ""
    return (f"{names[0] or type(model).__name__} is a BatchNorm with momentum=None (a cumulative average): its forward "
            "divides by num_batches_tracked's value, and on the meta device the model has none. Build the model with real "
            "weights, or plan it with a momentum (e.g. 0.1): the memory is the same, a momentum only scales the update")


def _should_measure(profile: str, model: torch.nn.Module, target: Device) -> bool:
    device = model_device(model)
    if profile == "roofline":
        return False
    if profile == "auto":
        return device.type == "cuda" and target.kind == "cuda" and target.name == get_device(None).name
    if device.type == "meta":
        raise OptionError("profile='measure' needs real weights; this model is on the meta device. Use profile='roofline'.")
    if device.type != target.kind:
        raise OptionError(
            f"profile='measure' times the model where it is ({device.type}), but the plan is for {target.name} "
            f"({target.kind}); move the model there first, or use profile='roofline'"
        )
    return True
