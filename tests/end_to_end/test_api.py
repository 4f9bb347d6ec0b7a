"""Tests for the public API (`autoplan.plan`, `autoplan.optimize`, `autoplan.apply`) on tiny models.

Every plan is for "h100-80gb" with reserve=0, so budgets of a few hundred KB mean something: the
usable bytes are the budget itself. Plans that several tests read are made once per module.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

import autoplan
import autoplan.profile.timeline
from autoplan import Choice, InfeasibleBudgetError, MemoryBreakdown, Plan, UnitDecision
from autoplan.planned.forwards import planned_choices
from autoplan.training.step_parts import default_loss
from examples.gpt import build as build_gpt
from tests.halfway import halfway_budget
from tests.models import make_lora, make_small_resnet, make_tiny_gpt

DEVICE = "h100-80gb"
GPT_UNITS = ["transformer.h.0", "transformer.h.1"]


def make_gpt_long() -> tuple[torch.nn.Module, tuple]:
    """tiny_gpt's shape with a longer batch: activations, not optimizer state, set the peak."""
    return build_gpt(n_layer=2, n_embd=32, n_head=2, block_size=64, vocab_size=64, batch_size=16, seq_len=64)


FACTORIES = {"tiny_gpt": make_tiny_gpt, "gpt_long": make_gpt_long, "small_resnet": make_small_resnet, "lora": make_lora}


def make_plan(model_name: str = "tiny_gpt", budget="1GB", **options) -> Plan:
    model, inputs = FACTORIES[model_name]()
    options.setdefault("example_inputs", inputs)
    options.setdefault("device", DEVICE)
    options.setdefault("reserve", 0)
    return autoplan.plan(model, budget, **options)


@functools.lru_cache(maxsize=None)
def _cached(model_name: str, budget, precision: str, optimizer: str) -> tuple[torch.nn.Module, Plan]:
    model, inputs = FACTORIES[model_name]()
    plan = autoplan.plan(
        model, budget, example_inputs=inputs, device=DEVICE, reserve=0, precision=precision, optimizer=optimizer
    )
    return model, plan


def cached_plan(model_name: str = "tiny_gpt", budget="1GB", precision: str = "auto", optimizer: str = "adamw") -> Plan:
    """A plan several tests read (planning takes about a second, so each is made once)."""
    return _cached(model_name, budget, precision, optimizer)[1]


def modes(plan: Plan) -> dict[str, str]:
    return {unit.name: unit.choice.mode for unit in plan.decisions.units}


def precisions(plan: Plan) -> dict[str, str]:
    return {unit.name: unit.choice.precision for unit in plan.decisions.units}


# -- a generous budget ------------------------------------------------------------------------


def test_generous_budget_plan_is_feasible_and_complete() -> None:
    plan = cached_plan()
    assert isinstance(plan, Plan)
    assert plan.outcome.feasible
    assert plan.model.name == "GPT"
    assert plan.target.device == DEVICE
    assert plan.request.budget_bytes == 10**9
    assert plan.request.usable_bytes == 10**9  # reserve=0
    assert 0 < plan.prediction.peak_bytes <= plan.request.usable_bytes
    assert 0 < plan.prediction.simulated_peak_bytes <= plan.request.usable_bytes
    assert plan.prediction.baseline_peak_bytes > 0
    assert plan.prediction.baseline_step_time_s > 0
    assert plan.prediction.step_time_s > 0
    assert 0 < plan.prediction.minimum_peak_bytes <= plan.prediction.baseline_peak_bytes
    assert plan.prediction.minimum_budget_bytes >= plan.prediction.minimum_peak_bytes
    assert plan.outcome.solver_status == "Optimal"
    assert plan.outcome.solve_time_s >= 0
    assert plan.model.trace_method == "symbolic_trace"
    assert plan.request.optimizer == "adamw"
    assert isinstance(plan.prediction.breakdown, MemoryBreakdown)
    assert plan.prediction.breakdown.total == plan.prediction.peak_bytes
    assert [unit.name for unit in plan.decisions.units] == GPT_UNITS
    assert all(isinstance(unit, UnitDecision) and isinstance(unit.choice, Choice) for unit in plan.decisions.units)
    assert plan.decisions.choices() == {unit.name: unit.choice for unit in plan.decisions.units}
    assert plan.notes == () or all(isinstance(note, str) for note in plan.notes)


