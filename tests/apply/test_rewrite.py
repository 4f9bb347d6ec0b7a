"""Tests for the apply stage and its runtime wrappers (`autoplan/planned/forwards.py`, `planned/wrappers.py`, `autoplan.apply`).

The rewrite's promise (README, "What is guaranteed"; docs/api.md, "What the rewrite preserves"): the
rewritten model is the caller's model (same class, parameter objects, state_dict keys); with every unit fp32, training it gives the same loss, gradients, parameters and
buffers as the original, step for step (dropout draws the same masks on recompute, BatchNorm's
running statistics are updated once); it works under torch.compile, eval() and no_grad() (no
recompute at inference). Checkpointing must actually recompute and actually save memory.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import re
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

# Let `tests.models` resolve even when pytest is started without the repo root on sys.path.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import autoplan  # noqa: E402
import autoplan.planned.wrappers as wrappers  # noqa: E402
from autoplan.plan import Choice, OutsideUnits  # noqa: E402
from autoplan.planned.wrappers import PlannedForward
from autoplan.planned.forwards import PlannedSequential, apply_choices, planned_units, remove_plan
from autoplan.trace.discovery import find_units
from autoplan.units import ModuleUnit, SequentialRun, Unit
from tests.models import ALL_MODELS, make_mlp, make_small_resnet, make_tiny_gpt, make_tiny_gpt_dropout  # noqa: E402

NAMES = sorted(ALL_MODELS)
MODES = ("keep", "selective", "full")
TIGHT = dict(atol=1e-6, rtol=1e-5)


# -- helpers ------------------------------------------------------------------------------------


def loss_of(out) -> torch.Tensor:
    """The model's own loss, else a scalar of the logits / output.

    A squared mean rather than a plain sum: its gradient depends on the output values, so a wrong
    recomputation shows up in every gradient (a sum's gradient w.r.t. the output is all ones).
    """
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    tensor = out.logits if hasattr(out, "logits") else out
    return tensor.float().pow(2).mean()


def output_tensor(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def all_units(model: torch.nn.Module, choice: Choice) -> dict[str, Choice]:
    return {unit: choice for unit in find_units(model)}


def rewritten(name: str, choice: Choice):
    model, inputs = ALL_MODELS[name]()
    apply_choices(model, all_units(model, choice))
    return model, inputs


def train_step(model, inputs, optimizer, seed: int = 123):
    optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_of(model(*inputs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    return loss.detach(), grads


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module, **tolerance) -> None:
    params_a, params_b = dict(a.named_parameters()), dict(b.named_parameters())
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        torch.testing.assert_close(params_b[name], params_a[name], msg=f"parameter {name}", **tolerance)
    buffers_a, buffers_b = dict(a.named_buffers()), dict(b.named_buffers())
    assert buffers_a.keys() == buffers_b.keys()
    for name in buffers_a:
        # exact: running stats updated twice (or not at all) would differ a lot, num_batches_tracked by 1
        torch.testing.assert_close(buffers_b[name], buffers_a[name], msg=f"buffer {name}", **tolerance)


def forward_flops(model, inputs) -> int:
    with FlopCounterMode(display=False) as counter:
        model(*inputs)
    return counter.get_total_flops()


def step_flops(model, inputs) -> int:
    with FlopCounterMode(display=False) as counter:
        torch.manual_seed(123)
        loss_of(model(*inputs)).backward()
    return counter.get_total_flops()


class _LiveStorages(TorchDispatchMode):
    """Remembers (weakly) every storage an op creates, to count what is still alive later."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if id(storage) not in self.storages:
                    self.storages[id(storage)] = (weakref.ref(storage), storage.nbytes())
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum(nbytes for ref, nbytes in self.storages.values() if ref() is not None)


def bytes_alive_after_forward(model, inputs) -> int:
    """Bytes of the tensors the forward created that are still alive before backward."""
    tracker = _LiveStorages()
    with tracker:
        loss = loss_of(model(*inputs))
    alive = tracker.live_bytes()
    loss.backward()  # the saved tensors were needed (and are freed by) backward
    return alive


# -- 1. training equivalence ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_training_matches_original_step_for_step(name, mode):
    original, inputs = ALL_MODELS[name]()
    planned = copy.deepcopy(original)
    choices = all_units(planned, Choice(mode, "fp32"))
    assert apply_choices(planned, choices) is planned
    assert planned_units(planned) == choices

    opt_a = torch.optim.AdamW([p for p in original.parameters() if p.requires_grad], lr=1e-2)
    opt_b = torch.optim.AdamW([p for p in planned.parameters() if p.requires_grad], lr=1e-2)
    initial_buffers = {n: b.clone() for n, b in original.named_buffers()}
    for step in range(2):
        loss_a, grads_a = train_step(original, inputs, opt_a)
        loss_b, grads_b = train_step(planned, inputs, opt_b)
        torch.testing.assert_close(loss_b, loss_a, msg=f"loss, step {step}", **TIGHT)
        assert grads_a, "no gradient at all: the test would be vacuous"
        assert grads_a.keys() == grads_b.keys()
        for param in grads_a:
            torch.testing.assert_close(grads_b[param], grads_a[param], msg=f"grad {param}, step {step}", **TIGHT)
        assert_same_state(original, planned, **TIGHT)
    # The buffers did move (BatchNorm models), so comparing them above was not vacuous.
    for buffer_name, before in initial_buffers.items():
        assert not torch.equal(dict(original.named_buffers())[buffer_name], before), buffer_name


@pytest.mark.parametrize("mode", ("selective", "full"))
@pytest.mark.parametrize("name", ["small_resnet", "skipnet"])
def test_batchnorm_counts_each_batch_once(name, mode):
    model, inputs = rewritten(name, Choice(mode, "fp32"))
    for _ in range(3):
        loss_of(model(*inputs)).backward()
    counters = [b for n, b in model.named_buffers() if n.endswith("num_batches_tracked")]
    assert counters
    assert all(int(c) == 3 for c in counters), [int(c) for c in counters]


def test_dropout_masks_replayed_on_recompute():
    # Different seeds give different losses (dropout is live), the same seed gives the same
    # gradients with and without checkpointing.
    original, inputs = make_tiny_gpt_dropout()
    planned = copy.deepcopy(original)
    apply_choices(planned, all_units(planned, Choice("full", "fp32")))
    torch.manual_seed(1)
    out_1 = output_tensor(original(*inputs))
    torch.manual_seed(2)
    out_2 = output_tensor(original(*inputs))
    assert not torch.equal(out_1, out_2)
    for model in (original, planned):
        torch.manual_seed(7)
        loss_of(model(*inputs)).backward()
    for (name, a), b in zip(original.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name, **TIGHT)


# -- 2. the rewritten model is the caller's model -------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_rewrite_keeps_identity_and_state_dict(name):
    model, inputs = ALL_MODELS[name]()
    cls = type(model)
    param_ids = {id(p) for p in model.parameters()}
    buffer_ids = {id(b) for b in model.buffers()}
    keys = list(model.state_dict().keys())
    module_ids = [id(m) for m in model.modules()]
    choices = {unit: Choice(MODES[i % 3], "fp32") for i, unit in enumerate(find_units(model))}

    assert apply_choices(model, choices) is model
    assert type(model) is cls
    assert {id(p) for p in model.parameters()} == param_ids
    assert {id(b) for b in model.buffers()} == buffer_ids
    assert list(model.state_dict().keys()) == keys
    assert [id(m) for m in model.modules()] == module_ids  # no wrapper modules registered
    assert callable(model.forward)
    assert planned_units(model) == choices
    model.load_state_dict(copy.deepcopy(model.state_dict()))  # round-trips
    model(*inputs)

    assert remove_plan(model) is model
    assert planned_units(model) == {}
    for module_name, module in model.named_modules():
        assert "forward" not in module.__dict__, module_name
    assert [id(m) for m in model.modules()] == module_ids


def test_unit_forward_is_planned_forward_on_the_instance():
    model, _ = make_tiny_gpt()
    apply_choices(model, {ModuleUnit("transformer.h.0"): Choice("full", "fp32")})
    block = model.get_submodule("transformer.h.0")
    forward = block.__dict__["forward"]
    assert isinstance(forward, PlannedForward)
    assert forward.module is block and forward.choice == Choice("full", "fp32")
    assert "forward" not in model.get_submodule("transformer.h.1").__dict__
    assert "forward" not in model.__dict__  # rest is fp32: the root is untouched
    # other methods of the model still work
    assert model.num_params() == sum(p.numel() for p in model.parameters())


def test_reapplying_replaces_rather_than_nests():
    model, inputs = make_tiny_gpt()
    apply_choices(model, all_units(model, Choice("full", "fp32")))
    second = all_units(model, Choice("selective", "fp32"))
    apply_choices(model, second)
    assert planned_units(model) == second
    for unit in second:
        forward = model.get_submodule(unit.name).forward
        assert isinstance(forward, PlannedForward) and forward.original is None
    # a plan naming fewer units removes the others
    apply_choices(model, {ModuleUnit("transformer.h.1"): Choice("keep", "fp32")})
    assert planned_units(model) == {ModuleUnit("transformer.h.1"): Choice("keep", "fp32")}
    assert "forward" not in model.get_submodule("transformer.h.0").__dict__


def test_existing_instance_forward_is_wrapped_and_restored():
    model, inputs = make_tiny_gpt()
    reference = loss_of(copy.deepcopy(model)(*inputs))
    block = model.get_submodule("transformer.h.0")
    calls = []

    def patched(x):  # e.g. another library's instance-level forward
        calls.append(1)
        return type(block).forward(block, x)

    block.forward = patched
    apply_choices(model, {ModuleUnit("transformer.h.0"): Choice("full", "fp32")})
    assert block.forward.original is patched
    loss = loss_of(model(*inputs))
    loss.backward()
    assert len(calls) == 2  # forward, then recomputation in backward
    torch.testing.assert_close(loss, reference, **TIGHT)
    remove_plan(model)
    assert block.__dict__["forward"] is patched


def test_range_units_round_trip_and_use_planned_sequential():
    model, inputs = make_mlp()
    units = find_units(model)
    assert all(isinstance(u, SequentialRun) and u.name.startswith("[") for u in units)
    choices = {unit: Choice(MODES[i % 3], "fp32") for i, unit in enumerate(units)}
    apply_choices(model, choices)
    assert planned_units(model) == choices
    forward = model.__dict__["forward"]
    assert isinstance(forward, PlannedSequential)
    assert [(start, stop) for start, stop, _ in forward.runs] == [
        (u.start, u.stop) for u in units
    ]
    for start, stop, run in forward.runs:
        assert [id(m) for m in run.module] == [id(m) for m in list(model)[start:stop]]
    remove_plan(model)
    assert "forward" not in model.__dict__


def test_range_units_partial_cover_keeps_other_layers():
    model, inputs = make_mlp()
    reference = model(*inputs)
    choices: dict[Unit, Choice] = {SequentialRun("", 2, 4): Choice("full", "fp32"), SequentialRun("", 6, 8): Choice("selective", "fp32")}
    apply_choices(model, choices)
    assert planned_units(model) == choices
    torch.testing.assert_close(model(*inputs), reference, **TIGHT)


def test_nested_range_unit_name_round_trips():
    model, inputs = make_small_resnet()
    reference_model = copy.deepcopy(model)
    choices: dict[Unit, Choice] = {SequentialRun("stem", 0, 2): Choice("full", "fp32"), SequentialRun("layer2", 1, 2): Choice("selective", "fp32")}
    apply_choices(model, choices)
    assert planned_units(model) == choices
    opt_a = torch.optim.AdamW(reference_model.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_a, grads_a = train_step(reference_model, inputs, opt_a)
    loss_b, grads_b = train_step(model, inputs, opt_b)
    torch.testing.assert_close(loss_b, loss_a, **TIGHT)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], msg=name, **TIGHT)
    assert_same_state(reference_model, model, **TIGHT)


