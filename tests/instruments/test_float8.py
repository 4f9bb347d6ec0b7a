"""torchao's float8 training, planned: the tracker follows its Float8TrainingTensor inside (instruments.tracker), the
CPU `_scaled_mm`'s temporaries count as scratch (instruments.cpu_scratch), by the allocator count's own rule for small
blocks (instruments.host_blocks); the plan equals the CPU allocator's count of the real step, and trains as it."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import autoplan
from autoplan.errors import OptionError

torchao_float8 = pytest.importorskip("torchao.float8")
logging.getLogger("torchao").setLevel(logging.ERROR)  # its CUDA kernels do not load on a CPU-only torch: said at import


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 4 * width, bias=False), torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Net(torch.nn.Module):
    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _float8(recipe: str) -> torch.nn.Module:
    """The model as a person converts it: every block's linears float8, the head kept."""
    torch.manual_seed(0)
    config = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    return torchao_float8.convert_to_float8_training(_Net(), config=config, module_filter_fn=lambda module, name: name != "head")


BATCH = torch.randn(8, 32, 64, generator=torch.Generator().manual_seed(1))
OPTIONS = dict(example_inputs=(BATCH,), device="cpu", precision="fp32", reserve=0)


@pytest.mark.slow  # the whole pipeline, three budgets, each verified
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_float8_model_is_predicted_to_the_byte_at_every_budget(recipe):
    model = _float8(recipe)
    planner = autoplan.Planner(model, **OPTIONS)
    loose = planner.plan("1GB")
    low, high = loose.prediction.minimum_budget_bytes, loose.prediction.peak_bytes
    plans = [loose, planner.plan(low), planner.plan((low + high) // 2)]
    assert any(choice.mode != "keep" for choice in plans[1].decisions.choices().values())  # the floor checkpoints float8 blocks
    for plan in plans:
        assert plan.outcome.feasible
        check = autoplan.verify(autoplan.apply(copy.deepcopy(model), plan), plan, example_inputs=(BATCH,))
        assert check.measured_peak_bytes == plan.prediction.peak_bytes, (plan.request.budget_bytes, recipe)


def _train(model: torch.nn.Module, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(BATCH).square().mean()
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow  # the whole pipeline
def test_a_planned_float8_model_trains_as_the_float8_model_it_was_made_from():
    model = _float8("tensorwise")
    plan = autoplan.plan(model, "1GB", **OPTIONS)
    floor = autoplan.plan(model, plan.prediction.minimum_budget_bytes, **OPTIONS)
    assert any(choice.mode != "keep" for choice in floor.decisions.choices().values())
    planned_losses, planned_weights = _train(autoplan.apply(copy.deepcopy(model), floor))
    losses, weights = _train(copy.deepcopy(model))
    assert planned_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(planned_weights, weights))


def test_a_float8_model_is_planned_for_the_cpu_and_without_autocast_only():
    model = _float8("tensorwise")
    with pytest.raises(OptionError, match=r"torchao float8 layers .* for the CPU only, not for h100"):
        autoplan.Planner(model, example_inputs=(BATCH,), device="h100", precision="fp32")
    with pytest.raises(OptionError, match=r"plan it with precision='fp32' .* not 'auto'"):
        autoplan.Planner(model, example_inputs=(BATCH,), device="cpu")


@pytest.mark.slow  # the whole pipeline, a transformers model
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_transformers_model_converted_to_float8_is_predicted_to_the_byte(family):
    """A model family not written for this: every linear but the LM head in float8, planned at its floor and verified."""
    transformers = pytest.importorskip("transformers")
    shapes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**shapes)) if family == "llama"
             else transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shapes)))
    model = torchao_float8.convert_to_float8_training(model, module_filter_fn=lambda module, name: "lm_head" not in name)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    planner = autoplan.Planner(model, example_inputs=batch, device="cpu", precision="fp32", reserve=0)
    floor = planner.plan(planner.plan("1GB").prediction.minimum_budget_bytes)
    assert floor.outcome.feasible and any(choice.mode != "keep" for choice in floor.decisions.choices().values())
    check = autoplan.verify(autoplan.apply(copy.deepcopy(model), floor), floor, example_inputs=batch)
    assert check.measured_peak_bytes == floor.prediction.peak_bytes


# -- float8 as a precision per unit (axes/precisions/float8.py): the model as written, its units' linears run in float8


