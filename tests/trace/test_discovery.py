"""Tests for autoplan.trace: input normalisation, unit discovery, tracing and its fallbacks."""

from __future__ import annotations

import copy

import networkx as nx
import pytest
import torch
import torch.nn as nn

from autoplan.planned.graph import split_by_units
from autoplan.errors import TraceError
from autoplan.inputs.batch import normalize_inputs
from autoplan.trace.tracer import Traced, trace
import autoplan
from autoplan.trace.discovery import find_units, unit_levels
from autoplan.units import GraphRun, SequentialRun, Unit
from autoplan.vocabulary.names import unit_endpoints, unit_module
from tests.cli_factories import convmixer
from tests.models import (
    ALL_MODELS,
    BasicBlock,
    ConvBlock,
    LoRABlock,
    make_flat,
    make_lora,
    make_mlp,
    make_skipnet,
    make_small_resnet,
    make_tiny_gpt,
)

# -- normalize_inputs -------------------------------------------------------------------------


def test_normalize_tuple_is_positional_args() -> None:
    a, b = torch.randn(2), torch.randn(3)
    args, kwargs = normalize_inputs((a, b))
    assert kwargs == {}
    assert len(args) == 2 and args[0] is a and args[1] is b


def test_normalize_list_is_positional_args() -> None:
    a = torch.randn(2)
    args, kwargs = normalize_inputs([a, 3])
    assert args == (a, 3) and kwargs == {}


def test_normalize_dict_is_kwargs() -> None:
    x = torch.randn(2)
    args, kwargs = normalize_inputs({"idx": x})
    assert args == ()
    assert list(kwargs) == ["idx"] and kwargs["idx"] is x


def test_normalize_args_kwargs_pair() -> None:
    x, y = torch.randn(2), torch.randn(2)
    args, kwargs = normalize_inputs(((x,), {"targets": y}))
    assert len(args) == 1 and args[0] is x
    assert list(kwargs) == ["targets"] and kwargs["targets"] is y
    # a list of args in the pair is accepted too and comes back as a tuple
    args, kwargs = normalize_inputs(([x], {}))
    assert isinstance(args, tuple) and args[0] is x and kwargs == {}


def test_normalize_single_tensor() -> None:
    x = torch.randn(4, 4)
    args, kwargs = normalize_inputs(x)
    assert isinstance(args, tuple) and len(args) == 1 and args[0] is x
    assert kwargs == {}


@pytest.mark.parametrize("bad", [5, 2.5, "tokens", None, {1, 2}])
def test_normalize_bad_type_raises_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="example_inputs must be") as info:
        normalize_inputs(bad)
    assert type(bad).__name__ in str(info.value)


def test_normalize_result_is_a_fresh_dict() -> None:
    given = {"idx": torch.randn(1)}
    _, kwargs = normalize_inputs(given)
    kwargs["other"] = 1
    assert "other" not in given


def _names(units: list[Unit]) -> list[str]:
    return [unit.name for unit in units]


# -- find_units -------------------------------------------------------------------------------


def test_find_units_tiny_gpt_blocks() -> None:
    model, _ = make_tiny_gpt()
    assert _names(find_units(model)) == ["transformer.h.0", "transformer.h.1"]


def test_find_units_small_resnet_basic_blocks() -> None:
    model, _ = make_small_resnet()
    units = _names(find_units(model))
    assert units == ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]
    assert all(isinstance(model.get_submodule(u), BasicBlock) for u in units)


def test_find_units_skipnet_conv_blocks() -> None:
    model, _ = make_skipnet()
    units = _names(find_units(model))
    # the conv blocks, and their sibling the head: every child with parameters of what holds them
    assert sorted(units) == sorted(["e1", "e2", "e3", "d3", "d2", "d1", "head"])
    assert all(isinstance(model.get_submodule(u), ConvBlock) for u in units if u != "head")


def test_find_units_lora_blocks() -> None:
    model, _ = make_lora()
    units = _names(find_units(model))
    assert units == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(isinstance(model.get_submodule(u), LoRABlock) for u in units)


