"""Human units: every number a person reads in a report (bytes, durations, FLOPs, counts).

`4.17 s`, not `4.17e+03 ms`; `31.3 TFLOP`, not `31,336.1 GFLOP`. The generated tests check that
any value comes back as a mantissa of at most three significant digits in [1, 1000) and a unit,
and that it reads back to within rounding of the value.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoplan.vocabulary.formatting import (
    format_bytes,
    format_count,
    format_flops,
    format_seconds,
    format_signed_percent,
    format_signed_seconds,
)

SECONDS = {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
FLOPS = {"FLOP": 1, "KFLOP": 1e3, "MFLOP": 1e6, "GFLOP": 1e9, "TFLOP": 1e12, "PFLOP": 1e15, "EFLOP": 1e18}


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(4.17, "4.17 s"), (4170e-3, "4.17 s"), (0.432, "432 ms"), (0.0173e-3, "17.3 µs"), (1.01, "1.01 s"),
     (0.9996, "1.00 s"), (0.0, "0 s"), (59.99, "60.0 s"), (125.0, "2 min 5 s"), (3 * 3600 + 60, "3 h 1 min"),
     (2.5e-10, "0.25 ns")],
)
def test_durations(seconds: float, text: str) -> None:
    assert format_seconds(seconds) == text


def test_signed_durations_say_faster_or_slower() -> None:
    assert format_signed_seconds(0.0336) == "+33.6 ms"
    assert format_signed_seconds(-2.31) == "−2.31 s"
    assert format_signed_seconds(0.0) == "±0 s"


@pytest.mark.parametrize(
    ("flops", "text"),
    [(31_336.1e9, "31.3 TFLOP"), (1.1e9, "1.10 GFLOP"), (0, "0 FLOP"), (999.6e9, "1.00 TFLOP"), (512, "512 FLOP"),
     (172.87e9, "173 GFLOP")],
)
def test_flops(flops: float, text: str) -> None:
    assert format_flops(flops) == text


def test_bytes_and_counts_keep_their_forms() -> None:
    assert format_bytes(24_700_000_000) == "24.7 GB"
    assert format_bytes(512) == "512 B"
    assert format_count(1_235_814_400) == "1.24B"


def _read_back(text: str, units: dict[str, float]) -> tuple[float, float]:
    match = re.fullmatch(r"(?P<mantissa>\d+(?:\.\d+)?) (?P<unit>\S+)", text)
    assert match is not None, text
    assert match["unit"] in units, text
    return float(match["mantissa"]), units[match["unit"]]


@given(st.floats(min_value=1e-9, max_value=59.0))
def test_any_duration_under_a_minute_reads_back_in_one_unit(seconds: float) -> None:
    mantissa, scale = _read_back(format_seconds(seconds), SECONDS)
    assert 1 <= mantissa < 1000 or scale == 1e-9
    assert mantissa * scale == pytest.approx(seconds, rel=5e-3, abs=5e-12)


@given(st.integers(min_value=1, max_value=9 * 10**20))  # FLOP counts are whole numbers
def test_any_flop_count_reads_back_with_three_digits(flops: int) -> None:
    text = format_flops(flops)
    mantissa, scale = _read_back(text, FLOPS)
    assert 1 <= mantissa < 1000 or text.endswith("EFLOP")
    assert mantissa * scale == pytest.approx(flops, rel=5e-3)
    assert len(text.split()[0].replace(".", "").lstrip("0")) <= 3


# -- code a person pastes (vocabulary/code_lines.py) ---------------------------------------------

SNIPPETS = [
    'model = autoplan.optimize(model, 2804121, example_inputs=batch, device="cpu", precision="fp32", reserve=0, '
    'units=["layers.*", "head"], loop={"keep_outputs": False, "accumulation_steps": 4})',
    "model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
    'bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16))  # a comment, with (brackets, and commas)',
    'for start in range(0, 8, 4):  # 2 micro-batches of 4\n    micro = {name: value[start:start + 4] for name, value in '
    'batch.items() if name != "a, (b"}\n    (model(**micro).loss / 2).backward()',
]


@pytest.mark.parametrize("code", SNIPPETS)
@pytest.mark.parametrize("width", [40, 60, 88])
def test_long_code_lines_wrap_inside_their_brackets_and_stay_the_same_python(code: str, width: int) -> None:
    """Issue 27: the report's snippets were single lines of 150 columns, cut or soft-wrapped by the terminal."""
    import ast

    from autoplan.vocabulary.code_lines import wrap_code

    wrapped = wrap_code(code, width)
    assert ast.dump(ast.parse(wrapped)) == ast.dump(ast.parse(code))  # the same program
    assert "# a comment, with (brackets, and commas)" in wrapped or "comment" not in code
    for line in wrapped.split("\n"):  # only what has no bracket to break in, or a comprehension, stays longer
        assert len(line) <= width or " for " in line or ("(" not in line.strip()[:-1] and "," not in line), wrapped
    if width == 88 and " for " not in code:
        assert max(map(len, wrapped.split("\n"))) <= 88


@pytest.mark.parametrize(("fraction", "text"), [(-0.0001, "0.0%"), (0.0, "0.0%"), (0.0004, "0.0%"), (0.0005, "+0.1%"),
                                                (0.023, "+2.3%"), (-0.01, "-1.0%"), (1.5, "+150.0%")])
def test_a_signed_percent_that_rounds_to_nothing_has_no_sign(fraction: float, text: str) -> None:
    # issue 39: the verify table printed "-0.0%" for a measured peak a few bytes under the prediction
    assert format_signed_percent(fraction) == text