# -- 3. checkpointing recomputes ------------------------------------------------------------------


def test_full_checkpoint_recomputes_one_forward_of_the_units():
    keep, inputs = rewritten("tiny_gpt", Choice("keep", "fp32"))
    full, _ = rewritten("tiny_gpt", Choice("full", "fp32"))
    selective, _ = rewritten("tiny_gpt", Choice("selective", "fp32"))
    model_forward = forward_flops(keep, inputs)
    units_forward = 0
    with FlopCounterMode(display=False) as counter:
        keep(*inputs)
    for unit in find_units(keep):
        units_forward += sum(counter.get_flop_counts().get(f"GPT.{unit}", {}).values())
    assert 0 < units_forward <= model_forward

    keep_step, full_step, selective_step = (step_flops(m, inputs) for m in (keep, full, selective))
    extra = full_step - keep_step
    assert extra > 0
    assert extra <= model_forward
    # One more forward of every unit, less what non-reentrant checkpoint's early stop skips (the
    # ops after the last tensor backward needs, here each block's final projection).
    assert units_forward // 2 <= extra <= units_forward
    # selective keeps matmul/attention outputs: it recomputes (strictly) fewer FLOPs than full
    assert keep_step <= selective_step < full_step


# -- 4. checkpointing saves memory ----------------------------------------------------------------


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("name", ["tiny_gpt", "tiny_gpt_eager", "residual_mlp", "small_resnet", "mlp"])
def test_checkpointing_frees_activations_before_backward(name):
    alive = {mode: bytes_alive_after_forward(rewritten(name, Choice(mode, "fp32"))[0], ALL_MODELS[name]()[1]) for mode in MODES}
    assert alive["keep"] > alive["full"] > 0, alive
    if name == "mlp":
        # Linear+GELU runs: selective keeps the Linear output, which is all GELU saves anyway,
        # and GELU's output is the next run's (kept) input, so nothing is left to drop.
        assert alive["keep"] >= alive["selective"] > alive["full"], alive
    else:
        assert alive["keep"] > alive["selective"] > alive["full"], alive


