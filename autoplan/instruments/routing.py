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
do tensors computed only from values (`instruments.values`), so code that reads them
(`if expert_idx == self.num_experts: continue`, `weights[expert_idx]`) runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from autoplan.instruments.values import VALUE_LIMIT, KnownValues, for_real


_NONZERO = torch.ops.aten.nonzero.default
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


NOT_ANSWERED = object()


def _first_positions(rows: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The first `rows` positions of a tensor of `shape` in row-major order, as `nonzero` lists them."""
    with for_real():
        if not shape:
            return torch.zeros((rows, 0), dtype=torch.int64)
        return torch.stack(torch.unravel_index(torch.arange(rows), shape), dim=1)


class RoutingTracker:
    """The part of the planning fake mode that answers data-dependent routing with `bound`."""

    def __init__(self, bound: MoeRoutingBound = WORST_CASE, values: KnownValues | None = None) -> None:
        self.bound = bound
        self.values = values if values is not None else KnownValues()
        self.router: RouterShape | None = None
        self.bounded_calls = 0  # nonzeros answered with rows_per_expert: one per expert per layer run
        self.whole_calls = 0  # nonzeros after a router answered with every element: which experts ran, or a mask of another shape
        self.largest_router: RouterShape | None = None

    def before(self, func, args, kwargs, empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> Any:
        """The answer to an op fake tensors cannot answer without values, or NOT_ANSWERED."""
        if func is not _NONZERO:
            return NOT_ANSWERED
        source = args[0]
        if self.values.value_of(source) is not None or self.router is None:
            # computed from values (the values answer it exactly), or not routing: fake tensors' own refusal stands
            return NOT_ANSWERED
        rows = self._rows(source.numel())
        out = empty((rows, source.dim()), torch.int64)
        if rows * max(source.dim(), 1) <= VALUE_LIMIT:
            self.values.know(out, _first_positions(rows, tuple(source.shape)), frozenset())
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
        """Note a router."""
        if func in _ROUTERS and isinstance(args[0], torch.Tensor) and args[0].is_floating_point() and args[0].dim() > 0:
            self._note_router(func, args, kwargs)

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