def test_plan_to_dict_is_json_and_round_trips() -> None:
    plan = cached_plan()
    data = plan.to_dict()
    for key in (
        "feasible",
        "budget_bytes",
        "usable_bytes",
        "predicted_peak_bytes",
        "simulated_peak_bytes",
        "baseline_peak_bytes",
        "predicted_step_time_s",
        "baseline_step_time_s",
        "breakdown",
        "units",
        "solver_status",
        "solve_time_s",
    ):
        assert key in data, key
    assert json.loads(json.dumps(data)) == data
    assert json.loads(plan.to_json()) == data
    assert json.loads(plan.to_json(indent=None)) == data
    assert data["feasible"] is True
    assert data["breakdown"]["total"] == plan.prediction.peak_bytes
    assert set(data["breakdown"]) >= {"parameters", "gradients", "optimizer", "activations", "transient"}
    assert [unit["name"] for unit in data["units"]] == GPT_UNITS
    for unit, decision in zip(data["units"], plan.decisions.units):
        assert unit["mode"] == decision.choice.mode
        assert unit["precision"] == decision.choice.precision
        assert "choice" not in unit


def test_plan_does_not_change_the_model() -> None:
    model, _ = _cached("tiny_gpt", "1GB", "auto", "adamw")  # planned above
    untouched, _ = make_tiny_gpt()  # same seed, same weights
    assert planned_choices(model) == {}
    assert "forward" not in model.__dict__
    assert all(not p.is_meta and type(p) is torch.nn.Parameter for p in model.parameters())
    assert model.state_dict().keys() == untouched.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, untouched.state_dict()[key]), key


def test_generous_budget_plan_is_the_fastest_plan() -> None:
    plan = cached_plan()
    assert plan.prediction.step_time_s == pytest.approx(plan.prediction.fastest_step_time_s, rel=1e-9)
    assert plan.prediction.step_time_s <= plan.prediction.baseline_step_time_s


def test_generous_budget_small_resnet_plan_is_the_fastest_plan() -> None:
    """Regression: CBC's preprocessing once gave layer1.1 selective/bf16 here, slower than keep/bf16."""
    plan = cached_plan("small_resnet")
    assert plan.outcome.feasible
    assert all(mode == "keep" for mode in modes(plan).values())
    assert plan.prediction.step_time_s == pytest.approx(plan.prediction.fastest_step_time_s, rel=1e-9)


def test_peak_counts_parameters_gradients_and_optimizer_state() -> None:
    """Regression: parameters made by fake_copy() before the tracker began were never counted."""
    plan = cached_plan(optimizer="sgd")
    static = plan.prediction.breakdown
    # at any moment the parameters are alive; at the optimizer step all gradients are too
    assert plan.prediction.peak_bytes >= static.parameters + static.optimizer + static.gradients
    assert plan.prediction.baseline_peak_bytes >= 2 * static.parameters  # parameters + their gradients
    assert static.activations >= 0


# -- tight and impossible budgets -------------------------------------------------------------


