"""Sequence parallelism as planned: the residual stream split along the sequence between the split linears.

Under tensor parallelism alone every rank holds the whole residual stream: each block's input, its norms'
inputs and outputs, the sums after attention and the MLP, each [batch, sequence, width] on every rank.
Sequence parallelism (torchtitan applies it with every tensor-parallel plan; torch's `SequenceParallel`,
`PrepareModuleInput` and `RowwiseParallel(output_layouts=Shard(1))`) keeps one Nth of the sequence on
each rank there: the first block's input is split, each norm runs on its rank's part, the input of the
attention and of the MLP is all-gathered whole before their column-wise linears, and the row-wise
linear's partial output is reduce-scattered back to the rank's part in place of the all-reduce. The
head's input is gathered whole (a split head's logits are gathered whole too, so the loss is the whole one).

In the rank twin (`inputs.tensor_parallel.rank_model`) these are written where torch's DTensor makes
them, byte for byte: the split is a clone of the rank's part (`Shard._replicate_to_shard`), a gather is
torch's `all_gather_into_tensor` (the ranks stacked along the first dimension) then a cat along the
sequence unless the batch is one (`_maybe_view_chunk_cat`), and a reduce-scatter is a cat of the
sequence's chunks along the first dimension then `reduce_scatter_tensor` (`_chunk_or_narrow_cat`). Each
one's backward takes the gradient back to its input's placement (`_BACKWARD`). The norms need no change:
they compute on whatever part they are given.

Two layouts are known: torchtitan's Llama names (`layers.*.attention_norm`, `.attention`, `.ffn_norm`,
`.feed_forward`, `norm`, `output`) and transformers' Llama family (`model.layers.*.input_layernorm`,
`.self_attn`, `.post_attention_layernorm`, `.mlp`, `model.norm`, `lm_head`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autoplan.errors import OptionError
from autoplan.instruments.collectives import all_gathered, reduce_scattered

SEQUENCE_DIM = 1  # [batch, sequence, width]: the dimension split, as torchtitan's Shard(1)


@dataclass(frozen=True)
class SequenceLayout:
    """Where a model's residual stream is split, run in parts and gathered (module names)."""

    first_block: str  # its input is split along the sequence
    # modules whose input is gathered whole, each with the keyword it takes that input by (None: the first argument)
    gathered: tuple[tuple[str, str | None], ...]
    norms: tuple[str, ...]  # run on the rank's part (torch's SequenceParallel), the final norm last
    head: str  # its input gathered whole


@dataclass(frozen=True)
class _Family:
    blocks: str  # the ModuleList of blocks
    norms: tuple[str, ...]  # in each block
    gathered: tuple[tuple[str, str | None], ...]  # in each block
    final_norm: str
    head: str


_FAMILIES = (
    _Family("layers", ("attention_norm", "ffn_norm"), (("attention", None), ("feed_forward", None)), "norm", "output"),
    _Family("model.layers", ("input_layernorm", "post_attention_layernorm"), (("self_attn", "hidden_states"), ("mlp", None)),
            "model.norm", "lm_head"),
)


def resolve_sequence_layout(model: torch.nn.Module, split_linears: tuple[tuple[str, str], ...]) -> SequenceLayout:
    """The model's layout for sequence parallelism; an OptionError where it has neither known layout, or a split linear
    lies outside every gathered module (its input would be the rank's part of the sequence, not the whole)."""
    modules = dict(model.named_modules())
    for family in _FAMILIES:
        blocks = modules.get(family.blocks)
        if not isinstance(blocks, torch.nn.ModuleList) or not len(blocks):
            continue
        names = [f"{family.blocks}.{index}" for index in range(len(blocks))]
        wanted = [f"{block}.{leaf}" for block in names for leaf in (*family.norms, *(name for name, _ in family.gathered))]
        if any(name not in modules for name in (*wanted, family.final_norm, family.head)):
            continue
        gathered = tuple((f"{block}.{leaf}", keyword) for block in names for leaf, keyword in family.gathered)
        _check_nothing_else_learns(blocks, names, family)
        outside = [name for name, style in split_linears if not any(name.startswith(f"{inside}.") for inside, _ in gathered)
                   and (name, style) != (family.head, "colwise_gather_output")]  # a split head gathers its own input
        if outside:
            raise OptionError(f"sequence_parallel: {outside[0]} is split but lies outside the attention and MLP modules whose "
                              "input is gathered whole; split only their linears, or leave sequence_parallel off")
        norms = tuple(f"{block}.{leaf}" for block in names for leaf in family.norms) + (family.final_norm,)
        return SequenceLayout(names[0], gathered, norms, family.head)
    raise OptionError(f"sequence_parallel: {type(model).__name__} has neither torchtitan's Llama layout (layers.N.attention_norm, "
                      ".attention, .ffn_norm, .feed_forward, norm, output) nor transformers' Llama family's (model.layers.N."
                      "input_layernorm, .self_attn, .post_attention_layernorm, .mlp, model.norm, lm_head); plan it with "
                      "tensor parallelism alone (sequence_parallel=False)")