def test_find_units_plain_sequential_is_cut_into_runs() -> None:
    model, _ = make_mlp()
    units = find_units(model)
    # 6 Linear layers with a GELU after each but the last: one run per Linear
    assert _names(units) == ["[0:2]", "[2:4]", "[4:6]", "[6:8]", "[8:10]", "[10:11]"]
    for unit in units:
        first, last = unit_endpoints(model, unit)
        assert isinstance(first, nn.Linear)
        run = unit_module(model, unit)
        assert isinstance(run, nn.Sequential)
        assert run[0] is first and run[-1] is last
    # the runs cover every layer exactly once, in order
    covered = [layer for unit in units for layer in unit_module(model, unit)]
    assert covered == list(model)


def test_find_units_nested_sequential_run_names_its_parent() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    model = Wrapper()
    units = find_units(model)
    assert _names(units) == ["net[0:2]", "net[2:4]", "net[4:5]"]
    first, last = unit_endpoints(model, SequentialRun("net", 2, 4))
    assert first is model.net[2] and last is model.net[3]


def _modules_run(unit: Unit) -> list[str]:
    return unit.layer_names() if isinstance(unit, SequentialRun) else [unit.name]


def test_convmixer_sequential_units_never_overlap() -> None:
    """A flat Sequential of stem, repeated blocks and head (issue 27 item 5): the blocks are units by
    their own names and the stem and head runs of the layers around them; no module is in two units
    (it was: "0" and "[0:2]", "3" and "[3:4]", "4.1" and "4[1:3]", ...)."""
    model, _ = convmixer()
    levels = unit_levels(model)
    assert tuple(_names(levels[0].units)) == ("[0:2]", "[2:3]", "3", "4", "5", "6", "7", "8", "9", "10", "[13:14]")
    for level in levels:
        modules = [m for unit in level.units for m in _modules_run(unit)]
        for i, a in enumerate(modules):
            for b in modules[i + 1:]:
                assert a != b and not a.startswith(b + ".") and not b.startswith(a + "."), (level.source, a, b)


@pytest.mark.slow  # the whole pipeline
def test_convmixer_plan_says_nothing_never_ran_and_trains_like_the_original() -> None:
    model, inputs = convmixer()
    lowest = autoplan.plan(model, "1GB", example_inputs=inputs, precision="fp32", reserve=0).prediction.minimum_peak_bytes
    plan = autoplan.plan(model, lowest, example_inputs=inputs, precision="fp32", reserve=0)
    assert "never ran" not in plan.report()  # every module ran; a unit overlapping another was called "never ran"
    assert any(unit.choice.mode != "keep" for unit in plan.decisions.units)  # the plan does rewrite something
    planned = autoplan.apply(copy.deepcopy(model), plan)
    for step in range(2):  # twice: BatchNorm's running statistics are updated once per step, recompute or not
        losses = []
        for net in (model, planned):
            net.zero_grad(set_to_none=True)
            loss = net(*inputs).square().mean()
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[1], losses[0]), step
        for (name, a), b in zip(model.named_parameters(), planned.parameters()):
            assert torch.equal(b.grad, a.grad), name
        for (name, a), b in zip(model.named_buffers(), planned.buffers()):
            assert torch.equal(b, a), name


def test_find_units_pattern() -> None:
    model, _ = make_tiny_gpt()
    assert _names(find_units(model, ["transformer.h.*"])) == ["transformer.h.0", "transformer.h.1"]
    # a bare string is accepted as one pattern
    assert _names(find_units(model, "transformer.h.*")) == ["transformer.h.0", "transformer.h.1"]


def test_find_units_pattern_outermost_wins() -> None:
    model, _ = make_tiny_gpt()
    # "*" also matches everything inside the blocks; only the outermost matches are units
    assert find_units(model, ["transformer.h.*"]) == find_units(model, ["transformer.h.[01]"])
    units = find_units(model, ["transformer.h.0", "transformer.h.0.attn", "transformer.h.1.mlp"])
    assert _names(units) == ["transformer.h.0", "transformer.h.1.mlp"]


