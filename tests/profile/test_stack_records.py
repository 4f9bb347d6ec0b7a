"""profile/stack_records.py: a whole step's unit calls and boundaries made from a shortened step's, and the profile
whose timeline is made so equals the one simulated whole.

The families' shortened steps are compared with their whole steps, records included, in test_stack.py; here the
chain itself on hand-made calls (what each copy takes and hands on, which phases move), what is refused, and the
profile built on it.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from unittest import mock

import pytest

import autoplan
import autoplan.profile.simulation as simulation
from autoplan.inputs.devices import get_device
from autoplan.plan import Phase
from autoplan.profile.profiler import profile
from autoplan.profile.recorder import UnitCall, boundaries_of
from autoplan.profile.stack import agrees
from autoplan.profile.stack_records import NoPattern, Records, same_records, whole_records
from autoplan.trace.tracer import trace
from tests.profile.test_stack import _deep

ROPE, BATCH = 100, 101  # a table every layer reads; the batch, which the embedding reads


def _call(name: str, inputs: tuple[int, ...], outputs: tuple[int, ...]) -> UnitCall:
    return UnitCall(name, ((), {}), inputs, tuple(8 for _ in inputs), outputs, tuple(8 for _ in outputs))


def _template(second_inputs: tuple[int, ...] = (3, ROPE)) -> SimpleNamespace:
    """embed -> layers.0 (first) -> layers.1, layers.2 (the two interior layers) -> layers.9 (last), each layer reading ROPE."""
    calls = (_call("embed", (BATCH,), (1,)), _call("layers.0", (1, ROPE), (2,)), _call("layers.1", (2, ROPE), (3,)),
             _call("layers.2", second_inputs, (4,)), _call("layers.9", (4, ROPE), (5,)))
    last_read = {2: Phase("fwd", "layers.1"), 3: Phase("fwd", "layers.2"), 4: Phase("fwd", "layers.9"), ROPE: Phase("fwd", "layers.9"),
                 1: Phase("fwd", "layers.0")}
    return SimpleNamespace(unit_calls=calls, boundaries=boundaries_of(calls, lambda key: key == BATCH, last_read.get, lambda key: None))


INTERIOR = tuple(f"layers.{k}" for k in range(1, 9))


def test_each_interior_copy_reads_the_one_before_it_and_the_shared_table() -> None:
    made = whole_records([INTERIOR], _template(), [5])
    calls = {call.name: call for call in made.unit_calls}
    assert [call.name for call in made.unit_calls] == ["embed", "layers.0", *INTERIOR[:5], "layers.9"]
    for before, after in zip(["layers.0", *INTERIOR[:5]], [*INTERIOR[:5], "layers.9"]):
        assert calls[after].input_keys[0] == calls[before].output_keys[0]  # the chain
        assert calls[after].input_keys[1] == ROPE  # shared, the same tensor everywhere
    assert len({call.output_keys[0] for call in made.unit_calls}) == len(made.unit_calls)  # each copy's output its own
    boundaries = {b.key: b for b in made.boundaries}
    rope = boundaries[ROPE]
    assert [name for name, _ in rope.consumers] == ["layers.0", *INTERIOR[:5], "layers.9"] and rope.last_forward_use == Phase("fwd", "layers.9")
    # copy j's output is last read by copy j+1, as layers.1's was by layers.2 in the template
    for j in range(4):
        assert boundaries[calls[INTERIOR[j]].output_keys[0]].last_forward_use == Phase("fwd", INTERIOR[j + 1])
    assert boundaries[calls[INTERIOR[4]].output_keys[0]].last_forward_use == Phase("fwd", "layers.9")
    assert boundaries[BATCH].held_by_rest and not rope.held_by_rest


def test_an_interior_layer_that_takes_what_the_other_does_not_is_no_pattern() -> None:
    with pytest.raises(NoPattern):
        whole_records([INTERIOR], _template(second_inputs=(3, 1)), [5])  # layers.2 reads the embedding, layers.1 the table


def test_records_that_differ_in_a_phase_or_a_key_are_not_the_same() -> None:
    template = _template()
    made = whole_records([INTERIOR], template, [2])
    whole = SimpleNamespace(unit_calls=template.unit_calls, boundaries=template.boundaries)
    assert same_records(made, whole)  # two interior layers made from two: the template itself, keys renumbered alike
    moved = tuple(b if b.key != ROPE else dataclasses.replace(b, last_forward_use=Phase("fwd", "layers.2")) for b in made.boundaries)
    assert not same_records(Records(made.unit_calls, moved), whole)
    crossed = (*made.unit_calls[:3], _call("layers.2", (2, ROPE), (4,)), made.unit_calls[4])  # reads layers.0's output
    assert not same_records(Records(crossed, made.boundaries), whole)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "h100"])
def test_a_profile_of_a_deep_stack_is_the_whole_step_s_and_plans_alike(device: str) -> None:
    """24 layers: the profile's timeline, reference and fused alternative come from shortened steps (never the
    whole step), and equal the whole step's in every phase, call and boundary; the units and plans too."""
    model, batch = _deep("Llama", depth=24)
    batch = {**batch, "use_cache": False}  # as autoplan.plan passes a transformers model's batch
    traced = trace(model, batch)
    target = get_device(device)
    dropped_sets = []
    real_run = simulation.run_timeline

    def counted(*args, **kwargs):
        dropped_sets.append(kwargs.get("dropped", frozenset()))
        return real_run(*args, **kwargs)

    with mock.patch.object(simulation, "run_timeline", counted):
        fast = profile(traced, target, precisions=("fp32", "bf16"))
    assert dropped_sets and all(dropped_sets), "every step of the profile shortened"
    with mock.patch.object(simulation, "shortened_step", lambda *args, **kwargs: None):
        whole = profile(traced, target, precisions=("fp32", "bf16"))
        planned_whole = autoplan.plan(model, "30MB", example_inputs=batch, device=device)
    for name in ("timeline", "reference", "alternative"):
        mine, theirs = getattr(fast, name), getattr(whole, name)
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert agrees(mine, theirs) and same_records(Records(mine.unit_calls, mine.boundaries), theirs), name
    assert fast.units == whole.units
    planned = autoplan.plan(model, "30MB", example_inputs=batch, device=device)
    assert planned.decisions == planned_whole.decisions
    assert planned.prediction.peak_bytes == planned_whole.prediction.peak_bytes
    assert planned.prediction.step_time_s == pytest.approx(planned_whole.prediction.step_time_s, rel=1e-12)