# -- 5. eval and no_grad --------------------------------------------------------------------------


def test_no_grad_runs_without_checkpoint_or_recompute(monkeypatch):
    original, inputs = make_tiny_gpt()
    planned = copy.deepcopy(original)
    apply_choices(planned, all_units(planned, Choice("full", "fp32")))
    calls = []
    real_checkpoint = wrappers.checkpoint

    def spy(*args, **kwargs):
        calls.append(1)
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(wrappers, "checkpoint", spy)
    with torch.no_grad():
        expected = output_tensor(original(*inputs))
        with FlopCounterMode(display=False) as counter:
            out = output_tensor(planned(*inputs))
        original_flops = forward_flops(original, inputs)
    assert calls == []
    assert not out.requires_grad
    assert counter.get_total_flops() == original_flops
    torch.testing.assert_close(out, expected, **TIGHT)
    planned(*inputs)  # with grad: the spy sees the units go through checkpoint
    assert len(calls) == len(find_units(planned))


@pytest.mark.parametrize("mode", ("selective", "full"))
def test_eval_outputs_match_original_eval(mode):
    original, inputs = make_tiny_gpt_dropout()
    planned = copy.deepcopy(original)
    apply_choices(planned, all_units(planned, Choice(mode, "fp32")))
    original.eval()
    planned.eval()
    torch.manual_seed(5)
    expected = output_tensor(original(*inputs))
    torch.manual_seed(6)  # dropout is off in eval: the seed must not matter
    out = output_tensor(planned(*inputs))
    torch.testing.assert_close(out, expected, **TIGHT)
    with torch.no_grad():
        torch.testing.assert_close(output_tensor(planned(*inputs)), expected, **TIGHT)
    # back to training: dropout is live again and still matches under the same seed
    original.train()
    planned.train()
    torch.manual_seed(9)
    a = output_tensor(original(*inputs))
    torch.manual_seed(9)
    b = output_tensor(planned(*inputs))
    torch.testing.assert_close(b, a, **TIGHT)
    assert not torch.equal(a, expected)


