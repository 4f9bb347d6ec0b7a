"""Report: a plan (and its advice) as a rich document a person reads in a terminal.

`report_renderables` builds it — verdict first, then the memory breakdown, the units (repeated identical
units folded into one row: `layers.0–31 ×32`), step times, the code that applies the plan, an FSDP
estimate when asked, and the advice. When the weights, gradients and optimizer state alone decide that
nothing fits, the verdict says that in one line and no units or times follow: no choice of theirs would
matter. Every number goes through `autoplan.vocabulary.formatting`. `format_report` renders the same to
plain text without colour, which is what `plan.report()` returns. Nothing here prints: the CLI does.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from autoplan.plan import CPU_PRECISION_NOTE
from autoplan.report.advice import state_bound
from autoplan.report.apply_code import apply_code
from autoplan.report.allocator_advice import allocator_bound, allocator_room_of
from autoplan.inputs.cuda_context import context_words
from autoplan.vocabulary.formatting import format_bytes, format_count, format_flops, format_seconds, format_signed_seconds, rank_noun
from autoplan.vocabulary.code_lines import wrap_code

if TYPE_CHECKING:
    from autoplan.plan import Plan, ShardedPeak, UnitDecision
    from autoplan.report.advice import Advice

@dataclass(frozen=True)
class UnitRow:
    """Consecutive units with the same decision and costs, shown as one row."""

    label: str  # "transformer.h.0–31 ×32", or the unit's own name
    first: "UnitDecision"
    count: int


def fold_units(units: tuple["UnitDecision", ...]) -> list[UnitRow]:
    """Fold runs of units numbered stem0, stem1, ... whose choice and costs are identical."""
    rows: list[list[UnitDecision]] = []
    for unit in units:
        last = rows[-1][-1] if rows else None
        if last is not None and _continues(last, unit):
            rows[-1].append(unit)
        else:
            rows.append([unit])
    folded = []
    for run in rows:
        label = run[0].name + (" (segment)" if run[0].members else "")  # one region over its members
        if len(run) > 1:
            label = f"{run[0].name}–{_number(run[-1])} ×{len(run)}"
        folded.append(UnitRow(label, run[0], len(run)))
    return folded


def _number(decision: "UnitDecision") -> int:
    numbered = decision.unit.numbered()
    assert numbered is not None, "only numbered units are folded"
    return numbered[1]


def _continues(previous: "UnitDecision", unit: "UnitDecision") -> bool:
    a, b = previous.unit.numbered(), unit.unit.numbered()
    same_cost = (previous.choice, previous.saved_bytes, previous.recompute_flops) == (unit.choice, unit.saved_bytes, unit.recompute_flops)
    return a is not None and b is not None and a[0] == b[0] and b[1] == a[1] + 1 and same_cost


def _verdict(plan: "Plan") -> Text:
    usable = format_bytes(plan.request.usable_bytes)
    over = f"over the {usable} usable ({format_bytes(plan.request.budget_bytes)} budget)"
    on = plan.target.device if plan.request.world_size == 1 else f"{plan.request.world_size} × {plan.target.device} (per {rank_noun(plan.target.device)}, {plan.request.mesh.split_words})"
    bound = state_bound(plan)
    if plan.outcome.feasible:
        text = Text("FITS", style="bold green")
        text.append(f"  {plan.model.name} on {on}: predicted peak {format_bytes(plan.prediction.peak_bytes)} "
                    f"of {usable} usable ({format_bytes(plan.request.budget_bytes)} budget)", style="bold")
    elif allocator_bound(plan):  # the allocated peak fits; what the allocator needs to run it does not (solve.allocator_fit)
        least, room = plan.prediction.least_limit_bytes, allocator_room_of(plan)
        text = Text("DOES NOT FIT", style="bold red")
        text.append(f"  {plan.model.name} on {on}: the lowest peak autoplan reaches, "
                    f"{format_bytes(plan.prediction.minimum_peak_bytes)}, fits the {usable} usable, but the caching allocator "
                    f"needs {format_bytes(least)} to run that step (free space inside its segments included), over the "
                    f"{format_bytes(room)} the budget leaves it (the budget less the CUDA context) by {format_bytes(least - room)}; "
                    f"it needs a {format_bytes(plan.prediction.minimum_budget_bytes)} budget", style="bold")
    elif bound is not None:
        state = f"parameters, gradients and {plan.request.optimizer} state"
        why = (f"{state} alone are {format_bytes(bound.state_bytes)}, {over}" if not bound.step_bytes else
               f"{state} ({format_bytes(bound.state_bytes)}) with optimizer.step()'s temporaries "
               f"({format_bytes(bound.step_bytes)})" + (f" and cuBLAS's workspaces ({format_bytes(bound.workspace_bytes)})"
                                                        if bound.workspace_bytes else "")
               + f" peak at {format_bytes(plan.prediction.minimum_peak_bytes)}, {over}")
        text = Text("DOES NOT FIT", style="bold red")
        text.append(f"  {plan.model.name} on {on}: {why}: no checkpointing or precision choice changes that", style="bold")
        if plan.outcome.counted_only:  # solve.states_bound: nothing was simulated, the states are a floor
            text.append(f"\nit needs more than a {format_bytes(plan.prediction.minimum_budget_bytes)} budget: counted, not "
                        "simulated; activations and optimizer.step()'s temporaries come on top (--simulate-anyway, "
                        "count_first=False, simulates the step for the whole report)")
            return text
        text.append(f"\nit needs a {format_bytes(plan.prediction.minimum_budget_bytes)} budget; simulated training step: "
                    f"{format_bytes(plan.prediction.simulated_peak_bytes)}")
        return text
    else:
        text = Text("DOES NOT FIT", style="bold red")
        text.append(f"  {plan.model.name} on {on}: the lowest peak autoplan reaches is "
                    f"{format_bytes(plan.prediction.minimum_peak_bytes)}, {over} by "
                    f"{format_bytes(plan.prediction.minimum_peak_bytes - plan.request.usable_bytes)}; it needs a "
                    f"{format_bytes(plan.prediction.minimum_budget_bytes)} budget", style="bold")
    no_plan = "as written, under the loop's autocast" if getattr(plan.request.loop, "outer_autocast", None) else "all keep/fp32"
    text.append(f"\nsimulated training step: {format_bytes(plan.prediction.simulated_peak_bytes)}; no plan ({no_plan}): "
                f"{format_bytes(plan.prediction.baseline_peak_bytes)}")
    if plan.request.loop is not None:  # every peak above is for this loop (docs/loops.md)
        text.append(f"\ntraining loop: {plan.request.loop.describe(plan.request.optimizer)}")
    for note in (n for n in plan.notes if n.startswith(CPU_PRECISION_NOTE)):  # numerics change: said by the headline
        text.append(f"\n{note}", style="bold yellow")
    if plan.decisions.fused_loss:  # the one change outside the units: say it, and how to turn it off
        text.append(f"\nloss: the output head's cross-entropy ({plan.decisions.fused_logits}) is fused, its gradients computed "
                    "chunk by chunk in the forward (fuse_loss=False, --loss-as-written, keeps it as written)")
    return text


def _breakdown(plan: "Plan") -> Table:
    """The memory model's parts at its peak, adding up to the headline's predicted peak: where the
    simulated step peaks higher than the model (`Plan.predicted_peak_bytes` is the higher), a row says by how much."""
    b = plan.prediction.breakdown
    # names from the model (units, phases) are text, never rich markup: "graph[fc_in:gelu]" would vanish
    table = Table(title=Text(f"memory at the peak ({plan.prediction.peak_phase})"), title_justify="left", show_edge=False)
    for column in ("part", "bytes", "share"):
        table.add_column(column, justify="left" if column == "part" else "right")
    rows = [
        ("parameters (and buffers)", b.parameters),
        ("gradients", b.gradients),
        (f"optimizer state ({plan.request.optimizer})", b.optimizer),
        *((("activations", b.activations), ("transient", b.transient)) if not plan.outcome.counted_only else ()),
    ]
    above = plan.prediction.peak_bytes - b.total
    shown_if_any = (("cuBLAS workspaces", b.workspaces), ("held by the loop (micro-batches, kept modules)", b.loop_held),
                    ("simulated step above the memory model", above))
    rows += [(name, nbytes) for name, nbytes in shown_if_any if nbytes > 0]
    total = b.total + max(0, above)
    for name, nbytes in rows:
        table.add_row(name, format_bytes(nbytes), f"{nbytes / max(1, total):.0%}")
    if plan.outcome.counted_only:  # solve.states_bound: the rows a simulation would give are not known
        table.add_row("activations, transient", "not simulated", "")
    table.add_row("= the states, a floor" if plan.outcome.counted_only else "= predicted peak", format_bytes(total), "", style="bold")
    reserved = plan.prediction.reserved_peak_bytes
    if reserved:  # one GPU: the segments the caching allocator holds, their free space included (instruments.caching_allocator)
        table.add_row("caching allocator's reserved memory", format_bytes(reserved), f"{reserved / max(1, total) - 1:+.0%}")
    least = plan.prediction.least_limit_bytes
    if least:  # the limit it runs the step under, giving its cache back at the limit (solve.allocator_fit)
        table.add_row("least limit the allocator runs it in", format_bytes(least), f"{least / max(1, total) - 1:+.0%}")
    reserve, context = plan.request.budget_bytes - plan.request.usable_bytes, plan.request.context_bytes
    if context:  # a GPU: its context (inputs.cuda_context), then the fragmentation allowance
        table.add_row(f"reserve: CUDA context ({context_words(plan.request.context_source)})", format_bytes(context), "")
    table.add_row("reserve: fragmentation allowance" if context else "reserve (CUDA context, fragmentation)", format_bytes(reserve - context), "")
    table.add_row("budget", format_bytes(plan.request.budget_bytes), "")
    return table


def _units(plan: "Plan") -> Table:
    title = "units" + ("" if plan.outcome.feasible else " (the lowest-peak choices)")
    table = Table(title=title, title_justify="left", show_edge=False)
    offloading = any(unit.choice.offloaded for unit in plan.decisions.units)
    for name, justify in (("unit", "left"), ("mode", "left"), ("precision", "left"), ("saved each", "right"),
                          *((("in host memory", "right"),) if offloading else ()),
                          ("recompute each", "right"), ("time each", "right")):
        table.add_column(name, justify=justify, no_wrap=name == "unit")
    for row in fold_units(plan.decisions.units):
        unit = row.first
        host = (format_bytes(unit.host_bytes) if unit.choice.offloaded else "-",) if offloading else ()
        table.add_row(Text(row.label), unit.choice.mode, unit.choice.precision, format_bytes(unit.saved_bytes), *host,
                      _recomputed(unit), format_seconds(unit.step_time_s))
    return table


def _host(plan: "Plan") -> list[Text]:
    """Where offloaded units' saved tensors wait, and what their copies cost."""
    offloaded = [unit for unit in plan.decisions.units if unit.choice.offloaded]
    if not offloaded:
        return []
    transfer, exposed = plan.decisions.transfer_s, plan.decisions.exposed_transfer_s
    hidden = 1 - exposed / transfer if transfer else 1.0
    return [Text(f"offload: {len(offloaded)} unit(s) keep what they save in pinned host memory, "
                 f"{format_bytes(plan.prediction.host_peak_bytes)} at once (host budget {format_bytes(plan.request.host_budget_bytes)}); "
                 f"their copies take {format_seconds(transfer)} over the host link, {hidden:.0%} hidden behind compute, "
                 f"{format_seconds(exposed)} in the step time")]


