"""Plot: memory over one training step, before and after the plan, against the budget.

The curves are the memory model's (`memory.phase_bytes`): the same per-phase numbers the solver
constrains, so the picture and the plan cannot disagree. "Before" is no plan — every unit keep/fp32
and nothing under autocast (the profile's reference step when fp32 choices were not profiled).
matplotlib is an optional extra: `pip install "autoplan[plot]"`; it and the memory model are
imported when a plot is drawn, so the command line checks `--plot`'s file name without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autoplan.errors import OptionError, PlotUnavailable
from autoplan.vocabulary.formatting import byte_unit

if TYPE_CHECKING:
    from autoplan.plan import Phase, Plan
    from autoplan.profile.profiler import Profile

FORMATS = (".png", ".svg", ".pdf")
MOST_LABELS = 40  # phase names on the x axis; more are thinned out to every k-th (they would overlap)


@dataclass(frozen=True)
class MemoryCurves:
    phases: tuple[Phase, ...]  # the step's phases in order: forward, backward, optimizer
    before: tuple[int, ...]  # no plan
    after: tuple[int, ...]  # the plan's choices
    usable_bytes: int
    budget_bytes: int


def memory_curves(plan: Plan, profile: Profile) -> MemoryCurves:
    from autoplan.memory.model import phase_bytes
    from autoplan.plan import Choice

    after = [p.live_bytes for p in phase_bytes(profile, plan.decisions.choices())]
    no_plan = {unit.name: Choice("keep", "fp32") for unit in profile.units}
    if profile.rest_precision == "fp32" and all(Choice("keep", "fp32") in unit.options for unit in profile.units):
        before = [p.live_bytes for p in phase_bytes(profile, no_plan)]
    else:
        before = [phase.peak_bytes for phase in profile.reference.phases]
    phases = tuple(sample.phase for sample in profile.timeline.phases)
    return MemoryCurves(phases, tuple(before), tuple(after), plan.request.usable_bytes, plan.request.budget_bytes)


def require_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable('--plot needs matplotlib, an optional extra: pip install "autoplan[plot]"') from None
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def plot_memory(plan: Plan, profile: Profile, path: str | Path) -> Path:
    """Write the before/after memory curves to `path` (.png, .svg or .pdf)."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise OptionError(f"plot file must end in {', '.join(FORMATS)}; got {path.name!r}")
    plt = require_pyplot()
    curves = memory_curves(plan, profile)
    scale, unit = byte_unit(max(*curves.before, *curves.after, curves.budget_bytes))  # the axis in the unit that fits
    # a step per phase, the last one drawn to its end (where="post" with the last value repeated)
    steps = range(len(curves.phases) + 1)
    figure, axes = plt.subplots(figsize=(max(10, 0.25 * len(curves.phases)), 5.5))
    # no plan wide and pale under the plan: where they coincide (the optimizer's step) both stay visible
    axes.step(steps, [b / scale for b in (*curves.before, curves.before[-1])], where="post", label="no plan (keep, fp32)",
              color="tab:gray", linewidth=5, alpha=0.45)
    axes.step(steps, [b / scale for b in (*curves.after, curves.after[-1])], where="post", label="planned", color="tab:blue")
    axes.axhline(curves.usable_bytes / scale, color="tab:red", linestyle="--", label="usable budget")
    axes.axhline(curves.budget_bytes / scale, color="tab:red", linestyle=":", label="budget")
    _phase_axis(axes, curves.phases)
    axes.set_ylabel(f"live memory ({unit})")
    axes.set_title(f"{plan.model.name} on {plan.target.device}: memory over one training step")
    axes.set_ylim(bottom=0)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)  # beside the plot, off the lines
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def _phase_axis(axes, phases: tuple[Phase, ...]) -> None:
    """The x axis names each phase ("fwd:layers.3", "bwd:start", "optimizer") under the step it is;
    lines mark where backward and the optimizer's step begin."""
    from autoplan.plan import BACKWARD_START, OPTIMIZER_STEP

    every = -(-len(phases) // MOST_LABELS)  # ceiling: at most MOST_LABELS names
    shown = range(0, len(phases), every)
    axes.set_xticks([i + 0.5 for i in shown], [str(phases[i]) for i in shown], rotation=90, fontsize=7)
    axes.set_xlim(0, len(phases))
    for marker, label in ((BACKWARD_START, "backward"), (OPTIMIZER_STEP, "optimizer")):
        if marker in phases:
            axes.axvline(phases.index(marker), color="black", linewidth=0.5)
            axes.annotate(label, (phases.index(marker), 0), xytext=(3, 3), textcoords="offset points", fontsize=8)
    axes.set_xlabel("phase of the training step (forward, backward, optimizer)")
