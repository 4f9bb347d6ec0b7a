"""The Plan's shape: parts by concern, a flat JSON schema that loses none of their fields, the fused loss
head as a flag plus the logits it names, and a report (`autoplan.format_report`, `plan.report()`) that needs nothing
imported first."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.axes.placement import HostMemory
from autoplan.errors import OptionError
from autoplan.inputs.loop import TrainingLoop
from autoplan.mesh import Mesh
from autoplan.plan import (
    FORWARD_START,
    Choice,
    Decisions,
    DeviceTarget,
    Fingerprint,
    MemoryBreakdown,
    Outcome,
    Plan,
    PlannedModel,
    Prediction,
    Request,
    UnitDecision,
    WorldSizePoint,
)
from autoplan.units import Unit

ROOT = Path(__file__).resolve().parent.parent

# every field of every part, and the key of the flat JSON schema (docs/api.md) that holds it
JSON_KEYS = {
    ("request", "budget_bytes"): "budget_bytes", ("request", "usable_bytes"): "usable_bytes",
    ("request", "context_bytes"): "context_bytes", ("request", "context_source"): "context_source",
    ("request", "optimizer"): "optimizer", ("request", "mesh"): "world_size", ("request", "loop"): "loop",
    ("request", "host"): "host_budget_bytes", ("request", "arguments"): "request",
    ("model", "name"): "model_name", ("model", "trace_method"): "trace_method", ("model", "parameter_count"): "parameter_count",
    ("model", "state_bytes"): "state_bytes", ("model", "fingerprint"): "fingerprint", ("model", "batch_values"): "batch_values",
    ("model", "random_control_flow"): "random_control_flow", ("model", "moe_routing"): "moe_routing",
    ("target", "device"): "device", ("target", "low_precision"): "low_precision", ("target", "needs_grad_scaler"): "needs_grad_scaler",
    ("decisions", "units"): "units", ("decisions", "rest_precision"): "rest_precision",
    ("decisions", "fused_loss"): "fused_loss", ("decisions", "fused_logits"): "fused_loss_logits",
    ("prediction", "peak_bytes"): "predicted_peak_bytes", ("prediction", "simulated_peak_bytes"): "simulated_peak_bytes",
    ("prediction", "baseline_peak_bytes"): "baseline_peak_bytes", ("prediction", "minimum_peak_bytes"): "minimum_peak_bytes",
    ("prediction", "minimum_budget_bytes"): "minimum_budget_bytes", ("prediction", "breakdown"): "breakdown",
    ("prediction", "peak_phase"): "peak_phase", ("prediction", "step_time_s"): "predicted_step_time_s",
    ("prediction", "baseline_step_time_s"): "baseline_step_time_s", ("prediction", "fastest_step_time_s"): "fastest_step_time_s",
    ("prediction", "time_source"): "time_source", ("prediction", "fsdp"): "fsdp", ("prediction", "world_size_curve"): "world_size_curve",
    ("prediction", "host_peak_bytes"): "host_peak_bytes", ("prediction", "simulated_host_peak_bytes"): "simulated_host_peak_bytes",
    ("prediction", "reserved_peak_bytes"): "reserved_peak_bytes",
    ("prediction", "least_limit_bytes"): "least_limit_bytes",
    ("outcome", "feasible"): "feasible", ("outcome", "solver_status"): "solver_status", ("outcome", "solve_time_s"): "solve_time_s",
    ("outcome", "resolves"): "resolves", ("outcome", "decided_by"): "decided_by",
}
# keys a field fills besides its own: the request's host memory says whether offload was allowed at all, its mesh how FSDP reshards
DERIVED_KEYS = {"offload": ("request", "host"), "reshard_after_forward": ("request", "mesh"), "fsdp_mixed_precision": ("request", "mesh"),
                "tensor_parallel": ("request", "mesh"), "tensor_parallel_layout": ("request", "mesh"), "sequence_parallel": ("request", "mesh")}
PARTS = ("request", "model", "target", "decisions", "prediction", "outcome")


def by_hand(fused: bool = True) -> Plan:
    """A plan built field by field, every field away from its default, so none can hide behind one."""
    unit = UnitDecision(Unit.from_name("blocks.0"), Choice("full", "bf16"), saved_bytes=64, recompute_flops=1000, step_time_s=0.5)
    return Plan(
        request=Request(budget_bytes=2000, usable_bytes=1500, optimizer="sgd", mesh=Mesh.fsdp(2), loop=TrainingLoop(keep_outputs=False),
                        host=HostMemory(4096, 32e9), arguments=(("budget", "2000B"), ("device", "cpu"))),
        model=PlannedModel("Net", "export", parameter_count=12, state_bytes=144,
                           fingerprint=Fingerprint((("fc.weight", "2×2 float32"),), (("argument 0", "8×2 float32"),)),
                           batch_values=("input_ids",), random_control_flow=True, moe_routing="worst case"),
        target=DeviceTarget("cpu", "bf16", needs_grad_scaler=True),
        decisions=Decisions((unit,), rest_precision="bf16", fused_loss=fused, fused_logits="8×32 logits" if fused else ""),
        prediction=Prediction(
            peak_bytes=1000, simulated_peak_bytes=990, baseline_peak_bytes=1800, minimum_peak_bytes=700, minimum_budget_bytes=800,
            breakdown=MemoryBreakdown(100, 200, 300, 250, 150), peak_phase=FORWARD_START, step_time_s=1.5,
            baseline_step_time_s=1.0, fastest_step_time_s=0.9, time_source="roofline",
            world_size_curve=(WorldSizePoint(2, 700, 1800, True),), host_peak_bytes=32, simulated_host_peak_bytes=33,
            reserved_peak_bytes=1100, least_limit_bytes=1050,
        ),
        outcome=Outcome(True, "Optimal", 0.25, resolves=2),
        notes=("a note",),
    )


def test_every_field_of_every_part_is_in_the_json_schema():
    plan = by_hand()
    fields = {(part, field.name) for part in PARTS for field in dataclasses.fields(getattr(plan, part))}
    assert fields == set(JSON_KEYS), fields ^ set(JSON_KEYS)
    data = plan.to_dict()
    assert set(data) == set(JSON_KEYS.values()) | set(DERIVED_KEYS) | {"notes"}
    assert (data["offload"], data["world_size"], data["host_budget_bytes"]) == (True, 2, 4096)
    assert (plan.request.offload, plan.request.world_size, plan.request.host_budget_bytes) == (True, 2, 4096)
    plain = {"loop": dataclasses.asdict(plan.request.loop), "request": {"budget": "2000B", "device": "cpu"},
             "world_size": plan.request.mesh.size, "host_budget_bytes": plan.request.host_budget_bytes,
             "fingerprint": plan.model.fingerprint.to_dict(), "breakdown": dataclasses.asdict(plan.prediction.breakdown) | {"total": 1000},
             "peak_phase": "fwd:start", "units": data["units"], "batch_values": ["input_ids"],
             "world_size_curve": [{"world_size": 2, "lowest_peak_bytes": 700, "no_plan_peak_bytes": 1800, "fits": True}]}
    for (part, name), key in JSON_KEYS.items():
        assert data[key] == plain.get(key, getattr(getattr(plan, part), name)), key
    assert data["units"] == [{"name": "blocks.0", "mode": "full", "precision": "bf16", "saves": None, "placement": "device",
                              "saved_bytes": 64, "recompute_flops": 1000, "step_time_s": 0.5, "policy": "", "policy_summary": "",
                              "host_bytes": 0, "transfer_s": 0.0, "exposed_transfer_s": 0.0, "members": []}]
    assert json.loads(plan.to_json()) == data  # plain JSON, back to the same dict


def test_the_shortcuts_read_the_parts():
    plan = by_hand()
    assert plan.feasible is plan.outcome.feasible is True
    assert plan.units == plan.decisions.units and plan.predicted_peak_bytes == plan.prediction.peak_bytes == 1000
    assert plan.decisions.choices() == {"blocks.0": Choice("full", "bf16")} == plan.decisions.unit_choices()
    assert plan.decisions.choices_by_unit() == {Unit.from_name("blocks.0"): Choice("full", "bf16")}


def test_the_fused_loss_head_is_a_flag_with_its_logits_beside_it():
    fused, written = by_hand(fused=True), by_hand(fused=False)
    assert fused.decisions.fused_loss is True and fused.decisions.fused_logits == "8×32 logits"
    assert written.decisions.fused_loss is False and written.decisions.fused_logits == ""
    assert fused.decisions.outside_units.fused_loss is True and written.decisions.outside_units.fused_loss is False
    assert (fused.to_dict()["fused_loss"], fused.to_dict()["fused_loss_logits"]) == (True, "8×32 logits")
    assert (written.to_dict()["fused_loss"], written.to_dict()["fused_loss_logits"]) == (False, "")
    with pytest.raises(OptionError, match="fused_loss is False"):
        Decisions((), fused_loss=False, fused_logits="8×32 logits")


@pytest.mark.parametrize("written, named", [
    (dict(mode="half"), "unknown checkpoint mode 'half'"),
    (dict(precision="fp8"), "unknown precision 'fp8'"),
    (dict(mode="full", saves=("mm",)), "only selective mode names the ops it saves"),
    (dict(placement="disk"), "unknown placement 'disk'"),
    (dict(mode="selective", placement="host"), "only keep and full units can offload"),
])
def test_a_hand_written_choice_that_cannot_be_is_autoplans_option_error(written, named):
    """A user's mistake in a hand-written Choice is an OptionError (the CLI's exit 2), still a ValueError."""
    with pytest.raises(OptionError, match=named) as refused:
        Choice(**written)
    assert isinstance(refused.value, ValueError)


@pytest.mark.slow  # the whole pipeline
def test_report_needs_nothing_imported_first():
    """No formatter registered at import: a fresh interpreter that imports only the vocabulary can report a plan
    made by hand with autoplan.format_report, and `report()` of the plan autoplan hands out is that report."""
    script = (
        "import sys\n"
        "import autoplan\n"
        "from tests.test_plan import by_hand\n"
        "assert 'autoplan.report.text' not in sys.modules, sorted(m for m in sys.modules if m.startswith('autoplan'))\n"
        "from autoplan.report.reported import reported\n"
        "assert reported(by_hand()).report() == autoplan.format_report(by_hand()) and reported(by_hand()) == reported(by_hand())\n"
        "print(autoplan.format_report(by_hand()))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("FITS  Net on 2 × cpu (per rank, FSDP): predicted peak 1.00 KB of 1.50 KB usable")
    assert "loss: the output head's cross-entropy (8×32 logits) is fused" in done.stdout
    assert "training loop: outputs dropped before backward" in done.stdout
