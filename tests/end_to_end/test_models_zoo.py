"""Sanity tests for the test model zoo (`tests/models.py`) and `examples/gpt.py`.

These check the models themselves, not the planner: forward/backward work,
gradients land exactly on trainable parameters, fx tracing reproduces eager
outputs, construction is seeded, and GPT's tied weights are shared.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.fx

# Let `tests.models` resolve even when pytest is started without the repo root on sys.path.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.models import ALL_MODELS, make_tiny_gpt, make_tiny_gpt_eager  # noqa: E402

NAMES = sorted(ALL_MODELS)


def scalar_loss(out) -> torch.Tensor:
    """Reduce any zoo output to a scalar the way a training step would."""
    if getattr(out, "loss", None) is not None:
        return out.loss
    if hasattr(out, "logits"):
        return out.logits.sum()
    return out.float().sum()


def output_tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in (out.logits, out.loss) if t is not None]


def assert_same_outputs(a, b) -> None:
    ta, tb = output_tensors(a), output_tensors(b)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward(name):
    model, inputs = ALL_MODELS[name]()
    model.train()
    loss = scalar_loss(model(*inputs))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable, "every zoo model should have something to train"
    for n, p in trainable:
        assert p.grad is not None, f"{n} got no grad"
        assert torch.isfinite(p.grad).all(), f"{n} has non-finite grad"
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"frozen {n} got a grad"


@pytest.mark.parametrize("name", NAMES)
def test_symbolic_trace_matches_eager(name):
    model, inputs = ALL_MODELS[name]()
    model.eval()
    gm = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        assert_same_outputs(model(*inputs), gm(*inputs))


@pytest.mark.parametrize("name", NAMES)
def test_traced_training_step_matches_eager(name):
    # The planner rewrites traced graphs of models in train mode, so the traced
    # module must reproduce outputs and grads there too (dropout included).
    model, inputs = ALL_MODELS[name]()
    model.train()
    gm = torch.fx.symbolic_trace(model)

    results = []
    for fn in (model, gm):
        model.zero_grad(set_to_none=True)  # gm shares model's parameters
        torch.manual_seed(123)
        out = fn(*inputs)
        scalar_loss(out).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out, grads))

    (out_m, grads_m), (out_g, grads_g) = results
    assert_same_outputs(out_m, out_g)
    assert grads_m.keys() == grads_g.keys()
    for n in grads_m:
        torch.testing.assert_close(grads_m[n], grads_g[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("name", NAMES)
def test_seeded_construction_is_deterministic(name):
    (m1, in1), (m2, in2) = ALL_MODELS[name](), ALL_MODELS[name]()
    for x, y in zip(in1, in2):
        assert torch.equal(x, y)
    sd1, sd2 = m1.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k

    outs = []
    for m, inputs in ((m1, in1), (m2, in2)):
        m.train()
        torch.manual_seed(7)
        outs.append(m(*inputs))
    assert_same_outputs(*outs)


@pytest.mark.parametrize("make", [make_tiny_gpt, make_tiny_gpt_eager])
def test_gpt_tied_weights_counted_once(make):
    model, _ = make()
    wte = model.transformer.wte.weight
    assert model.lm_head.weight is wte
    ids = {id(p) for p in model.parameters()}
    assert id(wte) in ids
    assert len(ids) == len(list(model.parameters()))
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    # Naive per-module counting would see the embedding twice.
    per_module = sum(p.numel() for m in model.modules() for p in m.parameters(recurse=False))
    assert per_module == model.num_params() + wte.numel()


@pytest.mark.parametrize("make", [make_tiny_gpt, make_tiny_gpt_eager])
def test_gpt_loss_with_targets_eager_and_traced(make):
    model, (idx,) = make()
    model.eval()
    targets = torch.roll(idx, -1, dims=1)
    gm = torch.fx.symbolic_trace(model)
    out, traced = model(idx, targets), gm(idx, targets)
    assert out.loss is not None and out.loss.dim() == 0
    torch.testing.assert_close(out.loss, traced.loss, rtol=0, atol=0)
    # Same traced module, no targets: the loss branch must stay optional.
    assert gm(idx).loss is None


def test_sdpa_and_eager_attention_agree():
    (m_sdpa, (idx,)), (m_eager, _) = make_tiny_gpt(), make_tiny_gpt_eager()
    m_eager.load_state_dict(m_sdpa.state_dict())
    m_sdpa.eval(), m_eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(m_sdpa(idx).logits, m_eager(idx).logits, rtol=1e-5, atol=1e-5)


def test_gpt_handles_shorter_sequences_after_tracing():
    model, (idx,) = make_tiny_gpt_eager()
    model.eval()
    gm = torch.fx.symbolic_trace(model)
    short = idx[:, :5]
    with torch.no_grad():
        torch.testing.assert_close(model(short).logits, gm(short).logits, rtol=0, atol=0)