# a batch large enough that the activations, not the caching allocator's 2 MiB and 20 MiB segments, make the window
@pytest.mark.parametrize(("model_name", "precision", "repeat"), [("gpt_long", "fp32", 1), ("small_resnet", "fp32", 8), ("gpt_long", "auto", 1)])
def test_budget_between_minimum_and_baseline_is_feasible(model_name: str, precision: str, repeat: int) -> None:
    model, inputs = FACTORIES[model_name]()
    inputs = tuple(t.repeat(repeat, *[1] * (t.dim() - 1)) for t in inputs)
    planner = autoplan.Planner(model, example_inputs=inputs, device=DEVICE, reserve=0, precision=precision)
    first = planner.plan("1GB")
    assert first.prediction.minimum_peak_bytes < first.prediction.baseline_peak_bytes
    budget = halfway_budget(first)
    plan = planner.plan(budget)
    assert plan.outcome.feasible
    assert plan.request.budget_bytes == plan.request.usable_bytes == budget
    assert plan.prediction.simulated_peak_bytes <= plan.request.usable_bytes
    assert plan.prediction.peak_bytes <= plan.request.usable_bytes
    changed = [u for u in plan.decisions.units if u.choice.checkpointed or u.choice.precision != "fp32"]
    assert changed, "a budget below the baseline peak needs some unit checkpointed or in low precision"
    if precision == "fp32":
        assert any(u.choice.checkpointed for u in plan.decisions.units)
        checkpointed = [u for u in plan.decisions.units if u.choice.checkpointed]
        assert all(u.recompute_flops >= 0 for u in checkpointed)
    assert plan.prediction.step_time_s >= first.prediction.step_time_s


def test_budget_at_the_floor_is_feasible() -> None:
    first = cached_plan("gpt_long", precision="fp32")
    floor = first.prediction.minimum_budget_bytes  # reserve=0: the lowest peak, or the allocator's least limit for it
    assert floor >= first.prediction.minimum_peak_bytes
    plan = make_plan("gpt_long", floor, precision="fp32")
    assert plan.outcome.feasible
    assert plan.prediction.simulated_peak_bytes <= floor and plan.prediction.least_limit_bytes <= floor


def test_infeasible_budget_gives_an_infeasible_plan() -> None:
    first = cached_plan("gpt_long", precision="fp32")
    budget = first.prediction.minimum_peak_bytes // 2
    plan = make_plan("gpt_long", budget, precision="fp32")
    assert isinstance(plan, Plan)
    assert plan.outcome.feasible is False
    assert plan.prediction.minimum_peak_bytes > plan.request.usable_bytes
    assert plan.prediction.minimum_budget_bytes >= plan.prediction.minimum_peak_bytes
    assert plan.prediction.minimum_peak_bytes == first.prediction.minimum_peak_bytes
    assert len(plan.decisions.units) == 2  # the lowest-peak choices, for the report
    assert plan.notes
    json.loads(plan.to_json())


@pytest.mark.slow  # the whole pipeline
def test_optimize_with_an_infeasible_budget_raises_with_the_plan() -> None:
    first = cached_plan("gpt_long", precision="fp32")
    model, inputs = make_gpt_long()
    with pytest.raises(InfeasibleBudgetError) as info:
        autoplan.optimize(
            model, first.prediction.minimum_peak_bytes // 2, example_inputs=inputs, device=DEVICE, reserve=0, precision="fp32"
        )
    error = info.value
    assert isinstance(error, ValueError)
    assert isinstance(error.plan, Plan)
    assert error.plan.outcome.feasible is False
    assert "needs a budget" in str(error)
    assert planned_choices(model) == {}  # nothing was rewritten


# -- precision --------------------------------------------------------------------------------


def test_precision_fp32_keeps_every_unit_fp32() -> None:
    plan = cached_plan(precision="fp32")
    assert plan.outcome.feasible
    assert set(precisions(plan).values()) == {"fp32"}
    assert plan.decisions.rest_precision == "fp32"
    assert plan.target.needs_grad_scaler is False


def test_precision_bf16_makes_every_unit_bf16() -> None:
    plan = cached_plan(precision="bf16")
    assert plan.outcome.feasible
    assert set(precisions(plan).values()) == {"bf16"}
    assert plan.decisions.rest_precision == "bf16"
    assert plan.target.needs_grad_scaler is False


def test_precision_fp16_needs_a_grad_scaler() -> None:
    plan = cached_plan(precision="fp16")
    assert plan.outcome.feasible
    assert set(precisions(plan).values()) == {"fp16"}
    assert plan.target.needs_grad_scaler is True


def test_precision_bf16_on_a_device_without_bf16_raises() -> None:
    with pytest.raises(ValueError, match="bf16"):
        make_plan(precision="bf16", device="t4")


