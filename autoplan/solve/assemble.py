"""The Plan a search produced: its choices with what they cost, the notes a person needs, and, where
blocks nest, the best of the levels planned.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypedDict

from autoplan.axes.precision import kind
from autoplan.inputs.budget import both_units
from autoplan.inputs.hf_models import caches_in_training
from autoplan.instruments.quantized import stray_quantized_tensors
from autoplan.memory.model import host_peak, predict_peak, predict_step_time
from autoplan.memory.segment_terms import chosen_segments, segment_terms
from autoplan.memory.sharded import on_rank, rank_moments, shard_padding
from autoplan.mesh import FSDP, Mesh
from autoplan.plan import CPU_PRECISION_NOTE, Decisions, DeviceTarget, Outcome, Plan, PlannedModel, Prediction, Request, UnitDecision
from autoplan.profile.menu import PolicyWords
from autoplan.profile.profiler import Profile
from autoplan.vocabulary.formatting import format_bytes, rank_noun
from autoplan.vocabulary.tensors import unique_storage_bytes
from autoplan.solve.allocator_fit import reserved_context
from autoplan.solve.ilp import fastest
from autoplan.solve.request import SolveRequest
from autoplan.solve.search import SearchResult
from autoplan.solve.worlds import profiled_parameter_count
from autoplan.trace.tracer import Traced
from autoplan.trace.discovery import UnitLevel


def best_level(planned: list[tuple[Plan, Profile]], levels: list[UnitLevel], tried: int) -> tuple[Plan, Profile]:
    """The plan of the level that fits fastest (or, if none fits, reaches the lowest peak), and its profile.

    Its minimum peak is the lowest any level reaches: the plan space is all the levels'. `levels`
    are those planned, of `tried` (a level whose Sequential run is called twice cannot be).
    """
    fitting = [item for item in planned if item[0].outcome.feasible]
    if fitting:
        best = min(fitting, key=lambda item: item[0].prediction.step_time_s)
    else:
        best = min(planned, key=lambda item: item[0].prediction.minimum_peak_bytes)
    if tried == 1:
        return best
    lowest = min((plan for plan, _ in planned), key=lambda plan: plan.prediction.minimum_peak_bytes)
    index = planned.index(best)
    others = ", ".join(f"{level.source} ({len(level.units)} units)" for i, level in enumerate(levels) if i != index)
    note = f"units: {levels[index].source} ({len(levels[index].units)} units), the best of {tried} levels"
    note += f"; also planned: {others}" if others else ""
    note += f"; {tried - len(levels)} could not be planned (a Sequential run called more than once)" if tried > len(levels) else ""
    lowest_figures = dataclasses.replace(best[0].prediction, minimum_peak_bytes=lowest.prediction.minimum_peak_bytes,
                                         minimum_budget_bytes=lowest.prediction.minimum_budget_bytes)
    return dataclasses.replace(best[0], prediction=lowest_figures, notes=(*best[0].notes, note)), best[1]



def faster_loss_head(first: tuple[Plan, Profile], second: tuple[Plan, Profile]) -> tuple[Plan, Profile]:
    """Of one level planned with the loss head fused and as written, the plan that fits fastest (else
    the one reaching the lower peak); its fastest and lowest figures are both plans' best, as the
    plan space is both. On a tie the first stays."""
    (a, _), (b, _) = first, second
    if a.outcome.feasible != b.outcome.feasible:
        best = first if a.outcome.feasible else second
    elif a.outcome.feasible:
        best = second if b.prediction.step_time_s < a.prediction.step_time_s else first
    else:
        best = second if b.prediction.minimum_peak_bytes < a.prediction.minimum_peak_bytes else first
    return with_both_heads_figures(best, HeadFigures.of(a), HeadFigures.of(b))


@dataclass(frozen=True)
class HeadFigures:
    """What the plan of one loss head lends the plan of both: its fastest step and its lowest peak with its budget."""

    fastest_step_time_s: float
    minimum_peak_bytes: int
    minimum_budget_bytes: int

    @staticmethod
    def of(plan: Plan) -> HeadFigures:
        figures = plan.prediction
        return HeadFigures(figures.fastest_step_time_s, figures.minimum_peak_bytes, figures.minimum_budget_bytes)


def with_both_heads_figures(best: tuple[Plan, Profile], first: HeadFigures, second: HeadFigures) -> tuple[Plan, Profile]:
    """`best` with the fastest and lowest figures of both heads (`first`: the timeline's, which a tie keeps)."""
    lowest = min((first, second), key=lambda figures: figures.minimum_peak_bytes)
    both = dataclasses.replace(best[0].prediction, fastest_step_time_s=min(first.fastest_step_time_s, second.fastest_step_time_s),
                               minimum_peak_bytes=lowest.minimum_peak_bytes, minimum_budget_bytes=lowest.minimum_budget_bytes)
    return dataclasses.replace(best[0], prediction=both), best[1]


def plan_notes(traced: Traced, measured: Profile, found: SearchResult, request: SolveRequest) -> list[str]:
    """What a person should know about the plan beyond its numbers."""
    budget, target, time_limit_s = request.budget, measured.device, request.time_limit_s
    notes = [budget.note] if budget.note else []
    if request.mesh.param_dtype:
        notes.append(f"FSDP2 MixedPrecisionPolicy(param_dtype={request.mesh.param_dtype}, reduce_dtype=fp32): every unit computes with its "
                     f"parameters gathered in {request.mesh.param_dtype} (a unit's precision \"fp32\" here means no autocast on top); "
                     "shards, reduced gradients and the optimizer state are fp32")
    if budget.total_bytes > target.memory_bytes:
        notes.append(f"the budget ({both_units(budget.total_bytes)}) is more than {target.name}'s {both_units(target.memory_bytes)} "
                     "of memory (allow_over_device): the plan fits the budget, not the device")
    if not found.feasible:
        notes.append("no choice fits the budget: the plan holds the lowest-peak choices")
    if measured.time_source.startswith("roofline, compiled"):
        notes.append("planned for torch.compile: recomputing ops without FLOPs is priced as free (fused); the peaks are "
                     "the eager model's, which the compiled one usually stays under; compile after applying the plan")
    elif found.timed_out:
        notes.append(f"the solver ran out of time ({time_limit_s:g} s): this plan fits, but a faster one may exist; raise "
                     "time_limit_s (--time-limit on the command line)")
    if traced.never_ran:
        notes.append(f"{', '.join(traced.never_ran)} never ran in the forward (built but unused, or a branch not taken): "
                     "skipped, not planned")
    if measured.routing:
        notes.append(measured.routing)
    notes += value_notes(measured, traced)
    refused = {unit.name: unit.selective_refused for unit in measured.units if unit.selective_refused}
    if refused:
        notes.append(f"selective checkpointing is not offered for {', '.join(refused)}: torch's selective checkpointing "
                     f"refuses {'it' if len(refused) == 1 else 'them'} ({next(iter(refused.values()))}), as it would in the "
                     "real run; keep and full are")
    notes += buffer_notes(measured, found)
    if measured.timeline.loss_summed:
        notes.append("no loss_fn was given and the model's output holds no loss: planned with the sum of its floating-point "
                     "outputs as the loss; a loss computed outside the model (a cross-entropy keeps its log-softmax) holds "
                     "more, so pass loss_fn= (the output -> the loss you train with) to plan that one")
    notes += padding_notes(measured, request.mesh)
    stray = stray_quantized_tensors(traced.model)
    if stray:
        notes.append(f"this model's 4-bit weights keep {format_bytes(unique_storage_bytes(stray))} of layers outside it alive "
                     "(bitsandbytes' Params4bit.__deepcopy__ keeps the original's layer: a copy.deepcopy of a 4-bit model "
                     "holds the original's weights too); counted as parameters. Load the model again rather than copy it")
    if traced.example_inputs[1].get("use_cache") is False and caches_in_training(traced.model):
        notes.append("planned without a KV cache, as training reads none back: autoplan.apply sets the model's "
                     "config.use_cache to False, so model(**batch) trains as planned (generate() still caches)")
    if measured.timeline.target_kernels:
        notes.append(measured.timeline.target_kernels)
    if traced.skip_edges:
        notes.append(f"{len(traced.skip_edges)} skip connection(s) keep tensors alive across units")
    low = target.low_precision_name
    if kind(low).grad_scaler and any(c.precision == low for c in found.choices.values()):
        notes.append(f"{low} units need torch.amp.GradScaler in the training loop")
    return cpu_precision_notes(measured, found) + notes


def cpu_precision_notes(measured: Profile, found: SearchResult) -> list[str]:
    """On a CPU target, "auto" choosing a low precision changes the numerics of a model a person trains in fp32: said
    first, with the option that keeps fp32."""
    if measured.device.kind != "cpu":
        return []
    low = [name for name, choice in found.choices.items() if choice.precision != "fp32"]
    offered_fp32 = any(choice.precision == "fp32" for unit in measured.units for choice in unit.options)
    if not low or not offered_fp32:  # none chosen, or the person forced a low precision
        return []
    precision = found.choices[low[0]].precision
    return [f"{CPU_PRECISION_NOTE}{len(low)} of {len(found.choices)} units run in {precision} (autocast) on this CPU, chosen by "
            f"precision='auto' for speed or memory: their numerics are {precision}'s, not fp32's; precision='fp32' "
            "(--precision fp32) keeps fp32"]



def value_notes(measured: Profile, traced: Traced) -> list[str]:
    """What the plan assumed of values the forward read: the batch's, and random draws'."""
    notes = []
    if measured.batch_reads:
        notes.append(f"the forward reads values of {', '.join(measured.batch_reads)} (sizes, counts or checks decided by "
                     "them): simulated with this batch's values, so the plan holds for batches of these shapes with the "
                     "same sizes in them (image grids, sequence lengths); verify refuses a batch with other sizes")
    if measured.random_reads:
        how = "every layer runs" if not traced.never_ran else f"the most units run ({', '.join(traced.never_ran)} never did)"
        notes.append(f"random control flow (LayerDrop, stochastic depth as a branch: the forward decides on random draws): "
                     f"planned at the worst case, with the draws under which {how}")
    return notes


def assemble_plan(measured: Profile, traced: Traced, found: SearchResult, request: SolveRequest) -> Plan:
    """The Plan: the search's choices with what they cost, and the numbers a person checks them by."""
    rest, budget, target, mesh = measured.rest_precision, request.budget, measured.device, request.mesh
    chosen, feasible = found.choices, found.feasible
    prediction = predict_peak(measured, chosen, mesh)
    notes = plan_notes(traced, measured, found, request)
    decisions = _decisions(measured, chosen)
    context, context_source = reserved_context(budget, target)
    return Plan(
        request=Request(
            budget_bytes=budget.total_bytes, usable_bytes=budget.usable_bytes, optimizer=measured.optimizer, mesh=mesh,
            loop=measured.loop, host=request.host, context_bytes=context, context_source=context_source,
        ),
        model=PlannedModel(
            name=measured.model_name, trace_method=traced.method, parameter_count=profiled_parameter_count(measured),
            state_bytes=sum(getattr(measured.timeline.static, part) for part in ("parameters", "gradients", "optimizer")),
        ),
        target=DeviceTarget(
            target.name, target.low_precision_name,
            needs_grad_scaler=any(kind(c.precision).grad_scaler for c in chosen.values()) or kind(rest).grad_scaler,
        ),
        decisions=Decisions(decisions, rest, measured.timeline.fused_loss, measured.timeline.fused_logits),
        prediction=Prediction(
            # the higher of the two estimates: the linear model can miss a few hundred bytes the whole step holds
            # (a view of a batch tensor), and the plan's number must not be below what the step measures
            peak_bytes=max(prediction.bytes, found.simulated_peak_bytes),
            simulated_peak_bytes=found.simulated_peak_bytes,
            baseline_peak_bytes=_per_rank_peak(measured.reference, measured, mesh),
            minimum_peak_bytes=found.lowest_peak_bytes,
            minimum_budget_bytes=budget.needed_for(found.lowest_peak_bytes, target),
            breakdown=prediction.breakdown,
            peak_phase=prediction.phase,
            step_time_s=predict_step_time(measured, chosen),
            baseline_step_time_s=measured.reference_step_time_s or measured.reference.step_time_s,
            fastest_step_time_s=predict_step_time(measured, fastest(measured, request.pins)),
            time_source=measured.time_source,
            fsdp=prediction.rank,
            host_peak_bytes=host_peak(measured, chosen),
        ),
        outcome=Outcome(feasible, found.solver_status, found.solve_time_s, found.resolves),
        notes=tuple(notes),
    )



def _decisions(measured: Profile, chosen) -> tuple[UnitDecision, ...]:
    """One decision per unit, in forward order; a chosen segment is one decision, where its first unit was."""
    segments = {candidate.members[0]: (candidate, choice) for candidate, choice in chosen_segments(measured, chosen)}
    inside = {u for candidate, _ in segments.values() for u in candidate.members}
    decisions = []
    for u, unit in enumerate(measured.units):
        if u in segments:
            candidate, choice = segments[u]
            terms = segment_terms(measured, candidate, choice)
            first = measured.units[candidate.members[0]]
            decisions.append(UnitDecision(
                unit=candidate.unit, choice=choice, saved_bytes=first.options[choice].held_bytes,
                recompute_flops=terms.recompute_flops, step_time_s=terms.time_s,
                members=tuple(measured.units[m].name for m in candidate.members),
            ))
        elif u not in inside:
            choice = chosen[unit.name]
            cost = unit.options[choice]
            decisions.append(UnitDecision(
                unit=unit.unit, choice=choice, saved_bytes=cost.held_bytes,
                recompute_flops=unit.recompute_flops(choice), step_time_s=cost.time_s,
                host_bytes=cost.host_bytes, transfer_s=cost.transfer_s, exposed_transfer_s=cost.exposed_transfer_s,
                **_policy_fields(unit.policies.get(choice)),
            ))
    return tuple(decisions)


class _PolicyFields(TypedDict, total=False):
    policy: str
    policy_summary: str


def _policy_fields(words: PolicyWords | None) -> _PolicyFields:
    """A menu point's policy, as the plan carries it: in a person's words, and op by op."""
    return {} if words is None else {"policy": words.ops, "policy_summary": words.summary}


def infeasible_message(plan: Plan) -> str:
    return (
        f"no plan fits {plan.target.device} in {format_bytes(plan.request.budget_bytes)} "
        f"(usable {format_bytes(plan.request.usable_bytes)}): the lowest peak autoplan can reach is "
        f"{format_bytes(plan.prediction.minimum_peak_bytes)}, which needs a budget of "
        f"{format_bytes(plan.prediction.minimum_budget_bytes)}. Call autoplan.plan(...) to see the breakdown."
    )



def _per_rank_peak(timeline, measured: Profile, mesh: Mesh) -> int:
    """A simulated timeline's peak on one rank of `mesh` (its own peak on one GPU)."""
    offsets, extras = rank_moments(measured, mesh)
    return max(on_rank(phase.peak_bytes, phase.start_bytes, offset, extra)
               for phase, offset, extra in zip(timeline.phases, offsets, extras))


# Padding worth a note: this share of what a rank holds of the parameters. A head of 10 rows over 16 ranks pads a
# few bytes of a model's kilobytes; 65,536 ranks over 128-row layers make nearly all of it padding.
NOTABLE_PADDING = 0.1


def padding_notes(measured: Profile, mesh: Mesh) -> list[str]:
    """FSDP over more ranks than some parameter has rows: what its padding costs each rank (a per-GPU peak that
    grows with the world size reads as a mistake without it)."""
    padding = shard_padding(measured, mesh)
    if padding is None or padding.shard_bytes - padding.even_bytes < NOTABLE_PADDING * padding.shard_bytes:
        return []
    ranks, device = mesh.along(FSDP), measured.device.name
    return [f"FSDP pads each parameter to a multiple of {ranks:,} rows (dim 0), and {padding.short} of {padding.parameters} "
            f"parameters have fewer rows (as few as {padding.fewest_rows:,}): each {rank_noun(device)} holds "
            f"{format_bytes(padding.shard_bytes)} of parameter shards where an even split is {format_bytes(padding.even_bytes)}, "
            f"{format_bytes(padding.shard_bytes - padding.even_bytes)} of padding (its gradient and optimizer-state shards are "
            f"padded alike), and gathering a unit takes up to {format_bytes(padding.gathered_bytes)} for "
            f"{format_bytes(padding.gathered_full_bytes)} of parameters; with at most {padding.fewest_rows:,} "
            f"{rank_noun(device, padding.fewest_rows)} every rank holds rows of every parameter"]


def buffer_notes(measured: Profile, found: SearchResult) -> list[str]:
    """Recomputed units whose forward writes buffers: what their recomputation does about it."""
    writers = {}
    for unit in measured.units:
        choice = found.choices.get(unit.name)
        cost = unit.options.get(choice) if choice is not None else None
        if cost is not None and cost.written_buffers:
            writers[unit.name] = cost.written_buffers
    if not writers:
        return []
    named = "; ".join(f"{name} ({', '.join(buffers)})" for name, buffers in writers.items())
    return [f"recomputed units whose forward writes buffers: {named}: each recomputation runs on the values the "
            "forward saw and leaves the buffers as the forward did, so they are updated once a step"]
