"""Random module trees for the plan-space guarantee: structures no test names.

`module_trees()` is a hypothesis strategy of `Tree` specs; `build_tree(spec)` makes the model.
A tree nests containers of every kind (`nn.Sequential`, `nn.ModuleList`, `nn.ModuleDict`, a custom
module with attributes) 1 to 3 deep, around leaf blocks (Linear–GELU–Linear, some with
BatchNorm or dropout). Containers may add residuals, one may carry a long skip (U-Net style), and
a block may be shared, applied several times per forward (ALBERT style). The leaves are what a
person would checkpoint by hand (`tests/handmade.py`); every call of a shared one is
checkpointed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import torch.nn as nn
from hypothesis import strategies as st

from tests.structures import Structure

WIDTH, BATCH = 16, 64
CONTAINERS = ("sequential", "modulelist", "moduledict", "custom")


@dataclass(frozen=True)
class Leaf:
    batchnorm: bool = False
    dropout: bool = False


@dataclass(frozen=True)
class Shared:
    leaf: Leaf
    times: int  # calls per forward, each with a residual add


@dataclass(frozen=True)
class Container:
    kind: str  # one of CONTAINERS
    children: tuple["Node", ...]
    residual: bool = False  # x = x + child(x) (not for nn.Sequential, which only chains)
    skip: bool = False  # the first child's output is added to the last child's input


Node = Union[Leaf, Shared, Container]


class Block(nn.Sequential):
    """A leaf: what a person would checkpoint by hand."""


def _leaf(spec: Leaf) -> Block:
    layers: list[nn.Module] = [nn.Linear(WIDTH, 2 * WIDTH)]
    if spec.batchnorm:
        layers.append(nn.BatchNorm1d(2 * WIDTH))
    layers.append(nn.GELU())
    if spec.dropout:
        layers.append(nn.Dropout(0.2))
    layers.append(nn.Linear(2 * WIDTH, WIDTH))
    return Block(*layers)


class SharedRepeat(nn.Module):
    def __init__(self, block: nn.Module, times: int) -> None:
        super().__init__()
        self.block, self.times = block, times

    def forward(self, x):
        for _ in range(self.times):
            x = x + self.block(x)
        return x


class Chain(nn.Module):
    """A ModuleList / ModuleDict / attribute holder called in order, with optional residual and skip."""

    def __init__(self, kind: str, children: list[nn.Module], residual: bool, skip: bool) -> None:
        super().__init__()
        self.kind, self.residual, self.skip = kind, residual, skip
        if kind == "modulelist":
            self.items = nn.ModuleList(children)
        elif kind == "moduledict":
            self.items = nn.ModuleDict({f"k{i}": child for i, child in enumerate(children)})
        else:
            self.names = [f"part{i}" for i in range(len(children))]
            for name, child in zip(self.names, children):
                self.add_module(name, child)

    def ordered(self) -> list[nn.Module]:
        if self.kind == "modulelist":
            return list(self.items)
        if self.kind == "moduledict":
            return [self.items[key] for key in self.items]
        return [getattr(self, name) for name in self.names]

    def forward(self, x):
        children = self.ordered()
        first = None
        for index, child in enumerate(children):
            if self.skip and index == len(children) - 1 and first is not None:
                x = x + first
            y = child(x)
            x = x + y if self.residual else y
            if index == 0:
                first = x
        return x


def _build(spec: Node, leaves: list[nn.Module]) -> nn.Module:
    if isinstance(spec, Leaf):
        block = _leaf(spec)
        leaves.append(block)
        return block
    if isinstance(spec, Shared):
        block = _leaf(spec.leaf)
        leaves.append(block)
        return SharedRepeat(block, spec.times)
    children = [_build(child, leaves) for child in spec.children]
    if spec.kind == "sequential":
        return nn.Sequential(*children)
    return Chain(spec.kind, children, spec.residual, spec.skip)


class Generated(nn.Module):
    def __init__(self, spec: Node) -> None:
        super().__init__()
        self.leaves: list[nn.Module] = []
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.body = _build(spec, self.leaves)
        self.head = nn.Linear(WIDTH, 1)
        self.leaves = tuple(self.leaves)  # not registered twice: a plain tuple of the body's blocks

    def forward(self, x):
        return self.head(self.body(self.stem(x)))


def structure_of(spec: Node) -> Structure:
    def build():
        torch.manual_seed(0)
        return Generated(spec), (torch.randn(BATCH, WIDTH),)

    return Structure(f"generated {spec}", build, lambda model: list(model.leaves))


leaves = st.builds(Leaf, batchnorm=st.booleans(), dropout=st.booleans())


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.builds(
        Container,
        kind=st.sampled_from(CONTAINERS),
        children=st.lists(children, min_size=2, max_size=3).map(tuple),
        residual=st.booleans(),
        skip=st.booleans(),
    )


def module_trees(max_depth: int = 3) -> st.SearchStrategy:
    """Specs of module trees 1 to `max_depth` containers deep (the root is always a container)."""
    node: st.SearchStrategy = st.one_of(leaves, st.builds(Shared, leaves, st.integers(2, 3)))
    for _ in range(max_depth - 1):
        node = st.one_of(node, _containers(node))
    return _containers(node)