def test_precision_auto_on_t4_uses_fp16() -> None:
    plan = make_plan(precision="auto", device="t4")
    assert plan.target.device == "t4"
    assert plan.target.low_precision == "fp16"
    assert set(precisions(plan).values()) <= {"fp32", "fp16"}
    assert plan.target.needs_grad_scaler == any(p == "fp16" for p in precisions(plan).values())


def test_precision_auto_on_h100_uses_bf16() -> None:
    plan = cached_plan()
    assert plan.target.low_precision == "bf16"
    assert set(precisions(plan).values()) <= {"fp32", "bf16"}
    assert plan.target.needs_grad_scaler is False


def test_unknown_precision_raises() -> None:
    with pytest.raises(ValueError, match="precision"):
        make_plan(precision="fp8")


# -- pins -------------------------------------------------------------------------------------


def test_keep_fp32_pins_a_unit_at_any_budget() -> None:
    free = cached_plan("gpt_long")
    assert precisions(free)["transformer.h.0"] != "fp32"  # without the pin it would go low precision
    generous = make_plan("gpt_long", keep_fp32=["transformer.h.0"])
    assert generous.outcome.feasible
    assert precisions(generous)["transformer.h.0"] == "fp32"
    assert precisions(generous)["transformer.h.1"] == precisions(free)["transformer.h.1"]
    # the tightest budget this pin allows: the other unit does what it can, this one stays fp32
    tight = make_plan("gpt_long", generous.prediction.minimum_budget_bytes, keep_fp32=["transformer.h.0"])
    assert tight.outcome.feasible
    assert precisions(tight)["transformer.h.0"] == "fp32"
    assert tight.prediction.minimum_peak_bytes >= free.prediction.minimum_peak_bytes


def test_checkpoint_pins_a_unit_to_full() -> None:
    plan = make_plan(checkpoint=["transformer.h.1"], precision="fp32")
    assert plan.outcome.feasible
    assert modes(plan)["transformer.h.1"] == "full"
    assert modes(plan)["transformer.h.0"] == "keep"  # the generous budget needs nothing else


def test_checkpoint_mapping_pins_a_mode() -> None:
    plan = make_plan(checkpoint={"transformer.h.1": "selective", "transformer.h.0": "full"}, precision="fp32")
    assert modes(plan) == {"transformer.h.0": "full", "transformer.h.1": "selective"}


def test_checkpoint_with_an_unknown_mode_raises() -> None:
    with pytest.raises(ValueError, match="sometimes"):
        make_plan(checkpoint={"transformer.h.1": "sometimes"})


@pytest.mark.parametrize("option", ["keep_fp32", "checkpoint"])
def test_pin_pattern_matching_no_unit_raises_listing_the_units(option: str) -> None:
    with pytest.raises(ValueError) as info:
        make_plan(**{option: ["layers.*"]})
    message = str(info.value)
    assert "layers.*" in message
    assert "transformer.h.0" in message and "transformer.h.1" in message


# -- example_inputs forms ---------------------------------------------------------------------


@pytest.mark.slow  # the whole pipeline
def test_example_inputs_as_a_tuple_and_as_kwargs() -> None:
    model, (idx,) = make_tiny_gpt()
    by_tuple = cached_plan()
    by_kwargs = autoplan.plan(model, "1GB", example_inputs={"idx": idx}, device=DEVICE, reserve=0)
    for plan in (by_kwargs,):
        assert plan.outcome.feasible
        assert [u.name for u in plan.decisions.units] == GPT_UNITS
        assert plan.prediction.peak_bytes == by_tuple.prediction.peak_bytes
        assert plan.prediction.baseline_peak_bytes == by_tuple.prediction.baseline_peak_bytes