def _recomputed(unit) -> str:
    """What a unit's backward runs again: its FLOPs; "-" in keep mode; "no FLOPs" when it reruns only
    norms, casts and activations (their cost is bytes moved, in the time column)."""
    if unit.choice.mode == "keep":
        return "-"
    return format_flops(unit.recompute_flops) if unit.recompute_flops else "no FLOPs"


def _policies(plan: "Plan", verbose: bool = False) -> list[Text]:
    """Each menu point the plan chose (selective units that save ops of their own choosing): in a person's
    words, by kind of op; op by op, by submodule, when `verbose`."""
    lines = []
    for row in fold_units(plan.decisions.units):
        if not row.first.policy:
            continue
        unit = row.first
        lines.append(f"  {row.label}: {unit.policy_summary or unit.policy} ({format_bytes(unit.saved_bytes)} saved, "
                     f"{format_seconds(unit.step_time_s)})")
        if verbose and unit.policy_summary:
            lines.append(f"    op by op: {unit.policy}")
    if not lines:
        return []
    hint = "" if verbose else " (op by op: --verbose, report(verbose=True))"
    return [Text(f"what the selective units save{hint}:\n" + "\n".join(lines))]


def _times(plan: "Plan") -> Text:
    slower = plan.prediction.step_time_s / plan.prediction.fastest_step_time_s - 1 if plan.prediction.fastest_step_time_s else 0.0
    return Text(f"step time ({plan.prediction.time_source}): {format_seconds(plan.prediction.step_time_s)} planned, "
                f"{format_seconds(plan.prediction.fastest_step_time_s)} for the fastest plan ignoring memory ({slower:+.1%}), "
                f"{format_seconds(plan.prediction.baseline_step_time_s)} with no plan")


