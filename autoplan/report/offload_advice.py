"""The advice's offload step: what holding saved activations in pinned host memory did for this plan."""

from __future__ import annotations

import dataclasses

from autoplan.memory.model import predict_peak, predict_step_time
from autoplan.plan import Plan
from autoplan.profile.profiler import Profile
from autoplan.report.batch_steps import Step
from autoplan.vocabulary.formatting import format_bytes, format_seconds

TITLE = "activation offload to host memory (autoplan's choice per unit)"


def offload_step(plan: Plan, profile: Profile) -> Step:
    """Chosen: how much higher the same choices peak on the device, and the copies' cost; else why not."""
    if not plan.request.offload:
        why = ("the target is the CPU: activations are in host memory already" if profile.device.host_bandwidth <= 0
               else "turned off (offload=False, --no-offload)" if plan.request.world_size == 1 else "off with FSDP (world_size > 1)")
        return Step("offload", TITLE, "n/a", why)
    chosen = plan.decisions.unit_choices()
    offloaded = [d for d in plan.decisions.units if d.choice.offloaded]
    if not offloaded:
        blocked = None if plan.outcome.feasible else _blocked_by_host_budget(plan, profile)
        if blocked is not None:
            return blocked
        detail = ("allowed, not chosen: the fastest plan that fits keeps every saved tensor on the device" if plan.outcome.feasible
                  else "allowed, not chosen: the lowest peak keeps every saved tensor on the device")
        return Step("offload", TITLE, "n/a", detail)
    on_device = {name: dataclasses.replace(c, placement="device") for name, c in chosen.items()}
    saves = predict_peak(profile, on_device).bytes - plan.prediction.peak_bytes
    cost = plan.prediction.step_time_s - predict_step_time(profile, on_device)
    transfer, exposed = plan.decisions.transfer_s, plan.decisions.exposed_transfer_s
    detail = (f"{len(offloaded)} of {len(plan.decisions.units)} units hold {format_bytes(plan.prediction.host_peak_bytes)} in pinned host memory "
              f"(host budget {format_bytes(plan.request.host_budget_bytes)}); with them on the device the same choices peak "
              f"{format_bytes(saves)} higher. Their copies take {format_seconds(transfer)} over the "
              f"{profile.device.host_bandwidth / 1e9:g} GB/s host link, {format_seconds(exposed)} of it not hidden by compute")
    return Step("offload", TITLE, "chosen", detail, saves, cost, "model = autoplan.optimize(model, budget, example_inputs=batch)")


def _blocked_by_host_budget(plan: Plan, profile: Profile) -> Step | None:
    """Where nothing fits and the host budget is what kept offload out: every unit checkpointed with its inputs in host
    memory (as transformers' offload=True does by hand), its device peak and the host bytes it needs; None where that
    would not lower the peak, or the host budget would hold it (then it is not the host budget that blocks)."""
    choices, host = {}, 0
    for unit in profile.units:
        hosted = [c for c in unit.options if c.offloaded and c.mode == "full"]
        if not hosted:
            return None
        choice = min(hosted, key=lambda c: (unit.options[c].held_bytes, unit.options[c].bwd_peak_bytes, unit.options[c].time_s))
        choices[unit.name], host = choice, host + unit.options[choice].host_bytes
    peak = predict_peak(profile, choices).bytes
    if host <= plan.request.host_budget_bytes or peak >= plan.prediction.peak_bytes:
        return None
    fits = "fits" if peak <= plan.request.usable_bytes else "is still over"
    detail = (f"the host budget ({format_bytes(plan.request.host_budget_bytes)}) keeps it out: checkpointing every unit with its "
              f"inputs in pinned host memory would peak about {format_bytes(peak)} on the device, which {fits} the "
              f"{format_bytes(plan.request.usable_bytes)} usable, and hold {format_bytes(host)} on the host; allow that much "
              f"(--host-budget, host_budget=)")
    return Step("offload", TITLE, "try", detail, plan.prediction.peak_bytes - peak, None,
                f"model = autoplan.optimize(model, budget, example_inputs=batch, host_budget=\"{format_bytes(host).replace(' ', '')}\")")