# -- 6. torch.compile -----------------------------------------------------------------------------


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("mode", ("full", "selective"))
@pytest.mark.parametrize("name", ["tiny_gpt", "flat"])  # flat: graph units, a PlannedGraph forward
def test_torch_compile_matches_eager_original(name, mode):
    torch._dynamo.reset()
    original, inputs = ALL_MODELS[name]()
    original.eval()  # same dropout masks are not replayable across eager and compiled code
    planned = copy.deepcopy(original)
    apply_choices(planned, all_units(planned, Choice(mode, "fp32")))
    compiled = torch.compile(planned, backend="aot_eager", fullgraph=True)
    try:
        loss_a = loss_of(original(*inputs))
        loss_a.backward()
        loss_b = loss_of(compiled(*inputs))
        loss_b.backward()
    finally:
        torch._dynamo.reset()
    tolerance = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss_b, loss_a, **tolerance)
    for (name, a), b in zip(original.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name, **tolerance)


# -- 7. deepcopy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny_gpt", "mlp", "small_resnet"])
def test_deepcopy_of_rewritten_model_is_independent(name):
    model, inputs = ALL_MODELS[name]()
    choices = {unit: Choice(MODES[1 + i % 2], "fp32") for i, unit in enumerate(find_units(model))}
    apply_choices(model, choices)
    snapshot = {n: t.detach().clone() for n, t in model.state_dict().items()}
    twin = copy.deepcopy(model)

    assert planned_units(twin) == planned_units(model) == choices
    for module_name, module in twin.named_modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, PlannedForward):
            assert forward.module is module, module_name
        elif isinstance(forward, PlannedSequential):
            assert forward.module is module, module_name
            for start, stop, run in forward.runs:
                assert [id(m) for m in run.module] == [id(m) for m in list(module)[start:stop]]
    for unit in choices:
        if not unit.name.startswith("["):
            assert twin.get_submodule(unit.name).forward.module is twin.get_submodule(unit.name)
            assert twin.get_submodule(unit.name).forward.module is not model.get_submodule(unit.name)

    # training the copy changes only the copy
    reference = copy.deepcopy(twin)
    remove_plan(reference)
    optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train_step(twin, inputs, optimizer)
    train_step(reference, inputs, ref_optimizer)
    for key, value in model.state_dict().items():
        assert torch.equal(value, snapshot[key]), key
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(twin.state_dict()[k], snapshot[k]) for k in snapshot)
    assert_same_state(reference, twin, **TIGHT)


