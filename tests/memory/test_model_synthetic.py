"""The memory model (autoplan/memory/model.py) on synthetic profiles: no model, no trace, milliseconds.

The chain of tests/solve/test_ilp.py: units u0..u{n-1}, sizes in MiB, the timeline the step with
every unit kept (static 100, each unit keeps 10 with a forward transient of 1 and a backward one of
2; fully checkpointed it keeps 1 and its backward recomputes the 10). Each expectation is worked
out by hand from those numbers, phase by phase.
"""

from __future__ import annotations

import pytest

from autoplan.memory.model import (
    held_changes,
    live_bytes,
    phase_bytes,
    predict_peak,
    predict_step_time,
)
from tests.solve.test_ilp import FULL, KEEP, MIB, synthetic_chain


def _choices(*modes):
    return {f"u{i}": mode for i, mode in enumerate(modes)}


def test_live_bytes_phase_by_phase_with_the_middle_unit_checkpointed() -> None:
    profile = synthetic_chain(3)
    live = live_bytes(profile, _choices(KEEP, FULL, KEEP))
    # forward: static, then each unit's transient on what is held; u1 holds 1, not 10
    # backward: u2 (transient 2), u1 recomputes its 10 (backward transient 2 + 10), u0 (2)
    expected = [100, 101, 110, 111, 111, 112, 121, 121, 123, 111, 123, 110, 112, 100, 100, 100]
    assert [p.name for p in profile.timeline.phases][:3] == ["fwd:start", "fwd:u0", "fwd:after u0"]
    assert live == [mib * MIB for mib in expected]


def test_held_changes_are_what_a_choice_keeps_less_than_the_timeline() -> None:
    profile = synthetic_chain(4, keep_held=[10, 20, 30, 40], full_held=[1, 2, 3, 4])
    assert held_changes(profile, _choices(KEEP, KEEP, KEEP, KEEP)) == [0, 0, 0, 0]
    assert held_changes(profile, _choices(FULL, KEEP, FULL, KEEP)) == [-9 * MIB, 0, -27 * MIB, 0]


def test_peak_is_the_highest_phase_and_its_breakdown_adds_up() -> None:
    profile = synthetic_chain(5, keep_held=[10, 30, 10, 10, 10])
    choices = _choices(KEEP, FULL, KEEP, KEEP, FULL)
    peak, live = predict_peak(profile, choices), live_bytes(profile, choices)
    assert peak.bytes == max(live)
    assert peak.phase == profile.timeline.phases[live.index(max(live))].phase
    parts = peak.breakdown
    assert parts.parameters + parts.gradients + parts.optimizer + parts.activations + parts.transient == peak.bytes
    assert parts.parameters + parts.optimizer == 100 * MIB  # the chain's static bytes, split in halves


def test_phase_bytes_split_each_phase_into_static_and_the_rest() -> None:
    profile = synthetic_chain(3)
    choices = _choices(FULL, KEEP, FULL)
    split = phase_bytes(profile, choices)
    assert [p.live_bytes for p in split] == live_bytes(profile, choices)
    assert all(p.static_bytes == 100 * MIB for p in split)
    assert [p.phase for p in split] == [sample.phase for sample in profile.timeline.phases]
    assert split[0].activation_bytes == 0 and max(p.activation_bytes for p in split) == max(live_bytes(profile, choices)) - 100 * MIB


def test_step_time_adds_each_units_chosen_time() -> None:
    profile = synthetic_chain(4, keep_time=[1.0, 2.0, 3.0, 4.0], full_time=[1.5, 2.5, 3.5, 4.5])
    assert predict_step_time(profile, _choices(KEEP, KEEP, KEEP, KEEP)) == pytest.approx(10.0)
    assert predict_step_time(profile, _choices(FULL, KEEP, FULL, KEEP)) == pytest.approx(11.0)