@pytest.mark.slow  # the whole pipeline
def test_example_inputs_as_args_and_kwargs_use_the_models_own_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    model, (idx,) = make_tiny_gpt()
    targets = torch.randint(0, 64, idx.shape)
    used_own_loss: list[bool] = []

    def spy(output):
        loss = default_loss(output)
        used_own_loss.append(getattr(output, "loss", None) is loss)
        return loss

    monkeypatch.setattr(autoplan.profile.timeline, "default_loss", spy)
    plan = autoplan.plan(model, "1GB", example_inputs=((idx,), {"targets": targets}), device=DEVICE, reserve=0)
    assert plan.outcome.feasible
    assert [u.name for u in plan.decisions.units] == GPT_UNITS
    assert used_own_loss and all(used_own_loss)
    # without targets the model has no loss, and the sum of its outputs is used instead
    output = model(idx)
    assert output.loss is None
    assert torch.allclose(default_loss(output), output.logits.sum())


@pytest.mark.slow  # the whole pipeline
def test_a_custom_loss_fn_is_used() -> None:
    model, inputs = make_tiny_gpt()
    calls = []

    def loss_fn(output):
        calls.append(type(output).__name__)
        return output.logits.float().pow(2).mean()

    plan = autoplan.plan(model, "1GB", example_inputs=inputs, device=DEVICE, reserve=0, loss_fn=loss_fn, precision="fp32")
    assert plan.outcome.feasible
    assert calls and set(calls) == {"GPTOutput"}


class _SquaredLogits(torch.nn.Module):
    """A loss written as a module, counting its calls."""

    calls = 0

    def forward(self, output) -> torch.Tensor:
        self.calls += 1
        return output.logits.float().pow(2).mean()


def _refuse_to_compile(graph_module, example_inputs):
    raise AssertionError("torch.compile was asked to compile: planning runs the caller's code as written")


class _Messages(list):
    """A progress callback that keeps what it is told: falsy while it is empty."""

    def __call__(self, message: str) -> None:
        self.append(message)


@pytest.mark.slow  # the whole pipeline
def test_the_callers_objects_are_used_whatever_their_truth_value() -> None:
    """Issue 39: `loss_fn or default` called bool() on the caller's loss, and a torch.compile'd module answers
    bool() with its wrapped module's len() (a TypeError); `progress or ...` dropped a callback that was falsy."""
    model, inputs = make_tiny_gpt()
    loss, said = _SquaredLogits(), _Messages()
    plan = autoplan.plan(model, "1GB", example_inputs=inputs, device=DEVICE, reserve=0, precision="fp32",
                         loss_fn=torch.compile(loss, backend=_refuse_to_compile), progress=said)
    assert plan.outcome.feasible
    assert loss.calls > 0 and said, "the loss and the progress callback given were the ones used"


@pytest.mark.slow  # the whole pipeline
def test_bad_example_inputs_raise_type_error() -> None:
    model, _ = make_tiny_gpt()
    with pytest.raises(TypeError):
        autoplan.plan(model, "1GB", example_inputs=3, device=DEVICE, reserve=0)


# -- optimizers -------------------------------------------------------------------------------


def test_sgd_has_less_static_memory_than_adamw() -> None:
    adamw, sgd = cached_plan(), cached_plan(optimizer="sgd")
    momentum = cached_plan(optimizer="sgd-momentum")
    assert sgd.request.optimizer == "sgd"
    assert sgd.prediction.breakdown.optimizer == 0
    assert 0 < momentum.prediction.breakdown.optimizer < adamw.prediction.breakdown.optimizer
    # AdamW: two fp32 tensors per trainable parameter, SGD with momentum: one
    assert adamw.prediction.breakdown.optimizer >= 2 * momentum.prediction.breakdown.optimizer
    assert sgd.prediction.baseline_peak_bytes < adamw.prediction.baseline_peak_bytes
    assert sgd.prediction.peak_bytes < adamw.prediction.peak_bytes


@pytest.mark.slow  # the whole pipeline
def test_an_optimizer_instance_works() -> None:
    model, inputs = make_tiny_gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plan = autoplan.plan(model, "1GB", example_inputs=inputs, device=DEVICE, reserve=0, optimizer=optimizer)
    assert plan.outcome.feasible
    assert plan.request.optimizer == "SGD"
    assert plan.prediction.breakdown.optimizer == cached_plan(optimizer="sgd-momentum").prediction.breakdown.optimizer
    assert not optimizer.state  # planning did not step the person's optimizer


