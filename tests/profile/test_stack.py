"""profile/stack.py: a stack of identical layers simulated a few layers deep gives the whole step, to the byte.

Each case simulates the whole step and the shortcut (shortened steps, solved for the whole depth) and compares
every phase: start, peak and gradient bytes and flops equal, times to float rounding, and the static bytes,
the bytes the loop carries and the host peak (`stack.agrees`). Families are the README's, made 7 layers deep.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from autoplan.inputs.devices import get_device
from autoplan.inputs.loop import TrainingLoop
from autoplan.plan import Choice
from autoplan.profile.simulation import run_timeline
from autoplan.profile.stack import agrees, shortened_step, shortened_timeline, stack_runs
from autoplan.profile.stack_records import Records, same_records
from autoplan.trace.tracer import trace
from tests.families import BY_NAME

DEPTH = 8  # runs of 6 to 8 layers (stack.MIN_INTERIOR is 4: a run is its first and last layer and at least 4 more); T5's first
# block differs from the others (its relative position bias)
_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers")


def _deep(name: str, depth: int = DEPTH):
    family = BY_NAME[name]
    config = {key: depth if key in _DEPTH_KEYS else value for key, value in family.config.items()}
    deep = dataclasses.replace(family, config=config)
    model = deep.build()
    return model, deep.inputs(model)


def _index(name: str) -> int | None:
    found = re.search(r"\.(\d+)$", name)
    return int(found.group(1)) if found else None


PATTERNS = {
    "keep": lambda index: Choice("keep", "fp32"),
    "full": lambda index: Choice("full", "fp32"),
    "first layer recomputed": lambda index: Choice("full" if index == 0 else "keep", "fp32"),
    "offloaded": lambda index: Choice("full", "fp32", placement="host"),
    "bf16, last offloaded": lambda index: Choice("full", "bf16", placement="host") if index == DEPTH - 1 else
    Choice("keep", "bf16"),
}


def _compare(model, batch, pattern, device="cpu", loop=None):
    traced = trace(model, batch)
    choices = {unit: PATTERNS[pattern](_index(unit.name)) for unit in traced.units}
    target = get_device(device)

    def simulated(dropped=frozenset()):
        return run_timeline(traced, choices, device=target, optimizer="adamw", loop=loop, dropped=dropped)

    runs = stack_runs(traced.model, traced.units, {unit.name: choice for unit, choice in choices.items()})
    return runs, shortened_timeline(runs, simulated, records=True), simulated()


def _same(shortcut, whole) -> bool:
    """Every phase (`agrees`) and every unit call and boundary, the storage keys numbered alike."""
    return agrees(shortcut, whole) and same_records(Records(shortcut.unit_calls, shortcut.boundaries), whole)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_a_llama_stack_simulated_a_few_layers_deep_is_its_whole_step(pattern: str) -> None:
    model, batch = _deep("Llama")
    runs, shortcut, whole = _compare(model, batch, pattern)
    assert runs and shortcut is not None
    assert _same(shortcut, whole)
    assert len(shortcut.unit_calls) == len(whole.unit_calls) == DEPTH
    assert len(shortcut.phases) == len(whole.phases) and shortcut.peak_bytes == whole.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("family", ["GPT-2", "Mistral", "Qwen2", "Gemma", "Phi", "BERT", "ViT", "T5", "Whisper"])
@pytest.mark.parametrize("pattern", ["keep", "first layer recomputed", "offloaded", "bf16, last offloaded"])
def test_every_family_s_stack_is_its_whole_step(family: str, pattern: str) -> None:
    model, batch = _deep(family)
    runs, shortcut, whole = _compare(model, batch, pattern)
    assert runs and shortcut is not None, runs
    assert _same(shortcut, whole)


@pytest.mark.slow
@pytest.mark.parametrize("loop", [TrainingLoop(accumulation_steps=2), TrainingLoop(keep_outputs=False),
                                  TrainingLoop(zero_grad_set_to_none=False)], ids=["accumulation", "outputs dropped", "grads zeroed"])
def test_a_stack_in_other_loops_and_on_a_gpu_is_its_whole_step(loop: TrainingLoop) -> None:
    model, batch = _deep("Llama")
    for device in ("cpu", "h100"):
        runs, shortcut, whole = _compare(model, batch, "first layer recomputed", device, loop)
        assert shortcut is not None and _same(shortcut, whole), device


def test_two_runs_of_one_stack_are_each_shortened() -> None:
    """Layers 0-5 recomputed and 6-11 kept: two runs, each solved for its own length."""
    model, batch = _deep("Llama", depth=12)
    traced = trace(model, batch)
    choices = {unit: Choice("full" if (_index(unit.name) or 0) < 6 else "keep", "fp32") for unit in traced.units}
    runs = stack_runs(traced.model, traced.units, {unit.name: choice for unit, choice in choices.items()})
    assert [len(run.names) for run in runs] == [6, 6]
    target = get_device("cpu")

    def simulated(dropped=frozenset()):
        return run_timeline(traced, choices, device=target, optimizer="adamw", dropped=dropped)

    shortcut = shortened_timeline(runs, simulated, records=True)
    assert shortcut is not None and _same(shortcut, simulated())


def test_layers_that_differ_or_alternate_make_no_run() -> None:
    model, batch = _deep("Llama", depth=12)
    traced = trace(model, batch)
    alternate = {unit.name: Choice("full" if (_index(unit.name) or 0) % 2 else "keep", "fp32") for unit in traced.units}
    assert stack_runs(traced.model, traced.units, alternate) == ()
    same = {unit.name: Choice("keep", "fp32") for unit in traced.units}
    assert [len(run.names) for run in stack_runs(traced.model, traced.units, same)] == [12]
    assert [len(run.names) for run in stack_runs(traced.model, traced.units, {})] == [12]  # no plan: every layer as written
    # layers 3-8 left out of the choices (a segment's members, planned as one region): no run through or of them
    segmented = {name: choice for name, choice in same.items() if not 3 <= (_index(name) or 0) <= 8}
    assert stack_runs(traced.model, traced.units, segmented) == ()
    model.model.layers[3].mlp.down_proj = torch.nn.Linear(128, 32, bias=True)  # one layer not like the others
    assert [run.names for run in stack_runs(model, traced.units, same)] == [tuple(f"model.layers.{k}" for k in range(4, 12))]


def test_a_shortcut_that_is_not_affine_is_refused() -> None:
    """The check step (three interior layers) must land where the other two put it; here a fake simulation adds a
    byte that grows with the square of the run's length, and the shortcut says None (the whole step is simulated)."""
    model, batch = _deep("Llama")
    traced = trace(model, batch)
    choices = {unit: Choice("keep", "fp32") for unit in traced.units}
    runs = stack_runs(traced.model, traced.units, {unit.name: choice for unit, choice in choices.items()})
    target = get_device("cpu")

    def bent(dropped=frozenset()):
        timeline = run_timeline(traced, choices, device=target, optimizer="adamw", dropped=dropped)
        interior = len(runs[0].interior) - len([name for name in dropped if name in runs[0].interior])
        last = dataclasses.replace(timeline.phases[-1], peak_bytes=timeline.phases[-1].peak_bytes + interior ** 2)
        return dataclasses.replace(timeline, phases=(*timeline.phases[:-1], last))

    assert shortened_timeline(runs, bent) is None


def test_a_short_stack_is_simulated_whole() -> None:
    """Eight layers: the shortened steps would simulate more layers than the step has; no shortcut."""
    model, batch = _deep("Llama")
    traced = trace(model, batch)
    choices = {unit: Choice("keep", "fp32") for unit in traced.units}
    calls = []
    assert shortened_step(traced, choices, lambda dropped: calls.append(dropped)) is None and calls == []


def test_a_stack_whose_optimizer_steps_two_dtypes_is_simulated_whole() -> None:
    """foreach AdamW steps each dtype's parameters as one group: fp32 norms beside bf16 linears are two, and the
    larger can change with depth, where no shortened step would show it. 24 layers: long enough to be shortened."""
    model, batch = _deep("Llama", depth=24)
    traced = trace(model, batch)
    choices = {unit: Choice("keep", "fp32") for unit in traced.units}
    calls = []

    def simulate(dropped):
        calls.append(dropped)
        raise RuntimeError("counted, not run")  # the shortcut's failure: simulated whole

    assert shortened_step(traced, choices, simulate) is None and len(calls) == 1  # one dtype: shortened
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(torch.bfloat16)
    calls.clear()
    assert shortened_step(traced, choices, simulate) is None and calls == []  # two: not tried