def test_find_units_pattern_matching_nothing_names_top_level_submodules() -> None:
    model, _ = make_tiny_gpt()
    with pytest.raises(TraceError) as info:
        find_units(model, ["layers.*"])
    message = str(info.value)
    assert "layers.*" in message
    assert "transformer" in message and "lm_head" in message
    assert "GPT" in message


def test_trace_error_is_a_value_error() -> None:
    assert issubclass(TraceError, ValueError)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class _TwoDifferentChildren(nn.Module):
    """No repeated class and no Sequential: nothing to split automatically."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _Encoder()
        self.decoder = _Decoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def test_find_units_cuts_a_model_without_repeats_at_articulation_points() -> None:
    assert _names(find_units(_TwoDifferentChildren())) == ["graph[encoder_fc:relu]", "graph[decoder_fc:decoder_fc]"]


def test_graph_units_start_at_parametric_layers_and_never_cut_a_residual() -> None:
    model, _ = make_flat()
    # fc_mid's residual (h + relu(fc_mid(h))) stays whole: nothing inside it separates input from output
    assert _names(find_units(model)) == [
        "graph[fc_in:gelu]",
        "graph[norm:norm]",
        "graph[mul:mul]",  # multiplies by the parameter `gain`
        "graph[fc_mid:add]",
        "graph[fc_wide:drop]",
        "graph[fc_out:fc_out]",
    ]


def test_split_by_units_computes_the_model_with_its_own_layers() -> None:
    model, (x,) = make_flat()
    model.eval()
    split = split_by_units(model, find_units(model))
    assert type(split).__name__ == "FlatNet"
    assert split.get_submodule("graph[fc_mid:add]").run.fc_mid is model.fc_mid
    torch.testing.assert_close(split(x), model(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="graph units are"):
        split_by_units(model, [GraphRun("fc_in", "nowhere")])


class _OneLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * 2


def test_find_units_with_nothing_to_cut_suggests_units() -> None:
    with pytest.raises(TraceError) as info:
        find_units(_OneLayer())
    message = str(info.value)
    assert "units=" in message
    assert "_OneLayer" in message


def test_find_units_named_units_work_where_automatic_fails() -> None:
    model = _TwoDifferentChildren()
    assert _names(find_units(model, ["encoder", "decoder"])) == ["encoder", "decoder"]
    traced = trace(model, (torch.randn(2, 8),), units=["encoder", "decoder"])
    assert traced.unit_names == ("encoder", "decoder")
    assert traced.method == "symbolic_trace"


# -- trace ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_trace_zoo_models_use_symbolic_trace(name: str) -> None:
    model, inputs = ALL_MODELS[name]()
    traced = trace(model, inputs)
    assert isinstance(traced, Traced)
    assert traced.method == "symbolic_trace"
    assert traced.trace_errors == ()
    assert isinstance(traced.graph, torch.fx.Graph)
    if name == "flat":  # graph units: planned on a GraphModule made of the model's own layers
        assert {id(p) for p in traced.model.parameters()} == {id(p) for p in model.parameters()}
    else:
        assert traced.model is model
    assert sorted(traced.unit_names) == sorted(_names(find_units(model)))
    args, kwargs = traced.example_inputs
    assert isinstance(args, tuple) and isinstance(kwargs, dict)
    graph = traced.unit_graph
    assert isinstance(graph, nx.DiGraph)
    assert "input" in graph and "output" in graph
    for unit in traced.unit_names:
        assert unit in graph
    # data flows from the input to the output through the units
    assert nx.has_path(graph, "input", "output")
    for unit in traced.unit_names:
        assert nx.has_path(graph, "input", unit) and nx.has_path(graph, unit, "output")


def test_trace_leaves_units_as_leaf_calls() -> None:
    model, inputs = make_tiny_gpt()
    traced = trace(model, inputs)
    called = [str(n.target) for n in traced.graph.nodes if n.op == "call_module"]
    assert "transformer.h.0" in called and "transformer.h.1" in called
    # the inside of a unit is not traced through
    assert not any(target.startswith("transformer.h.0.") for target in called)


def test_trace_units_in_execution_order() -> None:
    model, inputs = make_skipnet()
    traced = trace(model, inputs)
    # defined e1 e2 e3 d3 d2 d1 head, and run in that order
    assert traced.unit_names == ("e1", "e2", "e3", "d3", "d2", "d1", "head")


class _Reversed(nn.Module):
    """Blocks defined 0, 1, 2 but run 2, 1, 0."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Encoder() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            x = block(x)
        return x


