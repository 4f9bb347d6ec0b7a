"""Mixture-of-experts routing that decides shapes, planned as a bound (`autoplan/instruments/routing.py`).

A MoE layer written the common eager way (per expert `torch.where(mask[e])`, a gather, `index_add_`)
has shapes that depend on the routing. autoplan profiles it at the worst case (every expert receives
every token), or at `moe_capacity` × tokens × top_k / experts tokens per expert. Measured on the CPU
by `autoplan.verify` (the live-bytes tracker, real steps): the worst-case plan holds for skewed and spread
routing; a capacity plan holds for routing within it (and the note's warning is real: routing above
it peaks higher); the planned model trains like the original (fp32: loss, gradients, buffers).
"""

from __future__ import annotations

import copy
import json

import pytest

import autoplan
from autoplan.errors import OptionError
from autoplan.instruments.routing import WORST_CASE, MoeRoutingBound, RouterShape
from tests.halfway import halfway_budget
from tests.structures import Structure, _MOE, _hf, _tokens, build_eager_moe, build_residual_list
from tests.end_to_end.test_plan_space import assert_trains_the_same


def _plan(model, inputs, budget="1GB", **options) -> autoplan.Plan:
    return autoplan.plan(model, budget, example_inputs=inputs, device="cpu", precision="fp32", reserve=0, **options)


def _measured(model, plan, inputs) -> int:
    """The live tensor bytes of real steps of `model` (a copy) rewritten with `plan` (autoplan.verify on the CPU)."""
    return autoplan.verify(copy.deepcopy(model), plan, example_inputs=inputs, steps=2).measured_peak_bytes


def _routed(model, *experts):
    routed = copy.deepcopy(model)
    routed.route_all_to(*experts)
    return routed


@pytest.fixture(scope="module")
def worst_case():
    model, inputs = build_eager_moe()
    # one level, the layers: the experts level costs as much again; profiled once for both budgets
    planner = autoplan.Planner(model, example_inputs=inputs, device="cpu", precision="fp32", reserve=0, units=["layers.*"])
    free = planner.plan("1GB")
    tight = planner.plan(halfway_budget(free))
    return model, inputs, free, tight


@pytest.mark.slow  # the whole pipeline
def test_worst_case_plan_holds_for_skewed_and_spread_routing(worst_case):
    model, inputs, free, tight = worst_case
    assert free.model.moe_routing == tight.model.moe_routing == "worst case"
    assert any("worst case, every expert receiving all 64 tokens" in note for note in tight.notes)
    assert tight.outcome.feasible and any(unit.choice.checkpointed for unit in tight.decisions.units)
    # the tight plan as built (every expert gets some tokens) and with every token sent to experts 0 and 1; no checkpointing, skewed
    for routed, plan in ((model, tight), (_routed(model, 0, 1), tight), (_routed(model, 0, 1), free)):
        measured = _measured(routed, plan, inputs)
        assert measured <= plan.prediction.simulated_peak_bytes and measured <= plan.prediction.peak_bytes, (measured, plan.prediction.simulated_peak_bytes)


def test_worst_case_plan_trains_like_the_original(worst_case):
    _, _, _, tight = worst_case
    assert_trains_the_same(Structure("eager MoE", build_eager_moe, lambda m: list(m.layers)), tight)


@pytest.mark.slow  # the whole pipeline
def test_a_capacity_plans_that_many_tokens_per_expert_and_holds_within_it(worst_case):
    _, _, worst, _ = worst_case
    model, inputs = build_eager_moe(balanced=True)  # exactly 64 × 2 / 4 = 32 tokens per expert
    balanced = _plan(model, inputs, moe_capacity=1.0, units=["layers.*"])  # one level: the layers
    assert balanced.model.moe_routing == "capacity 1"
    note = next(note for note in balanced.notes if "capacity 1, 32 tokens per expert" in note)
    assert "may peak above the plan" in note
    assert balanced.to_dict()["moe_routing"] == "capacity 1" and balanced.to_dict()["request"]["moe_capacity"] == 1.0
    assert "moe_capacity=1.0" in balanced.report()  # the "apply it:" line reproduces the plan and "capacity 1, 32 tokens" in " ".join(balanced.report().split())
    assert balanced.prediction.baseline_peak_bytes < worst.prediction.baseline_peak_bytes
    assert _measured(model, balanced, inputs) <= balanced.prediction.simulated_peak_bytes
    # routing above the capacity peaks above the plan, as the note warns
    assert _measured(_routed(model, 0, 1), balanced, inputs) > balanced.prediction.simulated_peak_bytes
    # at capacity experts / top_k every expert receives every token: the worst case
    router = RouterShape(tokens=64, top_k=2, experts=4)
    assert MoeRoutingBound(2.0).rows_per_expert(router) == MoeRoutingBound(3.0).rows_per_expert(router) == WORST_CASE.rows_per_expert(router) == 64


