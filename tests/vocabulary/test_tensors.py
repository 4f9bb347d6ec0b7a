"""vocabulary.tensors: the one flattening helper, and bytes as the CUDA allocator rounds them."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from autoplan.vocabulary.tensors import rounded_bytes, storage_bytes, tensors_of

Pair = namedtuple("Pair", "first second")


@dataclass
class Output:  # an object pytree does not know, read through its attributes
    loss: torch.Tensor
    logits: torch.Tensor


def _by_pytree(tree) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def test_tensors_come_in_pytrees_order_whether_the_tree_is_plain_or_not() -> None:
    a, b, c, d = (torch.randn(2) for _ in range(4))
    trees = [
        a,
        (a, 1, None, torch.float16, torch.device("cpu"), torch.Size([2, 3]), "x", 2.5),
        ([a, [b, (c,)]], {"z": d, "a": a}),  # a dict keeps insertion order, as pytree's
        ((a, b), {"out_dtype": torch.bfloat16, "dim": [0, 1]}),
        (Pair(a, b), c),  # a namedtuple: not plain, read by pytree
        OrderedDict(second=b, first=a),
        (a, torch.nn.Parameter(b)),
        (),
        ([], {}),
    ]
    for tree in trees:
        found = tensors_of(tree)
        assert [id(t) for t in found] == [id(t) for t in _by_pytree(tree)], tree
    assert tensors_of(a) == [a]
    assert [id(t) for t in tensors_of(Pair(a, (b, c)))] == [id(a), id(b), id(c)]


def test_an_unknown_object_is_read_through_its_attributes_and_a_plain_leaf_holds_none() -> None:
    loss, logits = torch.randn(()), torch.randn(2, 3)
    assert [id(t) for t in tensors_of(Output(loss, logits))] == [id(loss), id(logits)]
    assert tensors_of((1, Output(loss, logits))) == []  # inside a tree it is a leaf, as pytree has it
    assert tensors_of((1, "two", None, torch.int64)) == []


def test_storage_bytes_round_up_to_the_allocators_granule() -> None:
    assert rounded_bytes(1) == 512 and rounded_bytes(512) == 512 and rounded_bytes(513) == 1024
    x = torch.zeros(129)  # 516 bytes
    assert storage_bytes(x) == 1024 and storage_bytes(x[:1]) == 1024  # a view counts its whole storage