def test_trace_orders_units_by_execution_not_definition() -> None:
    traced = trace(_Reversed(), (torch.randn(2, 8),))
    assert traced.unit_names == ("blocks.2", "blocks.1", "blocks.0")
    chain = [("input", "blocks.2"), ("blocks.2", "blocks.1"), ("blocks.1", "blocks.0"), ("blocks.0", "output")]
    assert all(traced.unit_graph.has_edge(*edge) for edge in chain)
    assert traced.skip_edges == ()


def test_trace_chain_has_no_skip_edges() -> None:
    model, inputs = make_tiny_gpt()
    traced = trace(model, inputs)
    assert traced.skip_edges == ()
    assert traced.unit_graph.has_edge("transformer.h.0", "transformer.h.1")
    assert traced.unit_graph.has_edge("input", "transformer.h.0")
    assert traced.unit_graph.has_edge("transformer.h.1", "output")


def test_trace_skipnet_has_skip_edges() -> None:
    model, inputs = make_skipnet()
    traced = trace(model, inputs)
    assert ("e1", "d1") in traced.skip_edges
    assert ("e2", "d2") in traced.skip_edges
    assert set(traced.skip_edges) == {("e1", "d1"), ("e2", "d2")}
    for a, b in traced.skip_edges:
        assert traced.unit_graph.has_edge(a, b)
    # neighbours are ordinary edges, not skips
    assert traced.unit_graph.has_edge("e1", "e2")
    assert ("e1", "e2") not in traced.skip_edges


def test_trace_mlp_sequential_runs() -> None:
    model, inputs = make_mlp()
    traced = trace(model, inputs)
    assert traced.method == "symbolic_trace"
    assert traced.unit_names == ("[0:2]", "[2:4]", "[4:6]", "[6:8]", "[8:10]", "[10:11]")
    for a, b in zip(traced.unit_names, traced.unit_names[1:]):
        assert traced.unit_graph.has_edge(a, b)
    assert traced.skip_edges == ()


def test_trace_accepts_every_input_form() -> None:
    model, (idx,) = make_tiny_gpt()
    targets = torch.randint(0, 64, idx.shape)
    for inputs in ((idx,), idx, {"idx": idx}, ((idx,), {"targets": targets})):
        traced = trace(model, inputs)
        assert traced.unit_names == ("transformer.h.0", "transformer.h.1")
    assert trace(model, ((idx,), {"targets": targets})).example_inputs[1]["targets"] is targets


def test_trace_bad_inputs_raise_type_error() -> None:
    model, _ = make_tiny_gpt()
    with pytest.raises(TypeError):
        trace(model, 42)


# -- fallbacks --------------------------------------------------------------------------------


class _DataDependent(nn.Module):
    """Python control flow on the value of an activation (computed from the weights): neither tracer can
    follow it, nor the simulation, which knows the batch's values but not the weights'."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Encoder() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks[0](x).sum() > 0:
            x = x * 2
        for block in self.blocks:
            x = block(x)
        return x


class _ShapeDependent(nn.Module):
    """Python control flow on a shape: symbolic_trace sees a Proxy, export sees the real int."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Encoder() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 4:
            x = x * 2
        for block in reversed(self.blocks):
            x = block(x)
        return x


def test_data_dependent_model_defeats_both_tracers() -> None:
    model, x = _DataDependent(), torch.randn(3, 8)
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(model)
    with pytest.raises(Exception):
        torch.export.export(model, (x,), strict=False)