def _check_nothing_else_learns(blocks: torch.nn.ModuleList, names: list[str], family: _Family) -> None:
    """Every parameter of a block lies in its norms or its gathered modules: anything else would run on the rank's part
    of the sequence with a weight torch's SequenceParallel does not hold (Gemma 2's pre- and post-feedforward norms)."""
    known = (*family.norms, *(leaf for leaf, _ in family.gathered))
    for name, block in zip(names, blocks):
        stray = [leaf for leaf, _ in block.named_parameters() if not leaf.startswith(tuple(f"{part}." for part in known))]
        if stray:
            raise OptionError(f"sequence_parallel: {name}.{stray[0]} is outside the norms ({', '.join(family.norms)}) and the "
                              f"modules whose input is gathered whole; sequence parallelism is laid out for blocks of those "
                              "alone (torchtitan's and transformers' Llama family): leave sequence_parallel off for this model")


def split_sequence(twin: torch.nn.Module, layout: SequenceLayout, ranks: int) -> None:
    """Write sequence parallelism into a rank twin whose linears are split already: the first block's input split, the
    gathered modules' and the head's inputs gathered (forward pre-hooks, where torch's PrepareModuleInput runs)."""
    twin.get_submodule(layout.first_block).register_forward_pre_hook(_on_input("split", None, ranks), with_kwargs=True)
    for name, keyword in (*layout.gathered, (layout.head, None)):
        twin.get_submodule(name).register_forward_pre_hook(_on_input("gather", keyword, ranks), with_kwargs=True)


def _on_input(change: str, keyword: str | None, ranks: int):
    def hook(module, args, kwargs):
        if keyword is not None and keyword in kwargs:
            return args, {**kwargs, keyword: redistributed(_checked(kwargs[keyword], module), ranks, change)}
        return (redistributed(_checked(args[0], module), ranks, change), *args[1:]), kwargs
    return hook


def _checked(x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """`x`, said to be [batch, sequence, ...] where a module of the layout takes something else."""
    if x.dim() < 2:
        raise OptionError(f"sequence_parallel: {type(module).__name__}'s input is {tuple(x.shape)}, not [batch, sequence, ...]")
    return x


def _check_divides(x: torch.Tensor, ranks: int, dim: int) -> None:
    if x.shape[dim] % ranks:
        raise OptionError(f"sequence_parallel over {ranks} ranks: the sequence ({x.shape[dim]}) does not divide by "
                          f"{ranks}; give a sequence length that does, or leave sequence_parallel off")


def gather_sequence(x: torch.Tensor, ranks: int, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Every rank's part, whole along `dim`: funcol.all_gather_single(x, gather_dim=dim), as DTensor calls it."""
    stacked = all_gathered(x.contiguous(), ranks)
    dim = dim % x.dim()
    if x.shape[0] == 1 and math.prod(x.shape[1:dim]) == 1:  # the ranks' parts lie in order already: a view
        return stacked.view(*x.shape[:dim], ranks * x.shape[dim], *x.shape[dim + 1:])
    return torch.cat(torch.chunk(stacked, ranks, dim=0), dim=dim)


def scatter_sequence(x: torch.Tensor, ranks: int, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """This rank's part of the sum of every rank's `x`: funcol.reduce_scatter_single(x, scatter_dim=dim), as DTensor calls it."""
    _check_divides(x, ranks, dim)
    x = x if x.is_contiguous() else x.contiguous()
    return reduce_scattered(torch.cat(torch.chunk(x, ranks, dim=dim), dim=0), ranks)


def _part(x: torch.Tensor, ranks: int, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Replicate -> Shard(dim): this rank's part, a clone, as `Shard._replicate_to_shard` makes it."""
    _check_divides(x, ranks, dim)
    return x.narrow(dim, 0, x.shape[dim] // ranks).clone()


# DTensor's changes of a dimension's placement, each with its backward, which takes the gradient back to the input's
# placement from its own: a split (Replicate -> Shard) gathers it whole; a gather (Shard -> Replicate) before
# column-wise linears gets their partial sums and reduce-scatters them, a gather of their output (a head's logits,
# "gather_output") a whole gradient and keeps this rank's part; a scatter (Partial -> Shard, a row-wise linear's
# output) gathers it whole
_FORWARD = {"split": _part, "gather": gather_sequence, "gather_output": gather_sequence, "scatter": scatter_sequence}
_BACKWARD = {"split": gather_sequence, "gather": scatter_sequence, "gather_output": _part, "scatter": gather_sequence}


class _Redistributed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, ranks: int, change: str, dim: int) -> torch.Tensor:
        ctx.ranks, ctx.change, ctx.dim = ranks, change, dim
        return _FORWARD[change](x, ranks, dim)

    @staticmethod
    def backward(ctx, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _BACKWARD[ctx.change](gradient, ctx.ranks, ctx.dim), None, None, None


def redistributed(x: torch.Tensor, ranks: int, change: str, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """`x` split, gathered or scattered along `dim` (`_FORWARD`'s names), differentiably."""
    return _Redistributed.apply(x, ranks, change, dim)
