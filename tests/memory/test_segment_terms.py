"""Segments: runs of consecutive blocks checkpointed as one region, in the same program as the blocks.

- the program's mix (blocks on their own, segments, whole runs) is never worse than any one level,
  and strictly better where √n checkpointing is (a deep narrow chain);
- the memory model prices a segment as the whole-step simulation measures it;
- a model rewritten with a mixed plan trains like the original (fp32: loss, gradients, BatchNorm
  statistics, dropout masks), under torch.compile too, and a transformers Llama as well;
- a segment is one unit in the report and the JSON; apply / remove_plan / planned_choices handle it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoplan
from autoplan.errors import SegmentError
from autoplan.inputs.batch import training_batch
from autoplan.inputs.devices import get_device
from autoplan.memory.model import predict_peak
from autoplan.memory.segment_terms import chains, choices_by_unit, segment_candidates
from autoplan.plan import Choice
from autoplan.planned.forwards import apply_choices, planned_choices, remove_plan
from autoplan.trace.tracer import trace
from autoplan.verify.simulate import simulate_plan
from autoplan.units import Segment

DEVICE = get_device("cpu")


class NarrowBlock(nn.Module):
    """A residual MLP block whose input is small next to what it saves: where segments pay."""

    def __init__(self, width: int, norm: bool = False) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(width) if norm else nn.Identity()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, scale):
        return x + self.drop(self.down(torch.relu(self.up(self.norm(x))))) * scale


class Chain(nn.Module):
    """Blocks in a ModuleList called by the model's own loop, each also given one shared tensor."""

    def __init__(self, depth: int = 16, width: int = 16, norm: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NarrowBlock(width, norm) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        scale = torch.full((x.shape[-1],), 0.5)
        for layer in self.layers:
            x = layer(x, scale)
        return self.head(x).sum()


def _chain(**options):
    torch.manual_seed(0)
    return Chain(**options), (torch.randn(2048, 16),)


def _floor(model, inputs, **options) -> autoplan.Plan:
    profiles = []
    plan = autoplan.plan(model, "10GB", example_inputs=inputs, device="cpu", precision="fp32", menu_size=0,
                         on_profile=profiles.append, **options)
    return plan, profiles[0]


@pytest.mark.slow  # the whole pipeline
def test_segments_lower_the_floor_below_every_level_of_a_deep_narrow_chain():
    model, inputs = _chain()
    blocks, _ = _floor(model, inputs, segments=False)
    mixed, profile = _floor(model, inputs)
    # checkpointing every block by hand holds all 16 inputs; segments hold fewer
    assert mixed.prediction.minimum_peak_bytes < blocks.prediction.minimum_peak_bytes
    at_floor = autoplan.plan(model, mixed.prediction.minimum_peak_bytes + 1, example_inputs=inputs, device="cpu", precision="fp32",
                             reserve=0, menu_size=0)
    assert at_floor.outcome.feasible and any(unit.members for unit in at_floor.decisions.units)
    # the other single level, one segment over the whole run, recomputes everything at once: worse
    whole = {f"layers.0–layers.{len(model.layers) - 1}": Choice("full", "fp32")}
    traced = trace(model, inputs)
    assert simulate_plan(traced, choices_by_unit(profile, whole), device=DEVICE, optimizer="adamw", rest_precision="fp32").peak_bytes > mixed.prediction.minimum_peak_bytes
    assert predict_peak(profile, whole).bytes > mixed.prediction.minimum_peak_bytes


@pytest.mark.slow  # the whole pipeline
def test_blocks_pinned_to_a_mode_are_checkpointed_each_on_its_own():
    """A pin says how each block is checkpointed, as transformers' gradient_checkpointing_enable() does it: no segment
    (its whole run recomputed at once in backward) stands in for pinned blocks, however it ties or lowers the floor."""
    model, inputs = _chain()
    pinned, _ = _floor(model, inputs, checkpoint={"layers.*": "full"})
    blocks, _ = _floor(model, inputs, checkpoint={"layers.*": "full"}, segments=False)
    free, _ = _floor(model, inputs)
    assert free.prediction.minimum_peak_bytes < pinned.prediction.minimum_peak_bytes == blocks.prediction.minimum_peak_bytes
    assert [str(unit.choice) for unit in pinned.decisions.units] == ["full/fp32"] * len(model.layers)


@pytest.mark.slow  # the whole pipeline
def test_a_plan_for_torch_compile_has_no_segments():
    """A segment's region runs eagerly between compiled graphs: compile=True plans blocks only."""
    model, inputs = _chain()
    lowest = _floor(model, inputs)[0].prediction.minimum_peak_bytes
    options = dict(example_inputs=inputs, device="cpu", precision="fp32", reserve=0, menu_size=0)
    assert any(unit.members for unit in autoplan.plan(model, lowest + 1, **options).decisions.units)
    compiled = autoplan.plan(model, "10GB", compile=True, **options)
    at_its_floor = autoplan.plan(model, compiled.prediction.minimum_peak_bytes + 1, compile=True, **options)
    assert at_its_floor.outcome.feasible and not any(unit.members for unit in at_its_floor.decisions.units)
    assert compiled.prediction.minimum_peak_bytes > lowest


def test_candidates_are_runs_the_model_calls_back_to_back():
    model, inputs = _chain(depth=6)
    _, profile = _floor(model, inputs)
    assert chains(profile) == [list(range(6))]
    names = {candidate.name for candidate in segment_candidates(profile)}
    assert {"layers.0–layers.1", "layers.0–layers.2", "layers.0–layers.5", "layers.4–layers.5"} <= names


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("fraction", [0.0, 0.3])
def test_predicted_peak_of_mixed_plans_is_the_simulated_one(fraction):
    model, inputs = _chain(norm=True)
    # the target's own floor: a GPU target also holds cuBLAS's workspaces, which the CPU does not
    floor = autoplan.plan(model, "10GB", example_inputs=inputs, device="a100-80gb", reserve=0, menu_size=0)
    # in budget terms: the floor budget, and what the roomy plan's caching allocator needs (reserve=0)
    low, high = floor.prediction.minimum_budget_bytes, max(floor.prediction.baseline_peak_bytes, floor.prediction.least_limit_bytes)
    budget = int(low + fraction * (high - low)) + 1
    plan = autoplan.plan(model, budget, example_inputs=inputs, device="a100-80gb", reserve=0, menu_size=0)
    assert plan.outcome.feasible
    assert abs(plan.prediction.peak_bytes - plan.prediction.simulated_peak_bytes) <= 0.05 * plan.prediction.simulated_peak_bytes
    assert plan.prediction.peak_bytes <= budget and plan.prediction.simulated_peak_bytes <= budget


def _train_step(model, inputs):
    torch.manual_seed(1)  # the same dropout masks; the region replays them on recompute
    loss = model(*inputs)
    loss.backward()
    return loss.detach()


def _assert_trains_the_same(original, planned, inputs):
    torch.testing.assert_close(_train_step(planned, inputs), _train_step(original, inputs))
    for (name, a), b in zip(original.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    for (name, a), b in zip(original.named_buffers(), planned.buffers()):
        torch.testing.assert_close(b, a, msg=name)  # BatchNorm statistics updated once


@pytest.mark.slow  # the whole pipeline
def test_a_mixed_plan_trains_like_the_original_and_reads_back():
    model, inputs = _chain(norm=True)
    floor, _ = _floor(model, inputs)
    plan = autoplan.plan(model, floor.prediction.minimum_peak_bytes + 1, example_inputs=inputs, device="cpu", precision="fp32",
                         reserve=0, menu_size=0)
    segments = [unit for unit in plan.decisions.units if unit.members]
    assert segments and len(plan.decisions.units) > len(segments)  # a mix: segments and blocks on their own
    planned = autoplan.apply(copy.deepcopy(model), plan)
    assert planned_choices(planned) == plan.decisions.choices()
    _assert_trains_the_same(model, planned, inputs)
    # one line and one JSON entry per segment, naming its units
    first = segments[0]
    assert f"{first.name} (segment)" in plan.report()
    entry = next(unit for unit in plan.to_dict()["units"] if unit["name"] == first.name)
    assert entry["mode"] == "full" and entry["members"] == list(first.members)
    remove_plan(planned)
    assert planned_choices(planned) == {} and all("forward" not in m.__dict__ for m in planned.modules())


def test_no_grad_and_eval_open_no_region_and_out_of_order_calls_are_refused():
    model, inputs = _chain(depth=4)
    planned = apply_choices(copy.deepcopy(model), {Segment("layers.0", "layers.2"): Choice("full", "fp32")})
    segment = planned.layers[0].forward.segment
    with torch.no_grad():
        torch.testing.assert_close(planned.eval()(*inputs), model.eval()(*inputs))
    assert segment.region is None
    planned.train()
    scale = torch.ones(16)
    with pytest.raises(SegmentError, match="out of order"):
        planned.layers[0](inputs[0], scale)
        planned.layers[2](inputs[0], scale)
    assert segment.region is None  # closed: no hooks left behind


def test_segments_train_the_same_under_torch_compile():
    torch._dynamo.reset()
    model, inputs = _chain(depth=4)
    model.eval()  # dropout masks are not replayable across eager and compiled code
    planned = apply_choices(copy.deepcopy(model), {Segment("layers.0", "layers.2"): Choice("full", "fp32")})
    compiled = torch.compile(planned, backend="aot_eager")  # the segment's blocks run eagerly, between graphs
    try:
        torch.testing.assert_close(_train_step(compiled, inputs), _train_step(model, inputs))
    finally:
        torch._dynamo.reset()
    for (name, a), b in zip(model.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


@pytest.mark.slow  # the whole pipeline
def test_llama_layers_form_segments_priced_and_trained_exactly():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attention_dropout=0.1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 32, (2, 64))
    batch = {"input_ids": ids, "labels": ids}
    _, profile = _floor(model, batch)
    assert chains(profile) == [[0, 1, 2, 3]]  # decoder layers fed one another's hidden states
    choices = {"model.layers.0–model.layers.2": Choice("full", "fp32"), "model.layers.3": Choice("full", "fp32")}
    traced = trace(model, training_batch(model, batch, None, None))  # as plan() traces it
    simulated = simulate_plan(traced, choices_by_unit(profile, choices), device=DEVICE, optimizer="adamw", rest_precision="fp32").peak_bytes
    assert abs(predict_peak(profile, choices).bytes - simulated) <= 0.05 * simulated
    planned = apply_choices(copy.deepcopy(model), choices_by_unit(profile, choices))
    losses = []
    for net in (model, planned):
        torch.manual_seed(1)
        output = net(**batch)
        output.loss.backward()
        losses.append(output.loss.detach())
    torch.testing.assert_close(losses[1], losses[0])
    for (name, a), b in zip(model.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


@pytest.mark.slow  # the whole pipeline
def test_the_plan_is_never_worse_than_any_single_level_of_stages_of_blocks():
    from tests.structures import by_name
    from autoplan.trace.discovery import unit_levels

    model, inputs = by_name("stages of blocks (stages[i].blocks[j])").build()
    options = dict(example_inputs=inputs, device="cpu", precision="fp32", reserve=0, menu_size=0)
    levels = [autoplan.plan(model, "10GB", units=[unit.name for unit in level.units], segments=False, **options) for level in unit_levels(model)]
    budget = max(level.prediction.minimum_peak_bytes for level in levels) + 1
    mixed = autoplan.plan(model, budget, **options)
    assert mixed.prediction.minimum_peak_bytes <= min(level.prediction.minimum_peak_bytes for level in levels)
    for level in levels:
        at_budget = autoplan.plan(model, budget, units=[u.name for u in level.decisions.units], segments=False, **options)
        assert mixed.prediction.step_time_s <= at_budget.prediction.step_time_s * (1 + 1e-4)  # the solver's gap
