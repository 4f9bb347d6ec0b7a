"""Mixture-of-experts routing whose shapes depend on the data, profiled on fake tensors as a bound.

A mixture-of-experts layer written the common eager way picks each expert's tokens by value:
`top_k_pos, token_idx = torch.where(expert_mask[e])` (`aten.nonzero`), gathers those rows, runs
the expert on them and adds them back (`index_add_`). Fake tensors have no values, so torch cannot
say how many rows `nonzero` returns and refuses (DynamicOutputShapeException). The planning fake
mode (`instruments.fake.PlanningFakeMode`) answers with a bound instead (`RoutingTracker`):

- the router is the last `topk` (or `max` over a dimension, top-1) of a floating-point tensor: its
  rows are the tokens T, `k` the experts per token, the size of the dimension it picks from the
  experts E;
- a `nonzero` over one expert's mask (a tensor of T or T·k elements) returns
  `MoeRoutingBound.rows_per_expert` rows: T in the worst case (top-k picks k *different* experts, so
  an expert receives each token at most once), or ⌈capacity · T · k / E⌉ (at most T) with a capacity;
- any other `nonzero` after a router (which experts were hit: E or E + 1 elements) returns every
  element: every expert runs.

Why that bounds the real step: an eager per-expert loop allocates, per expert, tensors whose rows
are the tokens that expert received. Simulated with every expert running on at least as many rows
as the routing gives it, every allocation is at least as large as in the real step and the real
step's skipped experts allocate nothing, so the simulated live bytes are at least the real ones at
every point of the step. In the worst case that holds for any routing; with a capacity, for any
routing that sends no expert more tokens than the capacity allows.

The answer's rows are the tensor's first positions (row-major), and they carry those values, as
do small integer tensors computed only from values (`ValueTable`), so code that reads them
(`if expert_idx == self.num_experts: continue`, `weights[expert_idx]`) runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

VALUE_LIMIT = 1 << 16  # elements: integer tensors up to this size carry their values (indices, expert ids)

_NONZERO = torch.ops.aten.nonzero.default
_SCALAR_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default)
_ROUTERS = (torch.ops.aten.topk.default, torch.ops.aten.max.dim)


@dataclass(frozen=True)
class MoeRoutingBound:
    """How many tokens each expert is profiled with where routing decides shapes.

    capacity None is the worst case: every expert receives every token. A capacity c means each
    expert receives at most ⌈c · tokens · top_k / experts⌉ tokens (c = 1: perfectly balanced).
    """

    capacity: float | None = None

    def rows_per_expert(self, router: RouterShape) -> int:
        if self.capacity is None:
            return router.tokens
        return min(router.tokens, math.ceil(self.capacity * router.tokens * router.top_k / router.experts))

    @property
    def name(self) -> str:
        return "worst case" if self.capacity is None else f"capacity {self.capacity:g}"


WORST_CASE = MoeRoutingBound()


def check_moe_capacity(capacity: Any) -> MoeRoutingBound:
    """`plan(moe_capacity=...)` as a bound: None for the worst case, else a positive finite number."""
    from autoplan.errors import OptionError

    if capacity is None:
        return WORST_CASE
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not 0 < capacity < math.inf:
        raise OptionError(
            f"moe_capacity (--moe-capacity on the command line) must be a positive number: each expert is profiled with "
            f"moe_capacity × tokens × top_k / experts tokens (1.0: balanced routing); got {capacity!r}. Leave it out "
            "to profile the worst case (every expert receives every token)"
        )
    return MoeRoutingBound(float(capacity))


@dataclass(frozen=True)
class RouterShape:
    """What a router (`topk` over expert scores) says about the routing, without values."""

    tokens: int  # rows routed: the scores' elements over the experts
    top_k: int  # experts per token
    experts: int  # the size of the dimension the router picks from


class ValueTable:
    """Values of small integer fake tensors computed from values only (indices the bound chose, expert ids)."""

    def __init__(self) -> None:
        self._values: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def of(self, tensor: Any) -> torch.Tensor | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        if not isinstance(tensor, torch._subclasses.fake_tensor.FakeTensor):
            return tensor  # a real tensor is its own value
        return self._values.get(tensor)

    def attach(self, fake: torch.Tensor, value: torch.Tensor) -> None:
        if value.numel() <= VALUE_LIMIT and not value.is_floating_point():
            self._values[fake] = value

    def all_valued(self, args: Any, kwargs: Any) -> bool:
        """Every fake tensor among the arguments has a value, and at least one does."""
        if not len(self._values):
            return False  # the common case, checked first: most runs never route
        leaves = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)]
        fakes = [leaf for leaf in leaves if isinstance(leaf, torch._subclasses.fake_tensor.FakeTensor)]
        return bool(fakes) and all(fake in self._values for fake in fakes)

    def real(self, tree: Any) -> Any:
        return tree_map(lambda leaf: self.of(leaf) if isinstance(leaf, torch.Tensor) else leaf, tree)


NOT_ANSWERED = object()


class RoutingTracker:
    """The part of the planning fake mode that answers data-dependent routing with `bound`."""

    def __init__(self, bound: MoeRoutingBound = WORST_CASE) -> None:
        self.bound = bound
        self.values = ValueTable()
        self.router: RouterShape | None = None
        self.bounded_calls = 0  # nonzeros answered with rows_per_expert: one per expert per layer run
        self.whole_calls = 0  # nonzeros after a router answered with every element: which experts ran, or a mask of another shape
        self.largest_router: RouterShape | None = None

    def before(self, func, args, kwargs, empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> Any:
        """The answer to an op fake tensors cannot answer without values, or NOT_ANSWERED."""
        if func in _SCALAR_READS and self.values.all_valued(args, kwargs):
            return func(*self.values.real(args), **self.values.real(kwargs))
        if func is not _NONZERO:
            return NOT_ANSWERED
        source = args[0]
        value = self.values.of(source)
        if value is not None:  # computed from values: the exact answer
            exact = torch.nonzero(value)
            out = empty(tuple(exact.shape), exact.dtype)
            self.values.attach(out, exact)
            return out
        if self.router is None:
            return NOT_ANSWERED  # no router ran: not routing, so fake tensors' own refusal stands
        rows = self._rows(source.numel())
        out = empty((rows, source.dim()), torch.int64)
        if rows * max(source.dim(), 1) <= VALUE_LIMIT:
            positions = torch.unravel_index(torch.arange(rows), tuple(source.shape)) if source.dim() else ()
            self.values.attach(out, torch.stack(positions, dim=1) if source.dim() else torch.zeros((rows, 0), dtype=torch.int64))
        return out

    def _rows(self, elements: int) -> int:
        router = self.router
        assert router is not None  # called after a router ran
        one_expert = elements in (router.tokens, router.tokens * router.top_k)
        expert_list = elements in (router.experts, router.experts + 1)
        if one_expert and not expert_list:
            self.bounded_calls += 1
            return min(elements, self.bound.rows_per_expert(router))
        self.whole_calls += 1
        return elements  # every element nonzero: the most any tensor of this size can give

    def after(self, func, args, kwargs, out: Any) -> None:
        """Note a router; give `out` values when it was computed from values only."""
        if func in _ROUTERS and isinstance(args[0], torch.Tensor) and args[0].is_floating_point() and args[0].dim() > 0:
            self._note_router(func, args, kwargs)
        elif self.values.all_valued(args, kwargs):
            real = func(*self.values.real(args), **self.values.real(kwargs))
            for fake, value in zip(tree_flatten(out)[0], tree_flatten(real)[0]):
                if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor):
                    self.values.attach(fake, value)

    def _note_router(self, func, args, kwargs) -> None:
        scores = args[0]
        if func is torch.ops.aten.topk.default:
            k = args[1]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        else:
            k, dim = 1, args[1]
        experts = scores.shape[dim]
        if experts <= 1 or k >= experts:
            return
        self.router = RouterShape(scores.numel() // experts, k, experts)
        if self.largest_router is None or self.router.tokens > self.largest_router.tokens:
            self.largest_router = self.router

    @property
    def assumed(self) -> str:
        """How routing was profiled, in a word (`Plan.moe_routing`); "" when no routing decided a shape."""
        if self.bounded_calls:
            return self.bound.name
        return WORST_CASE.name if self.whole_calls else ""

    def note(self) -> str:
        """How routing was profiled, for the plan's notes ("" when no routing decided a shape)."""
        if not self.bounded_calls:
            return self._whole_note() if self.whole_calls else ""
        router = self.largest_router
        assert router is not None  # bounded_calls counts calls after a router ran
        rows = self.bound.rows_per_expert(router)
        if self.bound.capacity is None:
            return (f"mixture of experts: routing decides shapes here (torch.where/nonzero on the expert mask); profiled at the "
                    f"worst case, every expert receiving all {router.tokens} tokens of a layer (top-{router.top_k} of "
                    f"{router.experts} experts sends a token to an expert at most once): the plan holds for any routing; "
                    f"moe_capacity (--moe-capacity) plans for balanced routing with less headroom")
        return (f"mixture of experts: routing decides shapes here (torch.where/nonzero on the expert mask); profiled at "
                f"capacity {self.bound.capacity:g}, {rows} tokens per expert ({self.bound.capacity:g} × {router.tokens} tokens "
                f"× top-{router.top_k} / {router.experts} experts): a batch whose routing sends an expert more tokens than "
                f"that may peak above the plan")

    def _whole_note(self) -> str:
        unused = (f"; moe_capacity={self.bound.capacity:g} did not apply: no nonzero had the shape of one expert's mask "
                  "(tokens, or tokens × top_k elements, after a topk router)") if self.bound.capacity is not None else ""
        return ("mixture of experts: routing decides shapes here (nonzero after a router); profiled at the worst case, "
                "every element of each such mask nonzero: the plan holds for any routing" + unused)
