"""Plot: memory over one training step, before and after the plan, against the budget.

The curves are the memory model's (`memory.phase_bytes`): the same per-phase numbers the solver
constrains, so the picture and the plan cannot disagree. "Before" is no plan — every unit keep/fp32
and nothing under autocast (the profile's reference step when fp32 choices were not profiled).
matplotlib is an optional extra: `pip install "autoplan[plot]"`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autoplan.errors import OptionError, PlotUnavailable
from autoplan.memory.model import phase_bytes
from autoplan.plan import BACKWARD_START, OPTIMIZER_STEP, Choice, Phase, Plan
from autoplan.profile.units import Profile

FORMATS = (".png", ".svg", ".pdf")


@dataclass(frozen=True)
class MemoryCurves:
    phases: tuple[Phase, ...]  # the step's phases in order: forward, backward, optimizer
    before: tuple[int, ...]  # no plan
    after: tuple[int, ...]  # the plan's choices
    usable_bytes: int
    budget_bytes: int


def memory_curves(plan: Plan, profile: Profile) -> MemoryCurves:
    after = [p.live_bytes for p in phase_bytes(profile, plan.choices())]
    no_plan = {unit.name: Choice("keep", "fp32") for unit in profile.units}
    if profile.rest_precision == "fp32" and all(Choice("keep", "fp32") in unit.options for unit in profile.units):
        before = [p.live_bytes for p in phase_bytes(profile, no_plan)]
    else:
        before = [phase.peak_bytes for phase in profile.reference.phases]
    phases = tuple(sample.phase for sample in profile.timeline.phases)
    return MemoryCurves(phases, tuple(before), tuple(after), plan.usable_bytes, plan.budget_bytes)


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
    gb = 1e9
    steps = range(len(curves.phases))
    figure, axes = plt.subplots(figsize=(10, 4.5))
    axes.step(steps, [b / gb for b in curves.before], where="mid", label="no plan (keep, fp32)", color="tab:gray")
    axes.step(steps, [b / gb for b in curves.after], where="mid", label="planned", color="tab:blue")
    axes.axhline(curves.usable_bytes / gb, color="tab:red", linestyle="--", label="usable budget")
    axes.axhline(curves.budget_bytes / gb, color="tab:red", linestyle=":", label="budget")
    for marker, label in ((BACKWARD_START, "backward"), (OPTIMIZER_STEP, "optimizer")):
        if marker in curves.phases:
            axes.axvline(curves.phases.index(marker), color="black", linewidth=0.5)
            axes.annotate(label, (curves.phases.index(marker), 0), xytext=(3, 3), textcoords="offset points", fontsize=8)
    axes.set_xlabel("phase of the training step (forward, backward, optimizer)")
    axes.set_ylabel("live memory (GB)")
    axes.set_title(f"{plan.model_name} on {plan.device}: memory over one training step")
    axes.set_ylim(bottom=0)
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
