"""A segment's forward (`planned.segments`), on its own: consecutive blocks installed as the members of
one `PlannedSegment`, run by the model's own loop. Their output and gradients equal the blocks run in
order without it (dropout included), backward recomputes them as one region (first block to last,
once), nothing is opened without grad, and calls it cannot replay are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoplan.errors import SegmentError
from autoplan.verify.allocator import AllocatorCount
from autoplan.plan import Choice
from autoplan.planned.segments import PlannedSegment, SegmentMember
from autoplan.units import Segment
from autoplan.vocabulary.tensors import rounded_bytes


class Block(nn.Module):
    """A block that logs each run of its forward: (which block, forward or recompute)."""

    def __init__(self, index: int, log: list) -> None:
        super().__init__()
        self.index, self.log = index, log
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, scale):
        self.log.append(self.index)
        return x + self.drop(torch.tanh(self.fc(x))) * scale


class Loop(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.log: list[int] = []
        self.blocks = nn.ModuleList(Block(i, self.log) for i in range(depth))

    def forward(self, x):
        scale = torch.full((8,), 0.5)  # the same tensor for every block: the first block's argument
        for block in self.blocks:
            x = block(x, scale)
        return x


def _install(model: Loop, mode: str = "full") -> PlannedSegment:
    unit = Segment("blocks.0", "blocks.2")
    segment = PlannedSegment(unit, list(model.blocks), Choice(mode, "fp32"), [None] * len(model.blocks))
    for index, block in enumerate(model.blocks):
        block.forward = SegmentMember(segment, index)
    return segment


def _step(model: Loop, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    torch.manual_seed(5)
    out = model(x)
    out.pow(2).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, x.grad


def test_the_segment_trains_like_the_blocks_run_in_order() -> None:
    torch.manual_seed(0)
    model, x = Loop(), torch.randn(4, 8)
    expected = _step(model, x)
    _install(model)
    got = _step(model, x)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert got[1].keys() == expected[1].keys()
    for name in expected[1]:
        torch.testing.assert_close(got[1][name], expected[1][name], rtol=0, atol=0, msg=name)  # dropout masks replayed
    torch.testing.assert_close(got[2], expected[2], rtol=0, atol=0)


def test_backward_recomputes_the_blocks_as_one_region() -> None:
    torch.manual_seed(0)
    model, x = Loop(), torch.randn(4, 8, requires_grad=True)
    segment = _install(model)
    out = model(x)
    assert model.log == [0, 1, 2] and segment.region is None  # the last block closed the region
    model.log.clear()
    out.sum().backward()
    # one region: replayed from its first block to its last, each once (per-block checkpoints would go 2, 1, 0)
    assert model.log == [0, 1, 2]


def test_the_region_holds_only_the_first_blocks_inputs_until_backward() -> None:
    """After forward, the blocks' activations are gone: what stays is the region's saved inputs (x,
    the caller's, and scale, made in forward) and the output; the plain blocks hold ten times that."""
    torch.manual_seed(0)
    plain, x = Loop(depth=4), torch.randn(64, 8, requires_grad=True)
    segmented = Loop(depth=4)
    segmented.load_state_dict(plain.state_dict())
    _install(segmented)
    output_bytes, scale_bytes = rounded_bytes(64 * 8 * 4), rounded_bytes(8 * 4)
    assert _held_after_forward(segmented, x) == output_bytes + scale_bytes
    assert _held_after_forward(plain, x) > 8 * (output_bytes + scale_bytes)


def _held_after_forward(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes made during one forward that are still live when it returns (x was made before)."""
    with AllocatorCount(resident=(model, x)) as count:  # the CPU allocator's reports, not the simulation's tracker
        out = model(x)
        count.mark("backward")
        out.sum().backward()
    forward, backward = count.stretches()
    return backward.start_bytes - forward.start_bytes


def test_without_grad_nothing_is_opened_or_recomputed() -> None:
    torch.manual_seed(0)
    model, x = Loop(), torch.randn(4, 8)
    expected = model.eval()(x)
    segment = _install(model)
    model.log.clear()
    with torch.no_grad():
        got = model(x)
        assert segment.region is None
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert model.log == [0, 1, 2]


def test_a_block_called_out_of_order_is_refused_and_the_region_closed() -> None:
    model, x = Loop(), torch.randn(4, 8, requires_grad=True)
    segment = _install(model)
    scale = torch.ones(8)
    h = model.blocks[0](x, scale)
    assert segment.region is not None
    with pytest.raises(SegmentError, match="segment blocks.0–blocks.2: block 2 ran out of order"):
        model.blocks[2](h, scale)
    assert segment.region is None


def test_a_tensor_the_region_cannot_replay_is_refused() -> None:
    model, x = Loop(), torch.randn(4, 8, requires_grad=True)
    segment = _install(model)
    scale = torch.ones(8)
    model.blocks[0](x, scale)
    with pytest.raises(SegmentError, match="neither the previous block's output nor an argument of the first block"):
        model.blocks[1](torch.randn(4, 8), scale)  # not the first block's output
    assert segment.region is None


def test_a_forward_that_failed_midway_leaves_no_region_open() -> None:
    model, x = Loop(), torch.randn(4, 8, requires_grad=True)
    segment = _install(model)
    scale = torch.ones(8)
    h = model.blocks[0](x, scale)
    with pytest.raises(TypeError):
        model.blocks[1](h, "half")  # the block's own error: a string for the scale
    assert segment.region is None
    model.log.clear()
    model(x).sum().backward()  # the next step opens a region of its own and replays it
    assert model.log == [0, 1, 2, 0, 1, 2] and segment.region is None