@pytest.mark.parametrize("name", ["tiny_gpt", "mlp"])
def test_pickled_rewritten_model_keeps_its_plan(name):
    model, inputs = ALL_MODELS[name]()
    apply_choices(model, {unit: Choice(MODES[i % 3], "fp32") for i, unit in enumerate(find_units(model))})
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert planned_units(loaded) == planned_units(model)
    for module in loaded.modules():
        forward = module.__dict__.get("forward")
        if forward is not None:
            assert forward.module is module
    torch.testing.assert_close(output_tensor(loaded(*inputs)), output_tensor(model(*inputs)), **TIGHT)


# -- 8. bf16 units --------------------------------------------------------------------------------


def record_output_dtypes(model, names, dtypes):
    def hook(module, args, output, name):
        dtypes.setdefault(name, output.dtype)  # returns None: the output is left as it is

    return [model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: hook(m, a, o, n)) for n in names]


def _gpt_with_targets():
    model, (idx,) = make_tiny_gpt()
    targets = torch.roll(idx, -1, dims=1)
    return model, (idx, targets)


@pytest.mark.parametrize("mode", MODES)
def test_bf16_units_cast_back_and_keep_fp32_master_weights(mode):
    model, inputs = _gpt_with_targets()
    fp32_loss = model(*inputs).loss.detach()
    fp32_grads = torch.autograd.grad(model(*inputs).loss, list(model.parameters()))
    apply_choices(model, all_units(model, Choice(mode, "bf16")))
    assert planned_units(model) == all_units(model, Choice(mode, "bf16"))

    dtypes: dict[str, torch.dtype] = {}
    hooks = record_output_dtypes(model, ["transformer.h.0", "transformer.h.1", "transformer.h.0.mlp.c_fc", "lm_head"], dtypes)
    out = model(*inputs)
    for hook in hooks:
        hook.remove()
    assert dtypes["transformer.h.0.mlp.c_fc"] == torch.bfloat16  # autocast is on inside the unit
    assert dtypes["transformer.h.0"] == dtypes["transformer.h.1"] == torch.float32  # cast back
    assert dtypes["lm_head"] == torch.float32  # outside the units stays fp32
    assert out.logits.dtype == torch.float32
    assert torch.isfinite(out.loss)
    torch.testing.assert_close(out.loss.detach(), fp32_loss, rtol=5e-2, atol=0)
    out.loss.backward()
    for (name, p), g32 in zip(model.named_parameters(), fp32_grads):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name
        cosine = torch.nn.functional.cosine_similarity(p.grad.flatten(), g32.flatten(), dim=0)
        assert cosine > 0.95, (name, float(cosine))


@pytest.mark.parametrize("mode", MODES)
def test_bf16_range_units_return_input_dtype(mode):
    # A Linear+GELU run ends in a bf16 tensor under autocast (no fp32 residual add to promote it),
    # so only the cast back makes the run's output float32.
    model, inputs = make_mlp()
    reference = model(*inputs).detach()
    apply_choices(model, all_units(model, Choice(mode, "bf16")))
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    def spy(layer, args, output):
        seen.append((args[0].dtype, output.dtype))

    hooks = [layer.register_forward_hook(spy) for layer in model if isinstance(layer, torch.nn.Linear)]
    out = model(*inputs)
    for hook in hooks:
        hook.remove()
    assert [o for _, o in seen] == [torch.bfloat16] * 6  # every Linear ran in bf16
    assert [i for i, _ in seen] == [torch.float32] * 6  # ...and received the previous run's fp32 output
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.detach(), reference, rtol=5e-2, atol=5e-2)
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("mode", ("selective", "full"))
def test_bf16_recompute_matches_bf16_keep(mode):
    keep, inputs = _gpt_with_targets()
    planned = copy.deepcopy(keep)
    apply_choices(keep, all_units(keep, Choice("keep", "bf16")))
    apply_choices(planned, all_units(planned, Choice(mode, "bf16")))
    loss_a, loss_b = keep(*inputs).loss, planned(*inputs).loss
    loss_a.backward()
    loss_b.backward()
    torch.testing.assert_close(loss_b, loss_a, **TIGHT)
    for (name, a), b in zip(keep.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name, **TIGHT)


