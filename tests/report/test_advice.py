"""Advice, the per-rank FSDP estimate, the attention measure, the report and the memory plot."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

import autoplan
from autoplan.report.advice import Advice, advise, least_activation_choices, smallest_world_size
from autoplan.report.batch_steps import held_attention
from autoplan.memory.model import phase_bytes, predict_peak, sharded_peak, unit_windows
from autoplan.mesh import Mesh
from autoplan.plan import Choice, UnitDecision
from autoplan.errors import PlotUnavailable
from autoplan.report.plot import memory_curves, plot_memory
from autoplan.vocabulary.formatting import format_bytes
from autoplan.report.text import fold_units, format_report
from autoplan.vocabulary.tensors import unique_storage_bytes
from autoplan.units import CallSite, ModuleUnit, Segment, SequentialRun
from autoplan.vocabulary.names import unit_module
from tests.cli_factories import small_gpt, tiny_gpt, tiny_gpt_sdpa

BATCH, SEQ, HEADS = 4, 32, 2


def planned(factory=tiny_gpt, budget="1GB", seq_len=SEQ, **options):
    model, inputs = factory(batch_size=BATCH, seq_len=seq_len)
    profiles = []
    plan = autoplan.plan(model, budget, example_inputs=inputs, on_profile=profiles.append,
                         **({"device": "h100", "reserve": 0} | options))
    return model, plan, profiles[0]


@pytest.fixture(scope="module")
def loose():
    return planned()


@pytest.fixture(scope="module")
def tight(loose):
    _, plan, _ = loose
    return planned(budget=f"{plan.prediction.minimum_budget_bytes - 2**16}B")  # just under the floor


# -- what profile.py and memory.py add ----------------------------------------------------------


@pytest.mark.slow  # the whole pipeline
def test_attention_bytes_are_the_saved_softmax_probabilities(loose) -> None:
    model, _, profile = loose
    probabilities = BATCH * HEADS * SEQ * SEQ  # elements of one (B, heads, T, T) matrix
    unit = profile.units[0]
    assert unit.options[Choice("keep", "fp32")].attention_bytes == probabilities * 4
    # bf16 on the card: CUDA autocast runs softmax in fp32 (saved for its backward), and the matmul with
    # the values saves its own bf16 cast of the probabilities
    assert unit.options[Choice("keep", "bf16")].attention_bytes == probabilities * (4 + 2)
    assert unit.options[Choice("full", "fp32")].attention_bytes == 0
    _, _, fused = planned(tiny_gpt_sdpa)
    assert all(cost.attention_bytes == 0 for unit in fused.units for cost in unit.options.values())


def test_unit_parameter_bytes(loose) -> None:
    model, _, profile = loose
    for unit in profile.units:
        assert unit.param_bytes == unique_storage_bytes(list(unit_module(model, unit.unit).parameters())) > 0


@pytest.mark.slow  # the whole pipeline
def test_sharded_peak_on_one_gpu_is_the_single_gpu_prediction(loose, tight) -> None:
    for _, plan, profile in (loose, tight):
        assert sharded_peak(profile, plan.decisions.choices(), Mesh.fsdp(1)).total == predict_peak(profile, plan.decisions.choices()).bytes


def test_sharded_peak_shards_state_and_adds_gathered_units(loose) -> None:
    from autoplan.memory.sharded import GroupBytes

    _, plan, profile = loose
    static = profile.timeline.static
    # FSDP pads dim 0 to a multiple of N, so only divisors of the row counts shrink cleanly; from one
    # GPU to two the gathered root and buffers can outweigh halving the state of a model this small
    totals = [sharded_peak(profile, plan.decisions.choices(), Mesh.fsdp(n)).total for n in (2, 4, 8)]
    assert all(later < earlier for earlier, later in zip(totals, totals[1:]))
    four = sharded_peak(profile, plan.decisions.choices(), Mesh.fsdp(4))
    layouts = [u.param_layout for u in profile.units] + [profile.rest_param_layout]
    groups = [GroupBytes.of(layout, 4) for layout in layouts]
    assert four.parameters == sum(g.sharded for g in groups) + profile.buffer_bytes
    assert static.parameters / 4 <= four.parameters <= static.parameters / 4 + 512 * sum(map(len, layouts))
    # AdamW: two fp32 tensors per parameter are sharded; its step counters (one 512-byte block each) are not
    counters = 512 * sum(map(len, layouts))
    assert four.optimizer == 2 * sum(g.sharded for g in groups) + counters == 2 * sum(g.sharded for g in groups) + static.optimizer - 2 * sum(g.full for g in groups)
    # the root (embeddings, head) is always gathered; at most two units besides it
    root, largest_unit = groups[-1].unsharded, max(g.unsharded for g in groups[:-1])
    assert root <= four.gathered_parameters <= root + 2 * largest_unit
    with pytest.raises(ValueError):
        sharded_peak(profile, plan.decisions.choices(), Mesh.fsdp(0))


def test_smallest_world_size_is_the_smallest(tight) -> None:
    _, plan, profile = tight
    least = least_activation_choices(profile)
    advice = advise(plan, profile)
    usable = advice.usable_bytes  # what the budget leaves the allocated peak, the caching allocator's need beyond it taken off
    assert usable <= plan.request.usable_bytes
    found = smallest_world_size(profile, least, usable)
    assert found.world_size >= 2 and found.total <= usable
    assert sharded_peak(profile, least, Mesh.fsdp(found.world_size - 1)).total > usable
    assert advice.fsdp == found  # what the advice recommends


def test_least_activation_choices_keep_no_more_than_any_other(loose) -> None:
    _, _, profile = loose
    least = least_activation_choices(profile)
    for unit in profile.units:
        assert unit.options[least[unit.name]].held_bytes == min(cost.held_bytes for cost in unit.options.values())


# -- advice ---------------------------------------------------------------------------------------


def test_advice_for_a_plan_that_fits(loose) -> None:
    _, plan, profile = loose
    advice = advise(plan, profile, batch_size=BATCH, seq_len=SEQ)
    assert [s.key for s in advice.steps] == ["bf16", "tf32", "sdpa", "float8", "compile", "checkpointing", "offload", "grad_accumulation",
                                              "shorter_sequences", "optimizer_8bit", "qlora", "fsdp", "tensor-parallel"]
    assert advice.fits and advice.first_fix is None and advice.fsdp.world_size == 1
    assert advice.step("grad_accumulation").status == "n/a" and advice.step("fsdp").status == "n/a"
    assert advice.step("tensor-parallel").status == "n/a" and "not needed" in advice.step("tensor-parallel").detail
    state = profile.timeline.static.optimizer
    eight_bit = state - advice.step("optimizer_8bit").saves_bytes  # 2 of AdamW's 8 bytes a parameter, an fp32 absmax per 256
    assert eight_bit == state // 4 + 2 * 4 * -(-(state // 8) // 256)
    sdpa = advice.step("sdpa")
    phases = [sample.phase for sample in profile.timeline.phases]
    assert sdpa.status == "try" and sdpa.saves_bytes == held_attention(profile, plan.decisions.choices(), phases.index(plan.prediction.peak_phase))
    json.dumps(advice.to_dict())  # plain data


def test_held_attention_counts_keep_units_alive_at_a_phase(loose) -> None:
    _, plan, profile = loose
    windows = unit_windows(profile)
    first_backward = windows[-1][1]  # the last unit's backward: every unit's saved tensors are alive
    assert all(d.choice.mode == "keep" for d in plan.decisions.units)  # 1 GB: nothing needs checkpointing
    expected = sum(u.options[d.choice].attention_bytes for u, d in zip(profile.units, plan.decisions.units))
    assert held_attention(profile, plan.decisions.choices(), first_backward) == expected > 0
    assert held_attention(profile, plan.decisions.choices(), 0) == 0  # before any forward


def test_checkpointing_step_is_measured_against_keeping_everything(tight) -> None:
    _, plan, profile = tight
    advice = advise(plan, profile)
    step = advice.step("checkpointing")
    kept = {d.name: Choice("keep", d.choice.precision) for d in plan.decisions.units}
    assert step.status == "chosen" and step.saves_bytes == predict_peak(profile, kept).bytes - plan.prediction.peak_bytes > 0


@pytest.mark.slow  # the whole pipeline
def test_gradient_accumulation_is_verified_by_replanning() -> None:
    # the small GPT at 128 tokens: its activations, not the caching allocator's 2 MiB segments, decide what a micro-batch saves
    seq = 128
    _, roomy, _ = planned(small_gpt, seq_len=seq)
    _, plan, profile = planned(small_gpt, budget=f"{roomy.prediction.minimum_budget_bytes - 2**16}B", seq_len=seq)
    assert not plan.feasible
    calls = []

    def replan(micro, loop):
        calls.append(micro)
        assert loop == dataclasses.replace(plan.request.loop, accumulation_steps=BATCH // micro)  # the planned loop, accumulating
        model, inputs = small_gpt(batch_size=micro, seq_len=seq)
        return autoplan.plan(model, plan.request.budget_bytes, example_inputs=inputs, device="h100", reserve=0, loop=loop)

    advice = advise(plan, profile, batch_size=BATCH, seq_len=seq, replan=replan)
    step = advice.step("grad_accumulation")
    assert calls and all(BATCH % micro == 0 for micro in calls)
    assert step.status == "try" and f"verified by planning batch {calls[-1]} again in that loop: fits" in step.detail
    estimated = advise(plan, profile, batch_size=BATCH, seq_len=seq).step("grad_accumulation")
    assert "estimated: activations scale linearly" in estimated.detail
    assert advise(plan, profile, batch_size=1).step("grad_accumulation").status == "n/a"
    # the first fix's estimate fits what the allocator leaves the allocated peak (advice.usable_bytes, at most the plan's)
    assert advice.first_fix is not None and plan.prediction.peak_bytes - advice.step(advice.first_fix).saves_bytes <= advice.usable_bytes
    assert advice.usable_bytes <= plan.request.usable_bytes


def _run_snippet(code: str, batch) -> list:
    """Run an accumulation snippet on `batch` with a model that records what each call receives."""
    import torch
    from types import SimpleNamespace

    calls = []

    def model(*args, **kwargs):
        calls.append((args, kwargs))
        return SimpleNamespace(loss=torch.zeros((), requires_grad=True))

    optimizer = SimpleNamespace(step=lambda: None, zero_grad=lambda set_to_none: None)
    exec(code, {"model": model, "batch": batch, "optimizer": optimizer})
    return calls


def test_the_accumulation_snippet_splits_the_batch_the_plan_was_made_with(tight) -> None:
    """Issue 27: the snippet said `batch.split(2)` and `model(micro)` for a dict batch too. A dict batch
    (keyword arguments) is split key by key and passed as keywords; the snippet runs as printed."""
    import torch
    from autoplan.plan import Fingerprint

    _, plan, profile = tight
    tensor_code = advise(plan, profile, batch_size=BATCH, seq_len=SEQ).step("grad_accumulation").code
    assert plan.model.fingerprint.batch[0][0] == "argument 0" and "batch.split(" in tensor_code
    calls = _run_snippet(tensor_code, torch.zeros(BATCH, SEQ))
    assert sum(args[0].shape[0] for args, _ in calls) == BATCH and len(calls) > 1

    as_dict = dataclasses.replace(plan, model=dataclasses.replace(plan.model, fingerprint=Fingerprint(plan.model.fingerprint.parameters, (
        ("input_ids", f"{BATCH}×{SEQ} int64"), ("labels", f"{BATCH}×{SEQ} int64")))))
    dict_code = advise(as_dict, profile, batch_size=BATCH, seq_len=SEQ).step("grad_accumulation").code
    assert "batch.split" not in dict_code and "model(**micro)" in dict_code
    batch = {"input_ids": torch.arange(BATCH * SEQ).view(BATCH, SEQ), "labels": torch.ones(BATCH, SEQ)}
    calls = _run_snippet(dict_code, batch)
    assert len(calls) > 1 and all(not args and set(kwargs) == {"input_ids", "labels"} for args, kwargs in calls)
    assert torch.equal(torch.cat([kwargs["input_ids"] for _, kwargs in calls]), batch["input_ids"])


def test_the_qlora_snippet_loads_the_planned_class_with_its_auto_class(tight) -> None:
    """Issue 27: the QLoRA step's code said `AutoModel.from_pretrained(...)` whatever was planned (a causal
    LM loads with AutoModelForCausalLM); a model transformers does not load gets no snippet."""
    pytest.importorskip("transformers")
    _, plan, profile = tight
    for name, loader in (("Qwen2ForCausalLM", "AutoModelForCausalLM"), ("BertForSequenceClassification",
                                                                        "AutoModelForSequenceClassification")):
        code = advise(dataclasses.replace(plan, model=dataclasses.replace(plan.model, name=name)), profile).step("qlora").code
        assert code.startswith(f"model = {loader}.from_pretrained(CHECKPOINT, quantization_config=BitsAndBytesConfig(")
        assert "prepare_model_for_kbit_training(model)" in code
    assert advise(plan, profile).step("qlora").code == ""  # the tiny GPT is not a transformers model


def test_shorter_sequences_needs_a_length(tight) -> None:
    _, plan, profile = tight
    assert advise(plan, profile).step("shorter_sequences").status == "n/a"
    shorter = advise(plan, profile, seq_len=SEQ).step("shorter_sequences")
    assert shorter.status == "try" and f"instead of {SEQ}" in shorter.detail and shorter.saves_bytes > plan.prediction.peak_bytes - plan.request.usable_bytes


@pytest.mark.slow  # the whole pipeline
def test_device_dependent_steps() -> None:
    _, plan, profile = planned(device="t4", budget="1GB")
    advice = advise(plan, profile)
    assert advice.steps[0].key == "fp16" and "GradScaler" in advice.steps[0].title
    assert advice.step("tf32").status == "n/a" and "no TF32" in advice.step("tf32").detail
    _, plan, profile = planned(precision="fp32", optimizer="sgd")
    advice = advise(plan, profile)
    assert advice.steps[0].status == "n/a" and "--precision auto" in advice.steps[0].detail
    assert advice.step("optimizer_8bit").status == "n/a"


def test_advise_wants_a_plan_and_its_profile(loose) -> None:
    _, plan, _ = loose
    with pytest.raises(TypeError, match="autoplan.plan"):
        advise(plan, None)


def test_requested_world_size(loose) -> None:
    _, plan, profile = loose
    advice = advise(plan, profile, mesh=Mesh.fsdp(3))
    assert isinstance(advice, Advice) and advice.requested == sharded_peak(profile, plan.decisions.choices(), Mesh.fsdp(3))
    assert "FSDP estimate on 3 GPUs" in " ".join(format_report(plan, advice).split())


# -- report and plot -----------------------------------------------------------------------------


def test_plain_report_has_no_terminal_codes(loose) -> None:
    _, plan, _ = loose
    text = plan.report()
    assert "\x1b" not in text and text.startswith("FITS") and plan.model.name in text


def test_fold_units_folds_only_identical_numbered_runs() -> None:
    def unit(name, mode="keep"):
        return UnitDecision(ModuleUnit(name), Choice(mode, "bf16"), 10, 0, 1e-3)

    rows = fold_units((unit("layers.0"), unit("layers.1"), unit("layers.2"), unit("layers.3", "full"), unit("head")))
    assert [(r.label, r.count) for r in rows] == [("layers.0–2 ×3", 3), ("layers.3", 1), ("head", 1)]
    calls = [UnitDecision(CallSite("block", i), Choice("full", "bf16"), 10, 0, 1e-3) for i in range(3)]
    runs = [UnitDecision(unit_, Choice("full", "bf16"), 10, 0, 1e-3, members=members) for unit_, members in (
        (SequentialRun("features", 0, 2), ()), (SequentialRun("features", 2, 4), ()),
        (Segment("h.0", "h.1"), ("h.0", "h.1")), (Segment("h.2", "h.3"), ("h.2", "h.3")))]
    assert [(r.label, r.count) for r in fold_units((*calls, *runs))] == [
        ("block@0–2 ×3", 3), ("features[0:2]", 1), ("features[2:4]", 1), ("h.0–h.1 (segment)", 1), ("h.2–h.3 (segment)", 1)]


def test_memory_curves_are_the_solvers_numbers(tight) -> None:
    _, plan, profile = tight
    curves = memory_curves(plan, profile)
    assert max(curves.after) == plan.prediction.peak_bytes
    assert list(curves.after) == [p.live_bytes for p in phase_bytes(profile, plan.decisions.choices())]
    assert max(curves.before) == plan.prediction.baseline_peak_bytes
    assert len(curves.before) == len(curves.after) == len(curves.phases)


def test_plot_without_matplotlib(monkeypatch, tmp_path, tight) -> None:
    _, plan, profile = tight
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotUnavailable, match=r'pip install "autoplan\[plot\]"'):
        plot_memory(plan, profile, tmp_path / "m.png")


def test_plot_writes_png(tmp_path, tight) -> None:
    pytest.importorskip("matplotlib")
    _, plan, profile = tight
    path = plot_memory(plan, profile, tmp_path / "m.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=".png"):
        plot_memory(plan, profile, tmp_path / "m.txt")


def test_plot_reads_in_the_unit_that_fits_names_the_phases_and_keeps_the_legend_off_the_lines(monkeypatch, tmp_path, tight) -> None:
    """Issue 27: a plan of kilobytes plotted in GB read 0.000; the x axis had numbers, not phases; the
    no-plan curve vanished under the plan's where they coincide (the optimizer's step); the legend sat
    on the budget lines."""
    plt = pytest.importorskip("matplotlib.pyplot")
    _, plan, profile = tight
    figures = []
    monkeypatch.setattr(plt, "close", lambda figure=None: figures.append(figure))
    plot_memory(plan, profile, tmp_path / "m.png")
    (axes,) = figures[0].axes
    curves = memory_curves(plan, profile)
    top = max(*curves.before, *curves.after, plan.request.budget_bytes)
    unit = format_bytes(top).split()[1]  # the axis's top, in the unit the report says it in
    assert unit != "GB" and axes.get_ylabel() == f"live memory ({unit})"  # a tiny GPT's step: not 0.00x GB
    scale = {"KB": 1e3, "MB": 1e6}[unit]
    assert max(max(line.get_ydata()) for line in axes.get_lines()) == pytest.approx(top / scale)
    labels = [tick.get_text() for tick in axes.get_xticklabels()]
    assert labels == [str(phase) for phase in curves.phases] and "optimizer" in labels and "bwd:start" in labels
    no_plan = next(line for line in axes.get_lines() if line.get_label().startswith("no plan"))
    planned_line = next(line for line in axes.get_lines() if line.get_label() == "planned")
    assert no_plan.get_xdata()[-1] == len(curves.phases)  # drawn to the end of the step, through the optimizer's
    assert no_plan.get_linewidth() > planned_line.get_linewidth() and no_plan.get_zorder() <= planned_line.get_zorder()
    renderer = figures[0].canvas.get_renderer()
    legend, plot_area = axes.get_legend().get_window_extent(renderer), axes.get_window_extent(renderer)
    assert legend.x0 >= plot_area.x1  # beside the plot: on no line


def test_least_activation_choices_put_kept_bytes_first():
    # keep and full tie on kept + backward-peak bytes (as a 70B layer's do); full keeps nothing, and
    # kept bytes add up over every unit, so full must win though keep is faster.
    from types import SimpleNamespace

    from autoplan.profile.profiler import UnitCost, UnitProfile

    def cost(held, bwd, time_s):
        return UnitCost(fwd_peak_bytes=0, held_bytes=held, bwd_peak_bytes=bwd, fwd_time_s=time_s, bwd_time_s=0.0,
                        fwd_flops=0, bwd_flops=0)

    keep, full = Choice("keep", "fp32"), Choice("full", "fp32")
    unit = UnitProfile(ModuleUnit("layers.0"), {keep: cost(776, 2810, 1.0), full: cost(0, 3586, 2.0)}, keep)
    assert least_activation_choices(SimpleNamespace(units=(unit,))) == {"layers.0": full}


@pytest.mark.slow  # the whole pipeline
def test_compile_advice_makes_no_roofline_split_of_measured_times() -> None:
    """Measured CPU times against the CPU profile's guessed FLOP rate read as "0 s of memory traffic"."""
    import autoplan
    from tests.cli_factories import tiny_mlp

    model, inputs = tiny_mlp()
    profiles: list = []
    plan = autoplan.plan(model, "1GB", example_inputs=inputs, device="cpu", profile="measure", on_profile=profiles.append)
    step = advise(plan, profiles[0]).step("compile")
    assert plan.prediction.time_source.startswith("measured") and "roofline step is memory traffic" not in step.detail
    assert "measured" in step.detail and "not known" in step.detail