def _code(code: str) -> Text:
    # wrapped as Python (inside its brackets), never by the terminal: it is copied and pasted
    return Text(wrap_code(code), style="cyan", no_wrap=True, overflow="ignore")


def _sharded(peak: "ShardedPeak", usable: int, device: str) -> Text:
    verdict = "fits" if peak.total <= usable else "does not fit"
    return Text(
        f"FSDP estimate on {peak.world_size} {rank_noun(device, peak.world_size)} (sharding parameters, gradients and optimizer state; an estimate, "
        f"not a plan): {format_bytes(peak.total)} per {rank_noun(device)}, {verdict} in {format_bytes(usable)} — shards: parameters "
        f"{format_bytes(peak.parameters)}, gradients {format_bytes(peak.gradients)}, optimizer {format_bytes(peak.optimizer)}; "
        f"gathered parameters {format_bytes(peak.gathered_parameters)}, all-gather/reduce-scatter buffers "
        f"{format_bytes(peak.communication_buffers)}, activations {format_bytes(peak.activations)} (at {peak.phase})"
    )


def _world_sizes(plan: "Plan") -> list[RenderableType]:
    """The per-rank arithmetic of an FSDP plan, and the curve of per-rank peak against N."""
    parts: list[RenderableType] = []
    usable = plan.request.usable_bytes
    if plan.model.parameter_count:
        per_param = plan.model.state_bytes / plan.model.parameter_count
        floor = -(-plan.model.state_bytes // max(usable, 1))
        parts.append(Text(
            f"before sharding{plan.request.mesh.slice_words}: {format_count(plan.model.parameter_count)} parameters × {per_param:.1f} bytes each (weights, gradients, "
            f"{plan.request.optimizer} state; the rule of thumb for AdamW is 16) = {format_bytes(plan.model.state_bytes)}; over "
            f"{format_bytes(usable)} usable that is at least {floor} {rank_noun(plan.target.device, floor)} for the state alone, before activations"
        ))
    peak = plan.prediction.fsdp
    gathered = plan.request.mesh.gathered_words
    if peak is not None:
        parts.append(Text(
            f"per rank on {peak.world_size} {rank_noun(plan.target.device, peak.world_size)} (FSDP2, at {peak.phase}): shards of parameters {format_bytes(peak.parameters)} "
            f"+ gradients {format_bytes(peak.gradients)} + optimizer {format_bytes(peak.optimizer)} + gathered parameters "
            f"({gathered}) {format_bytes(peak.gathered_parameters)} + all-gather/reduce-scatter buffers "
            f"{format_bytes(peak.communication_buffers)} + activations {format_bytes(peak.activations)} = {format_bytes(peak.total)}"
        ))
    if plan.prediction.world_size_curve:
        table = Table(title=f"per-rank peak against the number of {rank_noun(plan.target.device, 2)} (world_size=\"auto\")", title_justify="left", show_edge=False)
        for column in (rank_noun(plan.target.device, 2), "lowest peak per rank", "no checkpointing", "fits"):
            table.add_column(column, justify="left" if column == "fits" else "right")
        for point in plan.prediction.world_size_curve:
            mark = "yes" if point.fits else "no"
            if point.world_size == plan.request.world_size:
                mark += "  ← chosen: the fewest that fit" if point.fits else "  ← the most tried: none fits"
            table.add_row(str(point.world_size), format_bytes(point.lowest_peak_bytes), format_bytes(point.no_plan_peak_bytes), mark)
        parts.append(table)
    return parts


def _signed_bytes(saves: int | None) -> str:
    if saves is None:
        return "peak: not predicted"
    if saves == 0:
        return "peak: no change"
    return f"peak {'−' if saves > 0 else '+'}{format_bytes(abs(saves))}"


def _signed_time(change: float | None) -> str:
    if change is None:
        return "time: not predicted"
    return "time: no change" if change == 0 else f"time {format_signed_seconds(change)}"


def _advice(advice: "Advice") -> Group:
    styles = {"chosen": "green", "try": "yellow", "n/a": "dim"}
    lines: list[RenderableType] = [Text("what to change, in order", style="bold")]
    for index, step in enumerate(advice.steps, 1):
        head = Text(f"{index:>2}. {step.title} ", style="bold" if step.key == advice.first_fix else "")
        head.append(f"[{step.status}]", style=styles.get(step.status, ""))
        if step.status != "n/a":
            head.append(f"  {_signed_bytes(step.saves_bytes)}, {_signed_time(step.time_change_s)}")
        if step.key == advice.first_fix:
            head.append("  ← the first step that fits on its own", style="bold")
        lines.append(head)
        lines.append(Padding(Text(step.detail, style="dim" if step.status == "n/a" else ""), (0, 0, 0, 4)))
    return Group(*lines)


def ladder_renderables(ladder) -> list[RenderableType]:
    """The toolbox ladder (`report.ladder.Ladder`): each rung adds one tool, the first that fits marked, and its code."""
    table = Table(title=Text(f"the toolbox ladder on {ladder.device}: each step adds one tool to those above"),
                  title_justify="left", show_edge=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (("step", "left"), ("peak", "right"), ("step time", "right"),
                                                      (f"fits {format_bytes(ladder.usable_bytes)}", "left"))
    for column, justify in columns:
        table.add_column(column, justify=justify, no_wrap=True)
    for rung in ladder.rungs:
        mark = ("yes" if rung.fits else "no") + ("  ← first fits" if rung.key == ladder.first_fit else "")
        style = "bold" if rung.key == ladder.first_fit else ""
        table.add_row(Text(rung.title), format_bytes(rung.peak_bytes), format_seconds(rung.step_time_s), mark, style=style)
    how = [Padding(Text(f"{rung.title.lstrip('+ ')}: {rung.how}", style="dim"), (0, 0, 0, 2)) for rung in ladder.rungs]
    parts: list[RenderableType] = [table, Text("how each step was predicted:", style="dim"), *how]
    first = next((r for r in ladder.rungs if r.key == ladder.first_fit), None)
    if first is None:
        lowest = min(ladder.rungs, key=lambda rung: rung.peak_bytes)
        return parts + [Text(f"no step fits: the lowest peak the ladder reaches is {format_bytes(lowest.peak_bytes)} "
                             f"({lowest.title.lstrip('+ ')}); a smaller batch, shorter sequences or more GPUs (above) next",
                             style="bold")]
    head = f"apply it (up to \"{first.title.lstrip('+ ')}\", the first step that fits; CHECKPOINT: the model's name or path):"
    return parts + [Text(head, style="bold"), _code(ladder.apply_code)]


def report_renderables(
    plan: "Plan", advice: "Advice | None" = None, *, budget_text: str | None = None, with_code: bool = True, verbose: bool = False
) -> list[RenderableType]:
    """The report's parts in order. with_code=False leaves out the line that applies the plan (it is applied);
    verbose=True names, op by op, what the selective units save."""
    parts: list[RenderableType] = [_verdict(plan), _breakdown(plan)]
    if plan.request.world_size > 1 or plan.prediction.world_size_curve:
        parts.extend(_world_sizes(plan))
    if state_bound(plan) is None:  # otherwise any choice of the units would do: they are not the problem
        parts.extend([_units(plan), *_policies(plan, verbose), *_host(plan), _times(plan)])
    if plan.outcome.feasible and with_code:  # for a plan that does not fit, optimize() would raise: the advice says what to change
        parts.append(Text("apply it:", style="bold"))
        parts.append(_code(apply_code(plan, budget_text)))
    if advice is not None and advice.requested is not None and plan.request.world_size == 1:
        parts.append(_sharded(advice.requested, plan.request.usable_bytes, plan.target.device))
    if advice is not None:
        parts.append(_advice(advice))
        fix = next((s for s in advice.steps if s.key == advice.first_fix), None)
        planned = {rung.key for rung in advice.ladder.rungs} if advice.ladder is not None else set()
        if fix is not None and fix.code and fix.key not in planned:  # a rung's code comes with the ladder's, complete
            parts.extend([Text(f"{fix.title}:", style="bold"), _code(fix.code)])
        if advice.ladder is not None:
            parts.extend(ladder_renderables(advice.ladder))
    parts.extend(Text(f"note: {note}", style="italic") for note in plan.notes if not note.startswith(CPU_PRECISION_NOTE))
    return parts


def plan_summary(plan: "Plan", verbose: bool = False) -> list[RenderableType]:
    """The short form of the report: the verdict, the units and the step times (what `autoplan verify` checked)."""
    parts: list[RenderableType] = [_verdict(plan)]
    if state_bound(plan) is None:
        parts.extend([_units(plan), *_policies(plan, verbose), *_host(plan), _times(plan)])
    return parts


def render(console: Console, parts: list[RenderableType]) -> None:
    """Write the report's parts to `console`; code lines are never wrapped, so they paste as code."""
    for part in parts:
        console.print(part, soft_wrap=isinstance(part, Text) and bool(part.no_wrap))


# Columns of a report written where no terminal gives a width (a file, a pipe, a log, `plan.report()`): rich's
# own 80 crushed the units table, wrapping every cell; a table wider than this widens the report, up to the widest.
REPORT_WIDTH, WIDEST_REPORT = 120, 200


def report_width(console: Console, parts: list[RenderableType]) -> int:
    """The width to render `parts` at where no terminal gives one: COLUMNS when set, else REPORT_WIDTH, or its widest
    table's own width where that is wider (at most WIDEST_REPORT): a file has no edge to wrap a table's cells at."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    options = console.options.update_width(WIDEST_REPORT)
    widest = max((Measurement.get(console, options, part).maximum for part in parts if isinstance(part, Table)), default=0)
    return min(WIDEST_REPORT, max(REPORT_WIDTH, widest))


def format_report(
    plan: "Plan", advice: "Advice | None" = None, *, width: int | None = None, budget_text: str | None = None, with_code: bool = True,
    verbose: bool = False,
) -> str:
    """The report as plain text (no colour, no terminal codes); `width` None: `report_width`'s."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=width or REPORT_WIDTH, color_system=None, force_terminal=False, highlight=False)
    parts = report_renderables(plan, advice, budget_text=budget_text, with_code=with_code, verbose=verbose)
    console.width = width or report_width(console, parts)
    render(console, parts)
    return buffer.getvalue().rstrip() + "\n"