def test_low_rest_precision_autocasts_the_root_and_fp32_units_opt_out():
    model, inputs = _gpt_with_targets()
    choices = all_units(model, Choice("keep", "fp32"))
    apply_choices(model, choices, OutsideUnits("bf16"))
    assert isinstance(model.__dict__["forward"], PlannedForward)
    assert planned_units(model) == choices  # the root's autocast is not a unit
    dtypes: dict[str, torch.dtype] = {}
    hooks = record_output_dtypes(model, ["transformer.h.0.mlp.c_fc", "lm_head"], dtypes)
    out = model(*inputs)
    for hook in hooks:
        hook.remove()
    assert dtypes["lm_head"] == torch.bfloat16
    assert dtypes["transformer.h.0.mlp.c_fc"] == torch.float32
    assert torch.isfinite(out.loss)
    remove_plan(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


# -- 10. autoplan.apply ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_plan():
    model, inputs = make_tiny_gpt()
    return autoplan.plan(model, "1GB", example_inputs=inputs, device="h100-80gb", reserve=0)


@pytest.fixture(scope="module")
def mlp_plan():
    model, inputs = make_mlp()
    return autoplan.plan(model, "1GB", example_inputs=inputs, device="h100-80gb", reserve=0)


@pytest.mark.slow  # the whole pipeline
def test_apply_rewrites_in_place_as_planned(gpt_plan):
    model, inputs = make_tiny_gpt()
    assert autoplan.apply(model, gpt_plan) is model
    assert planned_units(model) == gpt_plan.decisions.choices_by_unit()
    assert torch.isfinite(loss_of(model(*inputs)))


def test_apply_rejects_plan_for_another_model(gpt_plan):
    other, _ = ALL_MODELS["residual_mlp"]()
    with pytest.raises(ValueError, match="transformer.h.0"):
        autoplan.apply(other, gpt_plan)
    assert all("forward" not in m.__dict__ for m in other.modules())


@pytest.mark.slow  # the whole pipeline
def test_apply_rejects_range_plan_for_non_sequential_model(mlp_plan):
    other, _ = ALL_MODELS["residual_mlp"]()
    with pytest.raises(ValueError, match=r"\[0:2\]"):
        autoplan.apply(other, mlp_plan)


def test_apply_rejects_range_plan_for_shorter_sequential(mlp_plan):
    short = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    with pytest.raises(ValueError, match="does not have"):
        autoplan.apply(short, mlp_plan)


@pytest.mark.parametrize("not_a_plan", [None, {"transformer.h.0": Choice("full", "fp32")}, "plan.json"])
def test_apply_requires_a_plan(not_a_plan):
    model, _ = make_tiny_gpt()
    with pytest.raises(TypeError, match="Plan"):
        autoplan.apply(model, not_a_plan)


def _plan_naming(plan, unit: str):
    decision = autoplan.UnitDecision(Unit.from_name(unit), Choice("full", "fp32"), saved_bytes=0, recompute_flops=0, step_time_s=0.0)
    return dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, units=(decision,)))


@pytest.mark.parametrize("unit", ["transformer.h.7", "transformer.h.0.mlp.nope", "lm_head[0:1]", "transformer.h[1:3]"])
def test_apply_rejects_units_the_model_lacks(gpt_plan, unit):
    model, _ = make_tiny_gpt()
    with pytest.raises(ValueError, match=re.escape(repr(unit))):
        autoplan.apply(model, _plan_naming(gpt_plan, unit))
    assert planned_units(model) == {}


def test_apply_rejects_range_unit_on_module_dict(gpt_plan):
    model, _ = make_tiny_gpt()
    with pytest.raises(ValueError, match=re.escape("'transformer[0:1]'")):
        autoplan.apply(model, _plan_naming(gpt_plan, "transformer[0:1]"))