@pytest.mark.parametrize("capacity", [0, -1.0, float("nan"), float("inf"), "1.25", True])
def test_a_capacity_that_is_not_a_positive_number_is_refused(capacity):
    model, inputs = build_residual_list()
    with pytest.raises(OptionError, match=r"moe_capacity .* must be a positive number"):
        _plan(model, inputs, moe_capacity=capacity)


def test_a_capacity_on_a_model_whose_routing_decides_no_shape_is_a_note():
    model, inputs = build_residual_list()
    plan = _plan(model, inputs, moe_capacity=1.25)
    assert plan.model.moe_routing == ""
    assert any("moe_capacity=1.25 was given, but no routing in this model decides a shape" in note for note in plan.notes)


@pytest.mark.slow  # the whole pipeline
def test_transformers_eager_experts_plan_hold_and_train():
    """transformers' own per-expert loop (experts_implementation="eager"), skewed and as initialised."""
    pytest.importorskip("transformers")

    def build():
        model = _hf("MixtralConfig", "MixtralForCausalLM", **_MOE, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager")
        return model, _tokens()

    model, inputs = build()
    plan = _plan(model, inputs)
    assert plan.outcome.feasible and plan.model.moe_routing == "worst case"
    skewed = copy.deepcopy(model)
    for layer in skewed.model.layers:
        layer.mlp.gate.weight.data.zero_()  # every token scores every expert alike: top-2 takes the same two
    for routed in (model, skewed):
        assert _measured(routed, plan, inputs) <= plan.prediction.simulated_peak_bytes
    assert_trains_the_same(Structure("eager Mixtral", build, transformers_checkpointing=True), plan)


@pytest.mark.slow  # the whole pipeline
def test_command_line_capacity_reaches_the_plan(tmp_path):
    from typer.testing import CliRunner

    from autoplan.cli.app import app

    path = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "tests/cli_factories.py:eager_moe", "--budget", "1GB", "--device", "cpu",
                                      "--moe-capacity", "1.25", "--units", "layers.*", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert json.loads(path.read_text())["plan"]["moe_routing"] == "capacity 1.25"
    assert "capacity 1.25, 40 tokens per expert" in " ".join(result.output.split())


def test_nonzero_after_a_router_is_bounded_by_what_its_mask_can_hold():
    """One expert's mask (tokens × top_k elements) gets the capacity's rows; any other mask every element."""
    import torch

    from autoplan.instruments.fake import new_fake_mode

    mode = new_fake_mode(MoeRoutingBound(1.0))
    with mode:
        with pytest.raises(Exception, match="nonzero"):  # no router ran: fake tensors' own refusal stands
            torch.nonzero(torch.empty(2, 64, dtype=torch.bool))
        torch.topk(torch.empty(64, 4), 2, dim=-1)  # the router: 64 tokens, top-2 of 4 experts
        other = torch.nonzero(torch.empty(3, 64, dtype=torch.bool))
        assert mode.routing_assumed() == "worst case" and "did not apply" in mode.routing_note()
        one_expert = torch.nonzero(torch.empty(2, 64, dtype=torch.bool))
    assert tuple(other.shape) == (192, 2) and tuple(one_expert.shape) == (32, 2)  # 1.0 × 64 × 2 / 4
    assert mode.routing_assumed() == "capacity 1" and "capacity 1, 32 tokens per expert" in mode.routing_note()
