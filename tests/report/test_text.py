"""The text report: every number in human units, and a plan that cannot fit because of its state says so first.

Small GPTs from examples/gpt.py planned for the h100-80gb profile (the optimizer's foreach
temporaries are counted there) with no reserve, on fake tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest

import autoplan
from autoplan.report.advice import advise, state_bound
from autoplan.report.text import format_report
from autoplan.report.trainer import measured_peak_line
from autoplan.vocabulary.formatting import format_bytes
from examples.gpt import build
from tests.cli_factories import convmixer

SCIENTIFIC = re.compile(r"\d[eE][+-]?\d")  # 4.17e+03
THOUSANDS = re.compile(r"\d,\d{3}")  # 31,336.1
UNIT_TABLE = re.compile(r"^units\b|┃ mode ┃", re.MULTILINE)  # the units table's title or header


@functools.cache
def state_heavy_gpt():
    """A batch of one 4-token sequence: weights, gradients and AdamW state dwarf the activations."""
    return build(n_layer=2, n_embd=64, n_head=2, block_size=16, vocab_size=256, batch_size=1, seq_len=4)


@functools.cache
def roomy_plan() -> autoplan.Plan:
    model, inputs = state_heavy_gpt()
    return autoplan.plan(model, "1GB", example_inputs=inputs, device="h100", reserve=0)


def plan_at(budget: int) -> autoplan.Plan:
    model, inputs = state_heavy_gpt()
    return autoplan.plan(model, budget, example_inputs=inputs, device="h100", reserve=0)


@pytest.mark.slow  # the whole pipeline
def test_every_number_reads_in_human_units_at_any_scale() -> None:
    plan = roomy_plan()
    # the same plan as if it ran a model a million times larger: seconds and TFLOP, not 1e+03 ms and 1,000 GFLOP
    scaled = dataclasses.replace(
        plan,
        prediction=dataclasses.replace(plan.prediction, step_time_s=4.17, fastest_step_time_s=3.9, baseline_step_time_s=125.0),
        decisions=dataclasses.replace(plan.decisions, units=tuple(
            dataclasses.replace(u, choice=dataclasses.replace(u.choice, mode="full"), recompute_flops=31_336_100_000_000,
                                step_time_s=0.0000173) for u in plan.decisions.units)),
    )
    for report in (format_report(plan), format_report(scaled)):
        assert not SCIENTIFIC.search(report), report
        assert not THOUSANDS.search(report), report
        assert "GFLOP each" not in report
    assert "step time (roofline): 4.17 s planned, 3.90 s for the fastest plan" in format_report(scaled)
    assert "2 min 5 s with no plan" in " ".join(format_report(scaled).split())
    assert "31.3 TFLOP" in format_report(scaled) and "17.3 µs" in format_report(scaled)


@pytest.mark.slow  # the whole pipeline
def test_state_alone_over_the_budget_opens_the_report_with_that_and_no_unit_table() -> None:
    plan = plan_at(roomy_plan().model.state_bytes // 2)
    report = format_report(plan, width=400)  # one line per paragraph
    first = report.splitlines()[0]
    assert first.startswith("DOES NOT FIT")
    assert f"parameters, gradients and adamw state alone are {format_bytes(plan.model.state_bytes)}" in first
    assert "no checkpointing or precision choice changes that" in first
    assert not UNIT_TABLE.search(report) and "step time" not in report  # no table of arbitrary tied choices
    assert "memory at the peak" in report  # where the bytes are still says why
    assert state_bound(plan).step_bytes == 0


@pytest.mark.slow  # the whole pipeline
def test_a_peak_in_optimizer_step_says_its_temporaries_are_why() -> None:
    roomy = roomy_plan()
    model, inputs = state_heavy_gpt()
    profiles = []
    plan = autoplan.plan(model, (roomy.model.state_bytes + roomy.prediction.minimum_peak_bytes) // 2, example_inputs=inputs, device="h100",
                         reserve=0, on_profile=profiles.append)  # the state fits, its optimizer step does not
    assert not plan.outcome.feasible and plan.prediction.peak_phase.kind == "step"
    bound = state_bound(plan)
    assert bound.state_bytes + bound.step_bytes + bound.workspace_bytes == plan.prediction.breakdown.total
    assert bound.workspace_bytes == plan.prediction.breakdown.workspaces > 0  # an H100 target: cuBLAS's, named apart
    first = format_report(plan, width=400).splitlines()[0]
    assert "optimizer.step()'s temporaries" in first and "no checkpointing or precision choice changes that" in first
    assert "cuBLAS's workspaces" in first
    assert not UNIT_TABLE.search(format_report(plan))
    # the advice does not advise on the units' choices either, but on the state
    advice = advise(plan, profiles[0])
    assert advice.step("checkpointing").status == "n/a" and "no help here" in advice.step("checkpointing").detail
    assert advice.step("bf16").status == "n/a"
    assert advice.step("optimizer_8bit").status == "try"


@pytest.mark.slow  # the whole pipeline
def test_a_plan_short_of_activation_memory_still_shows_its_units() -> None:
    model, inputs = build(n_layer=2, n_embd=32, n_head=2, block_size=64, vocab_size=64, batch_size=4, seq_len=32)
    lowest = autoplan.plan(model, "1GB", example_inputs=inputs, device="h100", reserve=0).prediction.minimum_peak_bytes
    plan = autoplan.plan(model, lowest - 2**16, example_inputs=inputs, device="h100", reserve=0)
    assert not plan.outcome.feasible and state_bound(plan) is None
    report = format_report(plan)
    assert "the lowest peak autoplan reaches is" in report.splitlines()[0]
    assert "units (the lowest-peak choices)" in report


def test_measured_peak_line_compares_with_the_prediction() -> None:
    plan = roomy_plan()
    line = measured_peak_line(plan, plan.prediction.peak_bytes * 11 // 10, step=2)
    assert "step 2 peaked at" in line and "+10.0%" in line and "within the usable budget" in line
    over = measured_peak_line(dataclasses.replace(plan, request=dataclasses.replace(plan.request, usable_bytes=plan.prediction.peak_bytes)), plan.prediction.peak_bytes * 2, 2)
    assert "OVER the usable budget" in over


def test_a_plain_text_report_is_120_columns_or_what_columns_says(monkeypatch) -> None:
    # issue 39: a report not written to a terminal was narrower than its tables (80 columns on the command line)
    monkeypatch.delenv("COLUMNS", raising=False)
    plan = roomy_plan()
    widest = max(len(line) for line in format_report(plan).splitlines() if "━" not in line)
    assert 80 < widest <= 120
    monkeypatch.setenv("COLUMNS", "70")
    assert max(len(line) for line in format_report(plan, with_code=False).splitlines()) <= 70
    assert max(len(line) for line in format_report(plan, width=400).splitlines()) > 120  # a width given is kept


def test_the_recompute_column_says_what_is_rerun() -> None:
    """Keep mode reruns nothing; a policy that reruns only norms and casts reruns no FLOPs, not "0 FLOP" of work."""
    plan = roomy_plan()
    keep, = {u.choice for u in plan.decisions.units}
    full = tuple(dataclasses.replace(u, choice=dataclasses.replace(u.choice, mode="selective"), recompute_flops=0) for u in plan.decisions.units)
    assert keep.mode == "keep" and "0 FLOP" not in format_report(plan)
    assert "no FLOPs" in format_report(dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, units=full)))


def _bytes_in_row(report: str, label: str) -> str:
    row = next(line for line in report.splitlines() if line.lstrip().startswith(label))
    return row.split("│")[1].strip()


@pytest.mark.slow  # the whole pipeline
def test_the_breakdowns_predicted_peak_row_is_the_headlines_number() -> None:
    """The headline's predicted peak is the higher of the memory model's and the simulated step's; the
    breakdown's parts are the model's at its peak. Where the simulation is higher, a row says by how much,
    and the rows add up to the headline (issue 27 item 6). This ConvMixer, planned with checkpointing, was
    such a case by 1 KB until a unit's profile stopped counting its harness's backward root (issue 36): it is
    exact now, so the simulation's excess is set on its plan."""
    model, inputs = convmixer()
    plan = autoplan.plan(model, "700KB", example_inputs=inputs, reserve=0)
    assert plan.prediction.peak_bytes == plan.prediction.breakdown.total  # model and simulation agree: no such row
    assert "simulated step above the memory model" not in format_report(plan, width=200)
    above = 1024
    plan = dataclasses.replace(plan, prediction=dataclasses.replace(plan.prediction, peak_bytes=plan.prediction.peak_bytes + above))
    report = format_report(plan, width=200)
    headline = format_bytes(plan.prediction.peak_bytes)
    assert f"predicted peak {headline} of" in report.splitlines()[0]
    assert _bytes_in_row(report, "= predicted peak") == headline
    assert _bytes_in_row(report, "simulated step above the memory model") == format_bytes(above)


@pytest.mark.slow  # two plans of a transformers model
def test_a_cpu_plan_that_chose_bf16_says_so_by_the_headline_and_how_to_keep_fp32() -> None:
    pytest.importorskip("transformers")
    from tests import families

    family = families.BY_NAME["Llama"]
    planner = autoplan.Planner(family.build(), batch_size=families.BATCH, seq_len=families.SEQ, device="cpu", reserve=0)
    tight = planner.plan(planner.plan("1GB").prediction.minimum_peak_bytes + 1000)  # the floor needs bf16 units
    low = [unit.name for unit in tight.decisions.units if unit.choice.precision == "bf16"]
    assert low and tight.notes[0].startswith(f"precision: {len(low)} of ")
    head = tight.report().split("memory at the peak")[0]
    assert "numerics are bf16's, not fp32's; precision='fp32' (--precision fp32) keeps fp32" in head.replace("\n", " ")
    assert "note: precision:" not in tight.report()  # said once, by the headline
    forced = autoplan.Planner(family.build(), batch_size=families.BATCH, seq_len=families.SEQ, device="cpu",
                              precision="bf16").plan("1GB")
    assert not any(note.startswith("precision: ") for note in forced.notes)  # asked for: nothing to warn of