@pytest.mark.slow  # the whole pipeline, three budgets, each verified
@pytest.mark.parametrize("precision", ["float8", "float8-rowwise"])
def test_units_planned_in_float8_are_predicted_to_the_byte_at_every_budget(precision):
    torch.manual_seed(0)
    model = _Net()
    planner = autoplan.Planner(model, **{**OPTIONS, "precision": precision})
    loose = planner.plan("1GB")
    low, high = loose.prediction.minimum_budget_bytes, loose.prediction.peak_bytes
    plans = [loose, planner.plan(low), planner.plan((low + high) // 2)]
    assert {choice.precision for plan in plans for choice in plan.decisions.choices().values()} == {precision}
    assert any(choice.mode != "keep" for choice in plans[1].decisions.choices().values())
    for plan in plans:
        check = autoplan.verify(autoplan.apply(copy.deepcopy(model), plan), plan, example_inputs=(BATCH,))
        assert check.measured_peak_bytes == plan.prediction.peak_bytes, (plan.request.budget_bytes, precision)


def _as_torchao_runs_it(model: _Net, recipe: str) -> _Net:
    """What a person writes by hand: the blocks' linears converted by torchao, each block under bf16 autocast, the
    float8 linears fed bf16 (as torchao does under a GPU's autocast)."""
    config = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    converted = torchao_float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn != "head")
    for block in converted.blocks:
        for linear in (block.up, block.down):
            linear.register_forward_pre_hook(lambda module, args: (args[0].to(torch.bfloat16),))
        forward = block.forward
        block.forward = lambda x, forward=forward: _autocast(forward, x)
    return converted


def _autocast(forward, x):
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        return forward(x)


@pytest.mark.slow  # the whole pipeline
def test_a_plan_in_float8_trains_as_the_model_torchao_converts_by_hand():
    torch.manual_seed(0)
    model = _Net()
    options = {**OPTIONS, "precision": "float8"}
    floor = autoplan.plan(model, autoplan.plan(model, "1GB", **options).prediction.minimum_budget_bytes, **options)
    assert any(choice.mode != "keep" for choice in floor.decisions.choices().values())
    planned_losses, planned_weights = _train(autoplan.apply(copy.deepcopy(model), floor))
    losses, weights = _train(_as_torchao_runs_it(copy.deepcopy(model), "tensorwise"))
    assert planned_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(planned_weights, weights))


@pytest.mark.slow  # the whole pipeline, transformers models
@pytest.mark.parametrize("family", ["llama", "gpt-neox"])
def test_transformers_units_planned_in_float8_are_predicted_to_the_byte(family):
    """Families not written for this, planned with precision="float8" at their floor and verified."""
    transformers = pytest.importorskip("transformers")
    shapes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=64)
    torch.manual_seed(0)
    model = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**shapes, num_key_value_heads=2)) if family == "llama"
             else transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**shapes)))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    planner = autoplan.Planner(model, example_inputs=batch, device="cpu", precision="float8", reserve=0)
    floor = planner.plan(planner.plan("1GB").prediction.minimum_budget_bytes)
    assert floor.outcome.feasible and {choice.precision for choice in floor.decisions.choices().values()} == {"float8"}
    check = autoplan.verify(autoplan.apply(copy.deepcopy(model), floor), floor, example_inputs=batch)
    assert check.measured_peak_bytes == floor.prediction.peak_bytes


@pytest.mark.slow  # two plans of a meta Llama
def test_auto_float8_picks_float8_on_an_h100_where_compiled_casts_make_it_faster():
    """On an H100 float8's matmuls run at twice bf16's rate; its casts are memory traffic that only a compiled
    model fuses: planned for torch.compile the units take float8, planned eager they keep bf16."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 4096, (4, 1024))
    options = dict(example_inputs={"input_ids": ids, "labels": ids}, device="h100", precision="auto-float8")
    compiled = autoplan.plan(model, "80GB", compile=True, **options)
    eager = autoplan.plan(model, "80GB", **options)
    assert {choice.precision for choice in compiled.decisions.choices().values()} == {"float8"}
    assert {choice.precision for choice in eager.decisions.choices().values()} == {"bf16"}


def test_float8_on_a_model_with_no_linear_it_runs_is_refused():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    ids = torch.randint(0, 256, (2, 16))
    with pytest.raises(OptionError, match=r"precision='float8': none of the units \(transformer.h.0, transformer.h.1\) holds a "
                                          r"torch.nn.Linear .* GPT-2 Conv1D"):
        autoplan.plan(model, "1GB", example_inputs={"input_ids": ids, "labels": ids}, device="cpu", precision="float8")


@pytest.mark.slow  # the whole pipeline, then torch.compile
def test_a_float8_plan_compiles_whole_and_comes_off_with_remove_plan():
    """The float8 linears are made when the plan is applied, so torch.compile traces them without a graph break (made
    while the unit ran, their making broke the graph and the float8 units ran eagerly); remove_plan puts the linears'
    own forwards back."""
    import torch._dynamo

    torch.manual_seed(0)
    model = _Net()
    options = {**OPTIONS, "precision": "float8", "compile": True}
    floor = autoplan.plan(model, autoplan.plan(model, "1GB", **options).prediction.minimum_budget_bytes, **options)
    eager = autoplan.apply(copy.deepcopy(model), floor)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(autoplan.apply(copy.deepcopy(model), floor), backend="aot_eager")
    for planned in (eager, compiled):
        planned(BATCH).square().mean().backward()
    assert not torch._dynamo.utils.counters["graph_break"]
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), compiled.parameters()))
    assert any("forward" in linear.__dict__ for linear in eager.modules() if isinstance(linear, torch.nn.Linear))
    autoplan.remove_plan(eager)
    assert not any("forward" in module.__dict__ for module in eager.modules())


def test_float8_per_unit_is_refused_on_a_mesh():
    with pytest.raises(OptionError, match=r"precision='auto-float8' is planned for one device: float8 per unit under FSDP"):
        autoplan.Planner(_Net(), example_inputs=(BATCH,), device="h100", precision="auto-float8", world_size=2)


@pytest.mark.slow  # a whole plan
def test_a_gpu_plan_with_float8_units_says_they_were_not_checked_on_a_gpu():
    plan = autoplan.plan(_Net(), "80GB", example_inputs=(BATCH,), device="h100", precision="float8")
    assert any(note.startswith("float8 units: simulated") and "not yet against a GPU's" in note for note in plan.notes)
    cpu = autoplan.plan(_Net(), "1GB", **{**OPTIONS, "precision": "float8"})
    assert not any(note.startswith("float8 units") for note in cpu.notes)