def test_an_unknown_optimizer_name_raises() -> None:
    with pytest.raises(ValueError, match="lion"):
        make_plan(optimizer="lion")


def test_frozen_parameters_need_no_optimizer_state() -> None:
    plan = make_plan("lora", precision="fp32")
    model, _ = make_lora()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # AdamW state for the adapters only (exp_avg + exp_avg_sq in fp32, and a step counter each)
    assert 2 * 4 * trainable <= plan.prediction.breakdown.optimizer < 4 * 4 * trainable + 64 * 512


# -- bad arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["20", "abc", "-5GB", "", 0])
def test_bad_budget_raises_value_error(budget) -> None:
    with pytest.raises(ValueError):
        make_plan(budget=budget)


def test_unknown_device_raises_value_error() -> None:
    with pytest.raises(ValueError, match="nonexistent-gpu"):
        make_plan(device="nonexistent-gpu")


# -- optimize and apply -----------------------------------------------------------------------


def _train_step(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    output = model(idx, targets=torch.randint(0, 64, idx.shape))
    output.loss.backward()
    return output.loss


@pytest.mark.slow  # the whole pipeline
def test_optimize_returns_the_same_model_and_it_trains() -> None:
    model, (idx,) = make_tiny_gpt()
    params = list(model.parameters())
    result = autoplan.optimize(
        model, "1GB", example_inputs=(idx,), device=DEVICE, reserve=0, checkpoint=["transformer.h.1"]
    )
    assert result is model
    assert list(model.parameters()) == params
    assert planned_choices(model)["transformer.h.1"].mode == "full"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = _train_step(model, idx)
        assert torch.isfinite(loss)
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_apply_rewrites_the_model_as_planned() -> None:
    plan = make_plan(precision="fp32", checkpoint={"transformer.h.0": "selective"})
    model, (idx,) = make_tiny_gpt()
    reference, _ = make_tiny_gpt()
    assert autoplan.apply(model, plan) is model
    assert planned_choices(model) == plan.decisions.choices()
    # all fp32: the same loss as the untouched model
    torch.manual_seed(0)
    targets = torch.randint(0, 64, idx.shape)
    assert torch.allclose(model(idx, targets=targets).loss, reference(idx, targets=targets).loss, atol=1e-6)


def test_apply_rejects_what_is_not_a_plan_or_a_plan_for_another_model() -> None:
    model, _ = make_tiny_gpt()
    with pytest.raises(TypeError):
        autoplan.apply(model, {"transformer.h.0": Choice()})
    other, _ = make_small_resnet()
    with pytest.raises(ValueError, match="transformer.h.0"):
        autoplan.apply(other, cached_plan())


@pytest.mark.slow  # the whole pipeline
def test_plan_and_apply_graph_units_of_a_flat_model():
    # No repeated block, no Sequential: units are runs of fx nodes; the plan fits, the rewrite is
    # the caller's model (same class, same state_dict keys) and trains to the original's loss.
    from tests.models import make_flat

    model, (x,) = make_flat()
    x = x.repeat(512, 1)  # activations beyond what the caching allocator's segments round away
    reference = copy.deepcopy(model)
    planner = autoplan.Planner(model, example_inputs=(x,), device="h100-80gb", precision="fp32", reserve=0)
    free = planner.plan("1GB")
    assert all(u.name.startswith("graph[") for u in free.decisions.units)
    budget = halfway_budget(free)
    tight = planner.plan(budget)
    assert tight.outcome.feasible and tight.prediction.simulated_peak_bytes <= budget
    assert any(u.choice.mode != "keep" for u in tight.decisions.units)
    assert autoplan.apply(model, tight) is model
    assert type(model) is type(reference) and list(model.state_dict()) == list(reference.state_dict())
    for m in (model, reference):
        torch.manual_seed(3)
        m(x).pow(2).mean().backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    autoplan.remove_plan(model)
    assert "forward" not in model.__dict__
