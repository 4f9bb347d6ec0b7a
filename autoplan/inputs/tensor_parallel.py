"""Tensor parallelism as planned: which linears are split, and the one rank's model the plan is made for.

Under tensor parallelism (torch's `parallelize_module` with `ColwiseParallel` / `RowwiseParallel`, as
torchtitan and transformers' `tp_plan` apply it), each of N ranks holds a slice of every split linear and
computes on it: a column-wise linear the slice of its outputs (its weight's rows), a row-wise one the
slice of its inputs (its weight's columns) and a partial sum of its outputs, which an all-reduce makes
whole. What one rank holds and computes is then an ordinary model whose split linears are smaller:
`rank_model` builds it, and every later stage plans it as it plans one device (FSDP, where the mesh has
it too, shards this rank's model further).

The collectives are written into that model where they allocate, as torch's functional collectives do
(`_c10d_functional.all_reduce` returns a new tensor): a row-wise linear's forward all-reduce is a copy
of its partial output, and a column-wise linear's input gradient, a partial sum across ranks, is copied
by its all-reduce in backward; both are `instruments.collectives.all_reduced`, which the roofline prices
at the card's interconnect (a recomputed unit pays its forward all-reduces again). Checked against torch's
own DTensor step on gloo ranks, counted by the CPU allocator (tests/apply/test_tensor_parallel.py).

The layout (module name -> "colwise" | "rowwise" | "colwise_gather_output") is the person's
`tensor_parallel_plan` (patterns), else the model's own: transformers' `model.tp_plan` (those entries),
or torchtitan's Llama names (attention.wq/wk/wv, feed_forward.w1/w3 column-wise; attention.wo,
feed_forward.w2 row-wise; the head `output` column-wise with its logits gathered). An output head split
by the vocabulary ("colwise_gather_output", `GatheredColwiseShard`) gathers its logits whole on every
rank, so the loss is the whole one; a head tied to the embedding stays whole, as do embeddings
(vocabulary-parallel embeddings and a parallel loss are not planned). With sequence parallelism (`inputs.sequence_parallel`) the residual stream between
the split linears is one Nth of the sequence on each rank.
"""

from __future__ import annotations

import copy
import fnmatch
from collections import Counter
from typing import Mapping

import torch
import torch.nn.functional as F

from autoplan.errors import OptionError
from autoplan.instruments.collectives import all_reduced
from autoplan.inputs.sequence_parallel import SequenceLayout, redistributed, split_sequence
from autoplan.inputs.settings import STYLES

TORCHTITAN_LAYOUT = {"*attention.wq": "colwise", "*attention.wk": "colwise", "*attention.wv": "colwise",
                     "*attention.wo": "rowwise", "*feed_forward.w1": "colwise", "*feed_forward.w3": "colwise",
                     "*feed_forward.w2": "rowwise", "output": "colwise_gather_output"}

Layout = tuple[tuple[str, str], ...]  # (module name, style), in the model's module order


class _AllReducedGradient(torch.autograd.Function):
    """The identity forward; backward all-reduces the gradient over `ranks`, a new tensor as torch's collective makes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ranks: int) -> torch.Tensor:
        ctx.ranks = ranks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduced(gradient, ctx.ranks), None


class ColwiseShard(torch.nn.Linear):
    """One rank's slice of a column-wise parallel linear: its share of the outputs; the input's gradient all-reduced."""

    split_by_tensor_parallel = True  # planned.wrappers: a checkpointed unit holding one recomputes whole
    ranks = 1  # the tensor-parallel degree it is split over (`_slice` sets it)
    sequence_parallel = False  # its input is gathered whole before it, and its gradient reduce-scattered there

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return F.linear(x, self.weight, self.bias)
        return F.linear(_AllReducedGradient.apply(x, self.ranks), self.weight, self.bias)


class RowwiseShard(torch.nn.Linear):
    """One rank's slice of a row-wise parallel linear: its share of the inputs; the partial output all-reduced.

    The bias is whole on every rank, as DTensor keeps it (replicated); where torch adds it to the partial sums
    changes values, not bytes."""

    split_by_tensor_parallel = True
    ranks = 1
    sequence_parallel = False  # the partial output reduce-scattered to this rank's part of the sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return redistributed(F.linear(x, self.weight, self.bias), self.ranks, "scatter")
        return all_reduced(F.linear(x, self.weight, self.bias), self.ranks)


class GatheredColwiseShard(ColwiseShard):
    """One rank's slice of an output head split by its outputs (the vocabulary): its logits gathered whole on every rank,
    as torch's `ColwiseParallel(output_layouts=Replicate())` does (transformers' "colwise_gather_output"), so the loss
    is the whole one; its gradient comes back whole and the rank keeps its part."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return redistributed(super().forward(x), self.ranks, "gather_output", -1)


def _model_layout(model: torch.nn.Module) -> tuple[tuple[str, str], ...]:
    """The patterns the model brings: transformers' tp_plan (its entries of the styles planned), else torchtitan's names."""
    own = getattr(model, "tp_plan", None)
    if isinstance(own, Mapping) and own:
        return tuple((pattern, style) for pattern, style in own.items() if style in STYLES)
    return tuple(TORCHTITAN_LAYOUT.items())


