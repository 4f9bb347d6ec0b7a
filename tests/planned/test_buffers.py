"""planned.buffers: a recomputed unit updates its buffers once per step, and recomputes from what the forward saw.

Blocks that count their calls, keep an exponential moving average that their output reads, and
BatchNorm (its running statistics, and with momentum=None a cumulative average that reads
num_batches_tracked), checkpointed full, selective, and as one segment: after three steps the
losses, gradients, parameters and every buffer equal the model run without a plan.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoplan

from autoplan.plan import Choice
from autoplan.planned.buffers import BufferWrites
from autoplan.planned.forwards import apply_choices
from autoplan.planned.segments import PlannedSegment, SegmentMember
from autoplan.units import ModuleUnit, Segment


class CountsCalls(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.linear(x)) * (1.0 + 0.1 * self.calls)  # the output reads the count


class MovingAverage(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("average", torch.zeros(width))

    def forward(self, x):
        h = self.linear(x)
        self.average.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return torch.relu(h - self.average)  # the output reads the updated average


class Normed(nn.Module):
    def __init__(self, width: int, momentum: float | None) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width, momentum=momentum)

    def forward(self, x):
        return torch.relu(self.norm(self.linear(x)))


class Stack(nn.Module):
    def __init__(self, width: int = 16, cumulative: bool = True) -> None:
        super().__init__()
        # momentum=None reads num_batches_tracked's value in forward: planning knows it (instruments.values)
        last = Normed(width, None) if cumulative else Normed(width, 0.2)
        self.blocks = nn.ModuleList([CountsCalls(width), MovingAverage(width), Normed(width, 0.1), last])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def _train(model: nn.Module, steps: int = 3) -> list[float]:
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, 16))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_trains_alike(plain: nn.Module, planned: nn.Module) -> None:
    assert _train(planned) == pytest.approx(_train(plain), rel=1e-6)
    for (name, a), (_, b) in zip(plain.state_dict().items(), planned.state_dict().items()):
        torch.testing.assert_close(b, a, msg=name)  # parameters and every buffer: calls, average, running stats


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_each_recomputed_block_updates_its_buffers_once(mode):
    torch.manual_seed(0)
    plain = Stack()
    planned = apply_choices(copy.deepcopy(plain), {ModuleUnit(f"blocks.{i}"): Choice(mode, "fp32") for i in range(4)})
    _assert_trains_alike(plain, planned)
    assert int(planned.blocks[0].calls) == 3  # three steps, three calls: not six


def test_a_segment_updates_its_blocks_buffers_once():
    torch.manual_seed(0)
    plain = Stack()
    planned = copy.deepcopy(plain)
    blocks = list(planned.blocks)
    segment = PlannedSegment(Segment("blocks.0", "blocks.3"), blocks, Choice("full", "fp32"), [None] * 4)
    for index, block in enumerate(blocks):
        block.forward = SegmentMember(segment, index)
    _assert_trains_alike(plain, planned)


def test_what_is_written_is_learned_on_the_first_forward_and_copied_alone_after():
    block = MovingAverage(4)
    writes = BufferWrites(block)
    first = writes.before_forward()
    assert set(first.copies) == {(id(block), "average")}  # the first forward: every buffer, to learn which
    block(torch.randn(2, 4))
    writes.after_forward(first)
    assert writes.written == ((id(block), "average"),)
    untouched = BufferWrites(nn.BatchNorm1d(4).eval())
    snapshot = untouched.before_forward()
    untouched.after_forward(snapshot)  # an eval-mode BatchNorm writes nothing
    assert untouched.written == () and untouched.before_forward() is None and not snapshot.copies


def test_the_plan_names_the_recomputed_units_that_write_buffers():
    torch.manual_seed(0)
    plan = autoplan.plan(Stack(cumulative=False), "1GB", example_inputs=(torch.randn(8, 16),), device="cpu", precision="fp32", reserve=0,
                         units=["blocks.*"], checkpoint={"blocks.*": "full"})
    note = next(note for note in plan.notes if note.startswith("recomputed units whose forward writes buffers"))
    assert "blocks.0 (calls)" in note and "blocks.1 (average)" in note
    assert "blocks.2 (norm.running_mean, norm.running_var, norm.num_batches_tracked)" in note
    kept = autoplan.plan(Stack(cumulative=False), "1GB", example_inputs=(torch.randn(8, 16),), device="cpu", precision="fp32", reserve=0,
                         units=["blocks.*"], checkpoint={"blocks.*": "keep"})
    assert not any("writes buffers" in note for note in kept.notes)  # nothing recomputed, nothing to say


def test_a_cumulative_batchnorm_is_planned_and_trains_as_without_a_plan():
    """Issue 39: BatchNorm1d(momentum=None) divides by num_batches_tracked's value in forward; planning failed (exit 6)
    blaming "values computed from the weights". The counter's value is known to the simulation now."""
    torch.manual_seed(0)
    plain = Stack(cumulative=True)
    planned = copy.deepcopy(plain)
    plan = autoplan.plan(planned, "1GB", example_inputs=(torch.randn(8, 16),), device="cpu", precision="fp32", reserve=0,
                         units=["blocks.*"], checkpoint={"blocks.*": "full"})
    assert any("blocks.3 (norm.running_mean, norm.running_var, norm.num_batches_tracked)" in note for note in plan.notes)
    assert plan.model.batch_values == ()  # a buffer's value is not the batch's: verify asks no batch to match it
    assert int(planned.blocks[3].norm.num_batches_tracked) == 0  # planning ran fakes: the model's counter is untouched
    autoplan.apply(planned, plan)
    _assert_trains_alike(plain, planned)


def test_a_cumulative_batchnorm_on_the_meta_device_is_a_clear_error():
    """The counter a cumulative BatchNorm divides by has no value on the meta device: say so, not "values computed from
    the weights", and say what to do."""
    from autoplan.errors import ProfileError

    with torch.device("meta"):
        model = Stack(cumulative=True)
    with pytest.raises(ProfileError) as raised:
        autoplan.plan(model, "1GB", example_inputs=(torch.randn(8, 16),), device="cpu", units=["blocks.*"])
    message = str(raised.value)
    assert "blocks.3.norm is a BatchNorm with momentum=None" in message and "num_batches_tracked's value" in message
    assert "on the meta device the model has none" in message and "plan it with a momentum (e.g. 0.1)" in message
    assert "computed from the weights" not in message