def test_untraceable_model_without_units_raises_trace_error() -> None:
    with pytest.raises(TraceError) as info:
        trace(_DataDependent(), (torch.randn(3, 8),))
    message = str(info.value)
    assert "_DataDependent" in message
    assert "symbolic_trace" in message
    assert "torch.export" in message
    assert "units=" in message


def test_untraceable_model_with_units_raises_naming_the_line_and_each_tracer() -> None:
    # Naming the units does not help a forward that needs tensor values: the simulation cannot
    # run it either, so the error says which line did it and what each tracer tripped on.
    with pytest.raises(TraceError) as info:
        trace(_DataDependent(), (torch.randn(3, 8),), units=["blocks.*"])
    message = str(info.value)
    assert "symbolic_trace" in message and "torch.export" in message and "fake tensors" in message
    assert "test_discovery.py" in message and "if self.blocks[0](x).sum() > 0" in message
    assert "torch.where" in message and "units=" in message


def test_a_model_no_tracer_follows_is_traced_by_running_it() -> None:
    class Unflattenable(nn.Module):
        """A keyword-only forward returning an object no tracer can build as an output."""

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([_Encoder() for _ in range(3)])

        def forward(self, *, x: torch.Tensor, flags: dict) -> "Unflattenable.Out":
            a = self.blocks[0](x)
            b = self.blocks[1](a)
            if flags["skip"]:
                b = b + a
            out = Unflattenable.Out()
            out.value = self.blocks[2](b)
            return out

        class Out:
            value: torch.Tensor

    model = Unflattenable()
    traced = trace(model, {"x": torch.randn(3, 8), "flags": {"skip": True}})
    assert traced.method == "hooks"
    assert traced.graph is None
    assert len(traced.trace_errors) == 2
    assert traced.unit_names == ("blocks.0", "blocks.1", "blocks.2")
    assert traced.skip_edges == (("blocks.0", "blocks.2"),)
    assert traced.unit_graph.has_edge("input", "blocks.0")
    assert traced.unit_graph.has_edge("blocks.2", "output")
    without_skip = trace(model, {"x": torch.randn(3, 8), "flags": {"skip": False}})
    assert without_skip.skip_edges == ()


def test_shape_dependent_model_falls_back_to_export() -> None:
    model, x = _ShapeDependent(), torch.randn(3, 8)
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(model)
    traced = trace(model, (x,))
    assert traced.method == "export"
    assert isinstance(traced.graph, torch.fx.Graph)
    assert len(traced.trace_errors) == 1 and "symbolic_trace" in traced.trace_errors[0]
    # units come back in execution order (reversed), recovered from export's module stacks
    assert traced.unit_names == ("blocks.2", "blocks.1", "blocks.0")
    graph = traced.unit_graph
    assert "input" in graph and "output" in graph
    for edge in [("blocks.2", "blocks.1"), ("blocks.1", "blocks.0"), ("blocks.0", "output")]:
        assert graph.has_edge(*edge), edge
    assert traced.skip_edges == ()


def test_export_fallback_finds_skip_edges() -> None:
    class ShapeSkip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([_Encoder() for _ in range(3)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 1:
                x = x + 1
            a = self.blocks[0](x)
            b = self.blocks[1](a)
            return self.blocks[2](b + a)

    traced = trace(ShapeSkip(), (torch.randn(3, 8),))
    assert traced.method == "export"
    assert traced.unit_names == ("blocks.0", "blocks.1", "blocks.2")
    assert traced.skip_edges == (("blocks.0", "blocks.2"),)


def test_a_pattern_that_matches_a_module_list_plans_the_blocks_it_holds() -> None:
    """A ModuleList is never called: `--units 'b*'` matching `blocks` means its blocks (it was exit 6, "never ran")."""
    from tests.cli_factories import tiny_mlp

    model, _ = tiny_mlp()
    assert [unit.name for unit in unit_levels(model, ["b*"])[0].units] == ["blocks.0", "blocks.1"]
    assert [unit.name for unit in unit_levels(model, ["blocks", "blocks.1"])[0].units] == ["blocks.0", "blocks.1"]
