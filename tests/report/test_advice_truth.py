"""Advice that never contradicts the plan it sits under (issue 39): a step already taken is "chosen", a step that
does not apply says why, a step is "try" only with a prediction that it helps, the host budget that keeps offload
out is named, the ladder starts from the plan above it, and a guessed loss is said."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autoplan
from autoplan.cli.app import ladder_base
from autoplan.cli.exits import CliError
from autoplan.report.advice import advise
from autoplan.report.ladder import Ladder, Rung
from autoplan.vocabulary.formatting import format_bytes
from tests.cli_factories import tiny_gpt

BATCH, SEQ = 4, 32


def _planned(budget="1GB", **options):
    model, inputs = tiny_gpt(batch_size=BATCH, seq_len=SEQ)
    profiles = []
    plan = autoplan.plan(model, budget, example_inputs=inputs, on_profile=profiles.append, **({"device": "cpu", "reserve": 0} | options))
    return plan, profiles[0]


@pytest.fixture(scope="module")
def adamw_plan():
    return _planned()


def test_an_8bit_optimizer_already_planned_is_chosen_not_proposed():
    pytest.importorskip("bitsandbytes")
    for name in ("adamw8bit", "lion8bit"):
        plan, profile = _planned(optimizer=name)
        step = advise(plan, profile).step("optimizer_8bit")
        assert step.status == "chosen" and name in step.detail, (name, step)
        assert "--optimizer adamw8bit" not in step.detail


def test_an_optimizer_without_an_8bit_twin_gets_no_adamw_formula():
    plan, profile = _planned(optimizer="sgd-momentum")
    step = advise(plan, profile).step("optimizer_8bit")
    assert step.status == "n/a" and step.saves_bytes is None and "sgd-momentum" in step.detail


def test_adamw_gets_the_8bit_formula(adamw_plan):
    plan, profile = adamw_plan
    step = advise(plan, profile).step("optimizer_8bit")
    assert step.status == "try" and step.saves_bytes > 0 and "--optimizer adamw8bit" in step.detail


def test_qlora_is_not_offered_for_a_model_transformers_does_not_load(adamw_plan):
    pytest.importorskip("transformers")  # a transformers model has imported it: loader_class reads it only then
    plan, profile = adamw_plan  # the tiny GPT is a plain nn.Module
    step = advise(plan, profile).step("qlora")
    assert step.status == "n/a" and step.saves_bytes is None and "not a model transformers loads" in step.detail
    named = dataclasses.replace(plan, model=dataclasses.replace(plan.model, name="LlamaForCausalLM"))
    assert advise(named, profile).step("qlora").status == "try"
    peft_named = dataclasses.replace(plan, model=dataclasses.replace(plan.model, name="PeftModelForCausalLM"))
    assert advise(peft_named, profile).step("qlora").status == "n/a"


def _ladder_with_qlora(plan, peak_bytes: int, step_time_s: float, fits: bool) -> Ladder:
    rung = Rung("qlora", "+ 4-bit QLoRA (NF4, r=16)", peak_bytes, step_time_s, fits, "planned", "model = ...")
    return Ladder((rung,), plan.request.budget_bytes, plan.request.usable_bytes, "cpu", "qlora" if fits else None, "")


def test_a_planned_qlora_rung_is_tried_only_where_it_helps(adamw_plan):
    """Issue 39: a FITS plan's QLoRA step read '[try] peak +14.3 MB' beside 'saves about 1.93 GB'. Two plans that fit
    both fill the budget: a rung helps a fitting plan only by a faster step, one that does not fit by a lower peak."""
    pytest.importorskip("transformers")
    plan, profile = adamw_plan
    named = dataclasses.replace(plan, model=dataclasses.replace(plan.model, name="LlamaForCausalLM"))
    peak, time = plan.prediction.peak_bytes, plan.prediction.step_time_s
    higher_and_slower = advise(named, profile, ladder=_ladder_with_qlora(plan, peak + 2**20, time * 2, True)).step("qlora")
    assert higher_and_slower.status == "n/a" and "no help here" in higher_and_slower.detail
    assert "saves about" not in higher_and_slower.detail  # no formula beside a plan that says otherwise
    faster = advise(named, profile, ladder=_ladder_with_qlora(plan, peak + 2**20, time / 2, True)).step("qlora")
    assert faster.status == "try"
    over = dataclasses.replace(named, outcome=dataclasses.replace(named.outcome, feasible=False))
    assert advise(over, profile, ladder=_ladder_with_qlora(plan, peak - 2**20, time * 2, False)).step("qlora").status == "try"
    assert advise(over, profile, ladder=_ladder_with_qlora(plan, peak + 2**20, time / 2, False)).step("qlora").status == "n/a"


@pytest.mark.slow  # the whole pipeline, twelve blocks on a GPU target
def test_a_host_budget_that_keeps_offload_out_is_named_with_the_bytes_it_needs():
    """Issue 39: at a budget only offload reaches, a host budget of 0 B made DOES NOT FIT with 'allowed, not chosen'."""
    from tests.axes.test_placement import BETWEEN_FLOORS, _deep_net

    model, x = _deep_net()
    profiles = []
    plan = autoplan.plan(model, BETWEEN_FLOORS, example_inputs=(x,), device="rtx-4090", precision="fp32", reserve=0,
                         host_budget=0, on_profile=profiles.append)
    assert not plan.outcome.feasible  # offload alone reaches this budget (tests/axes/test_placement.py)
    advice = advise(plan, profiles[0])
    step = advice.step("offload")
    assert step.status == "try" and step.saves_bytes > 0 and "host budget (0 B) keeps it out" in step.detail, step
    assert "which fits the" in step.detail and "--host-budget" in step.detail and "host_budget=" in step.code
    assert advice.first_fix == "offload"


def test_the_ladder_refuses_peft_and_quantized_models_before_planning_and_takes_real_weights():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=32)
    real = transformers.LlamaForCausalLM(config)
    base = ladder_base(real, "factory")
    assert all(p.is_meta for p in base.parameters()) and type(base) is type(real)
    assert {n: p.shape for n, p in base.named_parameters()} == {n: p.shape for n, p in real.named_parameters()}
    adapted = peft.get_peft_model(real, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(CliError, match="already has adapters"):
        ladder_base(adapted, "factory")
    with pytest.raises(CliError, match="takes a Hugging Face model"):
        ladder_base(torch.nn.Linear(2, 2), "factory")


class _Logits(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))

    def forward(self, x):
        return self.layers(x)


def test_a_guessed_loss_is_said_in_the_notes():
    x = torch.randn(8, 16)
    guessed = autoplan.plan(_Logits(), "1GB", example_inputs=(x,), device="cpu")
    assert any("no loss_fn was given" in note for note in guessed.notes)
    given = autoplan.plan(_Logits(), "1GB", example_inputs=(x,), device="cpu", loss_fn=lambda out: out.pow(2).mean())
    assert not any("no loss_fn was given" in note for note in given.notes)


def test_the_host_bytes_advised_are_a_host_budget_the_option_reads():
    from autoplan.inputs.settings import host_budget_bytes
    wanted = 123_456_789
    assert host_budget_bytes(format_bytes(wanted).replace(" ", "")) >= wanted * 0.99