def _tied_parameters(model: torch.nn.Module) -> set[int]:
    """The ids of parameters more than one module holds (a head tied to its embedding)."""
    held = Counter(id(parameter) for _, parameter in model.named_parameters(remove_duplicate=False))
    return {ident for ident, holders in held.items() if holders > 1}


def resolve_layout(model: torch.nn.Module, degree: int, given: tuple[tuple[str, str], ...] | None) -> Layout:
    """Every linear the patterns name, with its style, checked to divide by `degree`. No linear named: an OptionError."""
    patterns = given if given is not None else _model_layout(model)
    layout, others = [], []
    tied = _tied_parameters(model)
    for name, module in model.named_modules():
        style = next((style for pattern, style in patterns if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None:
            continue
        if not isinstance(module, torch.nn.Linear):
            others.append(f"{name} ({type(module).__name__})")
            continue
        columns = style.startswith("colwise")
        size = module.out_features if columns else module.in_features
        if size % degree:
            raise OptionError(f"{name} is {style} over {degree} ranks, but its {'outputs' if columns else 'inputs'} "
                              f"({size}) do not divide by {degree}: choose a tensor_parallel that divides them")
        if style == "colwise_gather_output" and id(module.weight) in tied:
            if given is not None:
                raise OptionError(f"tensor_parallel_plan splits {name}, whose weight is tied to another module's (the "
                                  "embedding's): leave it whole")
            continue  # tied to the embedding, which stays whole: the head stays whole too
        layout.append((name, style))
    if others:
        raise OptionError(f"tensor_parallel_plan names modules that are not nn.Linear: {', '.join(others[:3])}; only linears "
                          "are split column- or row-wise")
    if not layout:
        source = "tensor_parallel_plan" if given is not None else "the model's own layout (its tp_plan, else torchtitan's layer names)"
        raise OptionError(f"tensor_parallel={degree}: {source} names no linear of {type(model).__name__}; pass "
                          "tensor_parallel_plan={'pattern': 'colwise' | 'rowwise'} naming its attention and MLP linears "
                          "(an option of autoplan.plan and Planner; the command line has no flag for it)")
    return tuple(layout)


SEARCHED_DEGREES = (2, 4, 8)  # what world_size="auto" tries beside FSDP alone: within one node's NVLink, as torchtitan runs it


def degrees_to_plan(model: torch.nn.Module, tensor_parallel: int | str,
                    given: tuple[tuple[str, str], ...] | None) -> tuple[tuple[int, Layout], ...]:
    """The tensor-parallel degrees to plan, each with its layout: the one given, or for "auto" (world_size="auto" too)
    1 and every degree of SEARCHED_DEGREES the model's layout divides by (none where it has no layout: FSDP alone then)."""
    if tensor_parallel != "auto":
        degree = int(tensor_parallel)
        return ((degree, resolve_layout(model, degree, given) if degree > 1 else ()),)
    found: list[tuple[int, Layout]] = [(1, ())]
    for degree in SEARCHED_DEGREES:
        try:
            found.append((degree, resolve_layout(model, degree, given)))
        except OptionError:
            continue  # a linear this degree does not divide, or no layout at all: not a degree of this model
    return tuple(found)


def rank_model(model: torch.nn.Module, layout: Layout, degree: int, sequence: SequenceLayout | None = None) -> torch.nn.Module:
    """What one rank of `degree` holds and runs: `model`'s modules copied, every other tensor shared with it, each
    split linear replaced by its rank-0 slice (`ColwiseShard`, `RowwiseShard`; copies of the slices' values); with
    `sequence`, the residual stream between them split along the sequence (`inputs.sequence_parallel`)."""
    shared = {id(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, memo=dict(shared))
    for name, style in layout:
        parent_name, _, leaf = name.rpartition(".")
        parent = twin.get_submodule(parent_name)
        whole = getattr(parent, leaf)
        shard = _slice(whole, style, degree)
        shard.sequence_parallel = sequence is not None  # type: ignore[assignment]  # a class attribute, set per instance
        setattr(parent, leaf, shard)
    if sequence is not None:
        split_sequence(twin, sequence, degree)
    return twin


def _slice(whole: torch.nn.Linear, style: str, degree: int) -> torch.nn.Linear:
    weight = whole.weight.detach()
    kind: type[torch.nn.Linear]
    if style.startswith("colwise"):
        kind = GatheredColwiseShard if style == "colwise_gather_output" else ColwiseShard
        part = weight[: whole.out_features // degree]
        bias = whole.bias.detach()[: whole.out_features // degree] if whole.bias is not None else None
    else:
        kind, part = RowwiseShard, weight[:, : whole.in_features // degree]
        bias = whole.bias.detach() if whole.bias is not None else None
    shard = kind.__new__(kind)
    torch.nn.Module.__init__(shard)
    shard.in_features, shard.out_features = part.shape[1], part.shape[0]
    shard.ranks = degree  # type: ignore[assignment]  # a class attribute of the shards, not a submodule
    shard.weight = torch.nn.Parameter(part.clone(memory_format=torch.contiguous_format), requires_grad=whole.weight.requires_grad)
    shard.bias = None if bias is None else torch.nn.Parameter(bias.clone(), requires_grad=whole.bias.requires_grad)
    return shard
