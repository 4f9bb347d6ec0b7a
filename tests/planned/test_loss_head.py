"""The fused loss head (planned.loss_head): the same training, less memory, no more FLOPs, and a plan that says so."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import autoplan
from autoplan.plan import OutsideUnits
from autoplan.planned.forwards import apply_choices, fused_losses, remove_plan
from autoplan.verify.allocator import AllocatorCount
from examples.llama import Llama, LlamaConfig, example_batch

CONFIG = LlamaConfig(vocab_size=2048, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
LOGITS_BYTES = 4 * 64 * 2048 * 4  # batch × sequence × vocabulary, fp32


def _llama(tie: bool = False):
    torch.manual_seed(0)
    return Llama(LlamaConfig(**{**CONFIG.__dict__, "tie_embeddings": tie})), example_batch(CONFIG, 4, 64)


def _train(model, inputs, steps: int = 3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for _ in range(steps):
        loss = model(*inputs)
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


@pytest.mark.parametrize("tie", [False, True], ids=["own head", "tied to the embedding"])
def test_the_fused_head_trains_like_the_loss_as_written(tie):
    written, inputs = _llama(tie)
    fused = apply_choices(copy.deepcopy(written), {}, OutsideUnits(fused_loss=True))
    expected, fused_run = _train(written, inputs), _train(fused, inputs)
    assert fused_losses(fused) == ("256×2048",)
    torch.testing.assert_close(torch.stack(fused_run[0]), torch.stack(expected[0]))
    for step_grads, expected_grads in zip(fused_run[1], expected[1]):
        for name, grad in expected_grads.items():
            torch.testing.assert_close(step_grads[name], grad, msg=name)
    for (name, p), q in zip(written.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q, p, msg=name)


def _peak_and_flops(model, inputs):
    with FlopCounterMode(display=False) as counter:
        model(*inputs).backward()
    model.zero_grad(set_to_none=True)
    with AllocatorCount(resident=model) as count:  # the CPU allocator's reports, not the simulation's tracker
        model(*inputs).backward()
    model.zero_grad(set_to_none=True)
    return count.peak_bytes, counter.get_total_flops()


def test_the_fused_head_holds_less_and_adds_no_flops():
    written, inputs = _llama()
    fused = apply_choices(copy.deepcopy(written), {}, OutsideUnits(fused_loss=True))
    written_peak, written_flops = _peak_and_flops(written, inputs)
    fused_peak, fused_flops = _peak_and_flops(fused, inputs)
    assert fused_flops == written_flops
    # as written, backward starts holding the log-softmax and two gradients of the logits' size; fused,
    # the peak is the logits themselves at the end of the forward, beside the gradients of the head
    assert fused_peak <= written_peak - LOGITS_BYTES


class _Head(torch.nn.Module):
    """A linear head and a cross-entropy written one of several ways."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.body = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, x, target):
        logits = self.head(torch.relu(self.body(x)))
        if self.kind == "ignore_index, sum":
            return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=-100, reduction="sum")
        if self.kind == "float, mean":
            return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
        if self.kind == "reduction none":
            return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").mean()
        if self.kind == "label smoothing":
            return F.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=0.1)
        if self.kind == "class dimension second":
            return F.cross_entropy(logits.transpose(1, 2), target)
        if self.kind == "logits used twice":
            return F.cross_entropy(logits.flatten(0, 1), target.flatten()) + 1e-3 * logits.pow(2).mean()
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind, fuses", [
    ("ignore_index, sum", True), ("float, mean", True), ("logits used twice", True),
    ("reduction none", False), ("label smoothing", False), ("class dimension second", False),
])
def test_what_it_fuses_and_what_runs_as_written(kind, fuses):
    torch.manual_seed(0)
    written = _Head(kind)
    x, target = torch.randn(3, 5, 8), torch.randint(0, 32, (3, 5))
    target[0, :2] = -100 if kind == "ignore_index, sum" else target[0, :2]
    fused = apply_choices(copy.deepcopy(written), {}, OutsideUnits(fused_loss=True))
    expected, got = written(x, target), fused(x, target)
    assert bool(fused_losses(fused)) == fuses
    torch.testing.assert_close(got, expected)
    expected.backward()
    got.backward()
    for (name, p), q in zip(written.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_without_gradients_the_loss_runs_as_written_and_a_second_derivative_is_refused():
    written, inputs = _llama()
    fused = apply_choices(copy.deepcopy(written), {}, OutsideUnits(fused_loss=True))
    with torch.no_grad():
        torch.testing.assert_close(fused(*inputs), written(*inputs))
    assert fused_losses(fused) == ()
    loss = fused(*inputs)
    (grad,) = torch.autograd.grad(loss, fused.output.weight, create_graph=True)
    with pytest.raises(RuntimeError):  # the saved gradients are constants: an error, never a wrong second derivative
        grad.sum().backward()
    assert remove_plan(fused).__dict__.get("forward") is None


@pytest.mark.slow  # the whole pipeline
def test_the_plan_fuses_the_head_only_where_that_is_the_fastest_plan_that_fits():
    """Fusing costs time (the head's gradients in fp32, chunk by chunk); it is chosen like any choice: where a
    budget is loose the loss stays as written, where only the fused head fits it is fused, and the measured
    step is what the plan predicts."""
    model, inputs = _llama()
    options = dict(example_inputs=inputs, device="cpu", precision="fp32", reserve=0)
    loose = autoplan.plan(model, "100MB", **options)
    written_only = autoplan.plan(model, "100MB", **options, fuse_loss=False)
    assert not loose.decisions.fused_loss and loose.prediction.step_time_s == written_only.prediction.step_time_s
    tight_bytes = written_only.prediction.minimum_peak_bytes - 1  # below anything the loss as written reaches
    fused = autoplan.plan(model, tight_bytes, **options)
    written = autoplan.plan(model, tight_bytes, **options, fuse_loss=False)
    assert fused.outcome.feasible and not written.outcome.feasible
    assert fused.decisions.fused_loss and fused.decisions.fused_logits == "256×2048 logits"
    assert not written.decisions.fused_loss and written.decisions.fused_logits == ""
    assert fused.prediction.baseline_peak_bytes == written.prediction.baseline_peak_bytes  # no plan: the loss as written
    assert fused.prediction.minimum_peak_bytes <= written.prediction.minimum_peak_bytes - LOGITS_BYTES
    # the fastest plan ignoring memory is the fastest of both ways, never slower than a plan shown
    assert fused.prediction.fastest_step_time_s == loose.prediction.fastest_step_time_s <= min(fused.prediction.step_time_s, loose.prediction.step_time_s)
    assert fused.prediction.step_time_s > loose.prediction.step_time_s
    assert "fused" in fused.report() and fused.to_dict()["fused_loss"] is True
    assert fused.to_dict()["fused_loss_logits"] == "256×2048 logits"
    applied = autoplan.apply(copy.deepcopy(model), fused)
    check = autoplan.verify(applied, fused, example_inputs=inputs)
    assert check.measured_peak_bytes == fused.prediction.peak_bytes
    assert autoplan.plan(model, tight_bytes, **options, compile=True).decisions.fused_loss is False


@pytest.mark.slow  # the whole pipeline
def test_fused_only_where_it_is_the_faster_plan_that_fits():
    """A caller that keeps the logits through backward keeps the head's input alive with them: that phase
    would hold more fused, so the loss stays as written; dropping the outputs first, the faster of fusing
    and checkpointing is planned, and the step measures what it predicts."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (2, 32))
    batch = {"input_ids": ids, "labels": ids}
    options = dict(example_inputs=batch, device="cpu", precision="fp32", reserve=0)
    dropped_loop = autoplan.TrainingLoop(keep_outputs=False)
    kept_written = autoplan.plan(model, "100MB", **options, fuse_loss=False)
    dropped_written = autoplan.plan(model, "100MB", **options, loop=dropped_loop, fuse_loss=False)
    # budgets just below the loss as written with every block kept: something must give
    kept = autoplan.plan(model, kept_written.prediction.peak_bytes - 1, **options)
    dropped = autoplan.plan(model, dropped_written.prediction.peak_bytes - 1, **options, loop=dropped_loop)
    dropped_as_written = autoplan.plan(model, dropped_written.prediction.peak_bytes - 1, **options, loop=dropped_loop, fuse_loss=False)
    assert kept.decisions.fused_loss is False  # fused, the kept loop holds more: never the better plan
    assert dropped.outcome.feasible and dropped.prediction.step_time_s <= dropped_as_written.prediction.step_time_s
    assert dropped.decisions.fused_logits == ("64×256 logits" if dropped.decisions.fused_loss else "")
    check = autoplan.verify(autoplan.apply(copy.deepcopy(model), dropped), dropped, example_inputs=batch, loop=dropped_loop)
    assert check.measured_peak_bytes == dropped.prediction.peak_bytes


class _ResidualGRUs(torch.nn.Module):
    """No cross-entropy at all: a Linear reads each bidirectional GRU's output, which the Linear copies to a matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.rnns = torch.nn.ModuleList([torch.nn.GRU(24, 24, batch_first=True, bidirectional=True) for _ in range(3)])
        self.proj = torch.nn.ModuleList([torch.nn.Linear(48, 24) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for rnn, proj in zip(self.rnns, self.proj):
            x = x + proj(rnn(x)[0])
        return x.pow(2).mean()


def test_a_step_that_fuses_nothing_is_profiled_as_written():
    """Looking for a head to fuse, the loss-head mode holds the latest Linear's inputs until the next Linear runs; where
    nothing is fused, the plan runs without that mode, so the profile's timeline must be the step as written. It was the
    fusing step's, 11,776 B over each real step here (a GRU output the mode held), in every prediction of the model."""
    from autoplan.inputs.devices import get_device
    from autoplan.profile.profiler import profile
    from autoplan.profile.simulation import run_timeline
    from autoplan.trace.tracer import trace
    from tests.handmade import measured_step

    torch.manual_seed(0)
    model, x = _ResidualGRUs(), torch.randn(3, 20, 24)
    traced = trace(model, (x,))
    measured = profile(traced, get_device("cpu"), precisions=("fp32",))
    assert not measured.timeline.fused_loss
    base = {u.unit: u.base for u in measured.units}
    cpu = get_device("cpu")
    looking = run_timeline(traced, base, device=cpu, optimizer="adamw", fused_loss=True)
    written = run_timeline(traced, base, device=cpu, optimizer="adamw")
    assert looking.fusing_held_longer and not looking.fused_loss and looking.peak_bytes > written.peak_bytes
    assert [p.peak_bytes for p in measured.timeline.phases] == [p.peak_bytes for p in written.phases]
    plan = autoplan.plan(model, "1GB", example_inputs=(x,), device="cpu", precision="fp32", reserve=0, menu_size=0,
                         checkpoint={"*": "keep"})
    assert plan.prediction.peak_bytes == measured_step(autoplan.apply(copy.deepcopy(model), plan), (x,)).peak_bytes