@pytest.mark.slow  # the whole pipeline
def test_low_precision_that_raises_the_peak_says_higher_and_is_not_recommended() -> None:
    """Under autocast each unit saves its weights' bf16 copies for backward; with small activations
    (a stacked RNN) that outweighs what bf16 saves. The step read "peaks -1.11 MB lower" and "try"."""
    from tests.structures import build_stacked_rnn

    model, x = build_stacked_rnn()
    profiles = []
    plan = autoplan.plan(model, "1GB", example_inputs=(x,), device="cpu", reserve=0, on_profile=profiles.append)
    step = advise(plan, profiles[0]).step("bf16")
    assert step.saves_bytes < 0, "this model no longer shows a higher bf16 peak: pick another"
    assert step.status == "n/a"
    assert f"peaks {format_bytes(-step.saves_bytes)} higher than in fp32" in step.detail and "-" not in step.detail.split("than")[0]


def test_the_tensor_parallel_rung_follows_fsdp() -> None:
    from examples.llama import Llama, LlamaConfig, example_batch
    from autoplan.report.fsdp_advice import tensor_parallel_step

    config = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    torch.manual_seed(0)
    model, batch = Llama(config), example_batch(config, 2, 32)
    options = dict(example_inputs=batch, device="cpu", reserve=0, profile="roofline", precision="fp32")
    split = autoplan.plan(model, "1GB", tensor_parallel=2, **options)
    chosen = tensor_parallel_step(split, None)
    assert chosen.status == "chosen" and "tensor parallel" in chosen.detail and "2 × cpu" in chosen.detail
    assert "sequence_parallel" not in chosen.detail  # it fits: nothing more to split
    over = tensor_parallel_step(autoplan.plan(model, "100KB", tensor_parallel=2, **options), None)
    assert "does not fit" in over.detail and "sequence_parallel=True" in over.detail
    over = tensor_parallel_step(autoplan.plan(model, "100KB", tensor_parallel=2, sequence_parallel=True, **options), None)
    assert "(sequence parallel)" in over.detail and "sequence_parallel=True" not in over.detail  # asked already
    short = autoplan.plan(model, "100KB", **options)  # nothing fits one rank
    tried = tensor_parallel_step(short, None)  # and FSDP alone would not either
    assert tried.status == "try" and tried.saves_bytes is None and "world_size=\"auto\"" in tried.code
