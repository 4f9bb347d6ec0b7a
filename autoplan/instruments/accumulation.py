"""Where autograd adds gradients together, and so where a real step adds them in place.

When two paths of the graph send a gradient to the same input (a residual connection, a tensor
used twice, a tied weight), the autograd engine adds them: into the first one, in place, when it
holds the only reference (`InputBuffer::accumulate`), and a parameter's `.grad` likewise across
micro-batches (`AccumulateGrad`). Under any dispatch mode torch takes every tensor for a subclass
(`at::isTensorSubclassLike`) and adds out of place instead: one more gradient-sized buffer for a
moment. The simulation always runs under the tracker, so it would count that buffer at every such
point; the CPU allocator's count of a real step, which runs with no mode, showed plans a gradient
buffer above the real peak wherever a backward peak sat on one (2.7% on a LoRA toy, and floors a
few KiB above checkpointing by hand).

`accumulating_adds(tracker, root)` marks, with a pre-hook and a hook on every node of the graph
below `root`, the stretches of a backward where the engine itself, not a node's formula, is running:
after a node has run and before the next one starts (the engine adding its outputs into the next
nodes' buffers), and inside `AccumulateGrad`. The tracker counts an out-of-place `add` there as the
in-place one the real engine makes, when an operand's buffer is freed as it returns (instruments.tracker).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch


class _Flagged(Protocol):
    engine_accumulates: bool


@contextlib.contextmanager
def accumulating_adds(tracker: _Flagged, root: torch.Tensor | None) -> Iterator[None]:
    """While inside, `tracker.engine_accumulates` says whether the autograd engine is adding gradients now."""
    handles = []
    for node in _graph_nodes(root):
        leaf = type(node).__name__ == "AccumulateGrad"
        handles.append(node.register_prehook(_setter(tracker, leaf)))
        handles.append(node.register_hook(_after(tracker)))
    try:
        yield
    finally:
        tracker.engine_accumulates = False
        for handle in handles:
            handle.remove()


def _setter(tracker: _Flagged, value: bool):
    def prehook(grad_outputs):
        tracker.engine_accumulates = value

    return prehook


def _after(tracker: _Flagged):
    def hook(grad_inputs, grad_outputs):
        tracker.engine_accumulates = True  # the engine adds this node's outputs into the next nodes' buffers

    return hook


def _graph_nodes(root: torch.Tensor | None) -> list:
    """Every node of the autograd graph below `root`, each once."""
    start = getattr(root, "grad_fn", None)
    found, seen, pending = [], set(), [start] if start is not None else []
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        pending.extend(following for following, _ in node.next_functions if following is not None)
    return found
