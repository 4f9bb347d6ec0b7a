"""Tests for autoplan.inputs.budget: parsing, reserves and formatting of memory budgets."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoplan.errors import BudgetError, BudgetOverDeviceError
from autoplan.inputs.budget import DEFAULT_FRAGMENTATION, Budget, budget_needed_for, default_reserve, make_budget, parse_bytes
from autoplan.vocabulary.formatting import format_bytes
from autoplan.inputs.devices import DEVICES, get_device

UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "PB": 10**15,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "PiB": 2**50,
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20GB", 20 * 10**9),
        ("20 GB", 20 * 10**9),
        ("20gb", 20 * 10**9),
        ("20 GiB", 20 * 2**30),
        ("20gib", 20 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5TB", 1_500_000_000_000),
        ("100KB", 100_000),
        ("4096B", 4096),
        ("4096b", 4096),
        ("2KiB", 2048),
        ("3 MiB", 3 * 2**20),
        ("1TiB", 2**40),
        ("1PB", 10**15),  # issue 39: --host-budget 1PB was "unknown unit 'PB'"
        ("2 PiB", 2 * 2**50),
        ("  20GB  ", 20 * 10**9),
        ("0.5 KiB", 512),
        ("1.0001KB", 1000),  # fractional bytes are floored
        (4096, 4096),
        (1, 1),
    ],
)
def test_accepted_forms(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_gb_and_gib_differ() -> None:
    assert parse_bytes("1GiB") - parse_bytes("1GB") == 2**30 - 10**9


def test_percentage_of_device_memory() -> None:
    assert parse_bytes("80%", device_memory_bytes=1000) == 800
    assert parse_bytes("100%", device_memory_bytes=1000) == 1000
    assert parse_bytes("33.3%", device_memory_bytes=1001) == math.floor(333 * 1001 / 1000)
    assert parse_bytes("50 %", device_memory_bytes=80 * 2**30) == 40 * 2**30


def test_percentage_without_device_is_rejected() -> None:
    with pytest.raises(ValueError, match="percentage needs a device") as info:
        parse_bytes("80%")
    assert "Accepted:" in str(info.value)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("20", "needs a unit"),
        ("0", "must be positive"),  # zero of anything is no budget, whatever the unit
        ("-1GB", "positive"),
        ("0GB", "positive"),
        ("0.0001B", "at least 1 byte"),
        ("abc", "must start with a number"),
        ("", "empty"),
        ("   ", "empty"),
        ("GB", "must start with a number"),
        ("nan GB", "must start with a number"),
        ("inf GB", "must start with a number"),
        ("20 XB", "unknown unit"),
        ("20 G", "unknown unit"),
        ("20GB extra", "number followed by a unit"),
        ("1e3GB", "number followed by a unit"),
        ("\u0663GB", "must start with a number"),
        ("0%", "positive"),
        ("-5%", "positive"),
        ("100.5%", "percentage"),
        ("150%", "percentage"),
        (0, "positive"),
        (-1, "positive"),
        (True, "bool"),
        (1.5, "float"),
        (1e9, "float"),
        (float("nan"), "float"),
        (float("inf"), "float"),
        (None, "int or a string"),
        ([20], "int or a string"),
    ],
)
def test_rejected_forms(value: object, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(value, device_memory_bytes=10**9)
    message = str(info.value)
    assert reason in message
    assert f"invalid budget {value!r}" in message
    for form in ('"20GB"', '"20 GiB"', '"512MB"', '"1.5TB"', '"1024B"', '"80%"'):
        assert form in message
    # a string came from a person or a command line, which cannot pass an int: only Python values hear of it
    assert ("an int of bytes" in message) == (not isinstance(value, str))


def test_an_unknown_unit_lists_the_units_known() -> None:
    with pytest.raises(BudgetError) as info:
        parse_bytes("1 EB")
    assert "unknown unit 'EB' (known: B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB, %)" in str(info.value)
    with pytest.raises(BudgetError, match="Pb is petabits; write PB for bytes"):
        parse_bytes("1Pb")


def test_bare_number_message_is_as_documented() -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes("20")
    assert str(info.value) == (
        "invalid budget '20': a budget needs a unit. Accepted: "
        '"20GB", "20 GiB", "512MB", "1.5TB", "1024B", "80%" (of the device\'s memory).'
    )


@given(
    n=st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False),
    unit=st.sampled_from(sorted(UNITS)),
    lower=st.booleans(),
)
def test_number_with_unit_is_floored_product(n: float, unit: str, lower: bool) -> None:
    text = f"{n}{unit.lower() if lower else unit}"
    # The text is exact decimal; the float n is not, so it is only the
    # reference to within a byte or float rounding of the product.
    exact = math.floor(Fraction(str(n)) * UNITS[unit])
    if exact < 1:
        with pytest.raises(ValueError):
            parse_bytes(text)
        return
    got = parse_bytes(text)
    assert got == exact
    assert abs(got - math.floor(n * UNITS[unit])) <= max(1, 1e-12 * got)


@given(st.integers(min_value=1, max_value=10**18))
def test_int_round_trips(n: int) -> None:
    assert parse_bytes(n) == n
    assert parse_bytes(f"{n}B") == n
    assert parse_bytes(f"{n} b") == n


@given(st.text())
def test_text_without_a_unit_raises_value_error(text: str) -> None:
    stripped = text.strip().lower()
    recognised = any(stripped.endswith(u.lower()) for u in UNITS) or stripped.endswith("%")
    if recognised:
        try:
            parse_bytes(text, device_memory_bytes=10**9)
        except ValueError:
            pass
        return
    with pytest.raises(ValueError):
        parse_bytes(text, device_memory_bytes=10**9)


@given(st.text(alphabet="0123456789.eE+- %kKmMgGtTiIbBxX", max_size=12))
def test_size_like_text_only_raises_value_error(text: str) -> None:
    try:
        assert parse_bytes(text, device_memory_bytes=10**9) > 0
    except ValueError:
        pass


H100 = DEVICES["h100-80gb"]
CPU = DEVICES["cpu"]


def test_default_reserve_formula() -> None:
    total = 20 * 10**9
    spare = total - H100.context_bytes
    assert default_reserve(total, H100) == H100.context_bytes + int(DEFAULT_FRAGMENTATION * spare)
    assert default_reserve(1000, CPU) == 50
    # Below the context size everything is reserved.
    assert default_reserve(1, H100) == H100.context_bytes


def test_make_budget_default_reserve() -> None:
    budget = make_budget("20GB", H100)
    assert budget == Budget(20 * 10**9, default_reserve(20 * 10**9, H100), "20GB", reserve_is_default=True, given="20GB")
    assert budget.usable_bytes == budget.total_bytes - budget.reserve_bytes


def test_make_budget_explicit_reserve() -> None:
    assert make_budget("20GB", H100, reserve=0).reserve_bytes == 0
    assert make_budget("20GB", H100, reserve="0").reserve_bytes == 0
    assert make_budget("20GB", H100, reserve="1GiB").reserve_bytes == 2**30
    assert make_budget("20GB", H100, reserve=123).usable_bytes == 20 * 10**9 - 123
    with pytest.raises(ValueError, match="invalid reserve"):
        make_budget("20GB", H100, reserve=-1)
    with pytest.raises(ValueError, match="invalid reserve"):
        make_budget("20GB", H100, reserve="lots")


def test_make_budget_percentage_and_int() -> None:
    budget = make_budget("50%", H100)
    assert budget.total_bytes == H100.memory_bytes // 2
    assert budget.text == "50%"
    assert make_budget(4096, CPU).text == "4096"


def test_budget_above_device_memory_is_an_error_unless_allowed() -> None:
    with pytest.raises(BudgetOverDeviceError) as info:
        make_budget("1TB", H100)
    assert info.value.budget_bytes == 10**12 and info.value.device_memory_bytes == H100.memory_bytes
    assert "h100-80gb" in str(info.value) and "allow_over_device=True" in str(info.value)
    assert make_budget("1TB", H100, allow_over_device=True).total_bytes == 10**12
    assert make_budget("100%", H100).total_bytes == H100.memory_bytes  # the whole device is fine


@pytest.mark.parametrize("reserve", ["1GB", "2GB", 10**9])
def test_reserve_that_leaves_nothing_is_an_error(reserve) -> None:
    with pytest.raises(BudgetError, match="leaves nothing"):
        make_budget("1GB", H100, reserve=reserve)


def test_numpy_integers_are_ints() -> None:
    numpy = pytest.importorskip("numpy")
    assert parse_bytes(numpy.int64(10**9)) == 10**9 and type(parse_bytes(numpy.int32(7))) is int
    with pytest.raises(ValueError, match="float"):
        parse_bytes(numpy.float64(1e9))


def test_usable_never_negative() -> None:
    assert make_budget("1MB", H100).usable_bytes == 0


def test_budget_needed_for_explicit_reserve() -> None:
    assert budget_needed_for(1000, H100, reserve="1KB") == 2000
    assert budget_needed_for(1000, H100, reserve=0) == 1000


def test_budget_needed_for_zero() -> None:
    assert budget_needed_for(0, H100) == 1
    with pytest.raises(ValueError):
        budget_needed_for(-1, H100)


@given(
    usable=st.integers(min_value=1, max_value=10**14),
    name=st.sampled_from(["h100-80gb", "cpu", "t4"]),
)
def test_budget_needed_for_is_minimal(usable: int, name: str) -> None:
    device = get_device(name)
    total = budget_needed_for(usable, device)
    assert make_budget(total, device, allow_over_device=True).usable_bytes >= usable
    if total > 1:
        assert make_budget(total - 1, device, allow_over_device=True).usable_bytes < usable


@given(
    usable=st.integers(min_value=1, max_value=10**14),
    reserve=st.integers(min_value=0, max_value=10**12),
)
def test_budget_needed_for_explicit_reserve_round_trips(usable: int, reserve: int) -> None:
    total = budget_needed_for(usable, H100, reserve=reserve)
    assert make_budget(total, H100, reserve=reserve, allow_over_device=True).usable_bytes >= usable


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (20_000_000_000, "20.0 GB"),
        (1_500_000, "1.50 MB"),
        (512, "512 B"),
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1.00 KB"),
        (150_000_000_000, "150 GB"),
        (999_999, "1.00 MB"),
        (80 * 2**30, "85.9 GB"),
        (2_500_000_000_000, "2.50 TB"),
        (-1_500_000, "-1.50 MB"),
        (-512, "-512 B"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


# -- a budget equal to the card is the card --------------------------------------------------------


@pytest.mark.parametrize(("text", "device"), [("24GB", "rtx-4090"), ("25.8GB", "rtx-4090"), ("80GB", "h100-80gb"),
                                              ("85.9GB", "h100-80gb"), ("48GB", "l40s")])
def test_a_budget_that_names_the_card_is_the_card(text: str, device: str) -> None:
    """Vendors sell 24 GiB as "24GB": the budget means the card, and the plan says how it was read."""
    card = get_device(device)
    budget = make_budget(text, card)
    assert budget.total_bytes == card.memory_bytes == make_budget("100%", card).total_bytes
    assert budget.text == text and "whole memory" in budget.note and "GiB" in budget.note


@pytest.mark.parametrize(("text", "expected"), [("24GiB", 24 * 2**30), ("20GB", 20 * 10**9), ("24000000000B", 24 * 10**9),
                                                ("24.5GB", 24_500_000_000)])
def test_other_budgets_are_taken_as_written(text: str, expected: int) -> None:
    budget = make_budget(text, get_device("rtx-4090"))
    assert budget.total_bytes == expected and budget.note == ""
    assert make_budget("24GB", get_device("cpu")).total_bytes == 24 * 10**9  # the CPU is no card sold in GiB


def test_a_budget_over_the_card_says_both_units() -> None:
    with pytest.raises(BudgetOverDeviceError) as info:
        make_budget("30GB", get_device("rtx-4090"))
    message = str(info.value)
    assert "30.00 GB" in message and "24.00 GiB = 25.77 GB" in message and '"100%"' in message


@pytest.mark.slow  # the whole pipeline
def test_the_plan_notes_how_the_budget_was_read() -> None:
    import torch

    import autoplan

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    plan = autoplan.plan(model, "24GB", example_inputs=(torch.randn(2, 8),), device="rtx-4090")
    assert plan.request.budget_bytes == 24 * 2**30
    assert any("read as rtx-4090's whole memory" in note for note in plan.notes)


@pytest.mark.slow  # the whole pipeline
def test_a_budget_allowed_over_the_card_is_told_apart_from_it() -> None:
    """85.91 GB over an 85.90 GB card: one unit alone printed both as "85.9 GB"."""
    import torch

    import autoplan

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    plan = autoplan.plan(model, "85.91GB", example_inputs=(torch.randn(2, 8),), device="h100-80gb", allow_over_device=True)
    note = next(note for note in plan.notes if "allow_over_device" in note)
    assert "(80.01 GiB = 85.91 GB) is more than h100-80gb's 80.00 GiB = 85.90 GB" in note
