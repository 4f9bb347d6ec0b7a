"""The toolbox ladder (`autoplan plan --ladder`): baseline → + bf16 → + checkpointing → + SDPA → + 4-bit
QLoRA → + 8-bit optimizer, each rung planned; the meta-device QLoRA twin it plans against a real 4-bit
load; and the qlora extra missing, as a person without bitsandbytes/peft/trl meets it.

A tiny Llama config stands for a preset: the CLI builds it on the meta device as it builds `hf:llama-3-8b`.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from autoplan.cli.app import app
from autoplan.cli.exits import ExitCode
from autoplan.errors import MissingExtraError
from autoplan.inputs.qlora_twin import QLoraSettings, qlora_twin, require_qlora
from autoplan.report.optimizer_advice import adamw8bit_state_bytes
from tests.cli.test_app import assert_one_line_error, words

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama") / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **CONFIG}))
    return path


@pytest.fixture(scope="module")
def ladder_run(tiny_config, tmp_path_factory):
    """One `autoplan plan --ladder --json` run: the report and the JSON document every ladder test reads."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    document = tmp_path_factory.mktemp("ladder") / "plan.json"
    result = runner.invoke(app, ["plan", f"hf:{tiny_config}", "--budget", "4MB", "--reserve", "0", "--device", "cpu",
                                 "--batch-size", "2", "--seq-len", "128", "--ladder", "--json", str(document)])
    assert result.exit_code in (ExitCode.FITS, ExitCode.DOES_NOT_FIT), result.output
    return result, json.loads(document.read_text())


@pytest.mark.slow  # the whole pipeline
def test_ladder_rungs_are_cumulative_and_the_first_that_fits_is_marked(ladder_run):
    result, document = ladder_run
    ladder = document["advice"]["ladder"]
    rungs = ladder["rungs"]
    assert [r["key"] for r in rungs] == ["baseline", "bf16", "checkpointing", "sdpa", "qlora", "optimizer_8bit"]
    for rung in rungs:
        assert rung["fits"] == (rung["peak_bytes"] <= ladder["usable_bytes"])
        assert rung["step_time_s"] > 0
    first = next(i for i, r in enumerate(rungs) if r["fits"])
    assert ladder["first_fit"] == rungs[first]["key"]
    assert first > 0, "the budget is chosen so that the model as written does not fit"
    # from checkpointing on, each tool lowers the peak up to the first rung that fits (after it, plans may spend
    # the room on speed); autocast alone need not: its bf16 weight copies and casts can cost more than it saves
    assert rungs[2]["peak_bytes"] <= rungs[1]["peak_bytes"]  # the plan's choices include keeping every block
    peaks = [r["peak_bytes"] for r in rungs[2: first + 1]]
    assert peaks == sorted(peaks, reverse=True) and rungs[0]["peak_bytes"] > rungs[first]["peak_bytes"]
    # the 8-bit optimizer only shrinks the optimizer state of the QLoRA plan
    assert rungs[5]["peak_bytes"] <= rungs[4]["peak_bytes"]
    marked = [line for line in result.output.splitlines() if "← first fits" in line]
    assert len(marked) == 1 and rungs[first]["title"].split("(")[0].strip() in marked[0]


@pytest.mark.slow  # the whole pipeline
def test_ladder_apply_code_names_the_libraries_of_the_rungs_taken(ladder_run):
    result, document = ladder_run
    ladder = document["advice"]["ladder"]
    code = ladder["apply_code"]
    taken = [r["key"] for r in ladder["rungs"]]
    taken = taken[: taken.index(ladder["first_fit"]) + 1]
    assert "autoplan.optimize(" in code and code in result.output  # printed as written (long calls wrapped in brackets)
    assert ("BitsAndBytesConfig(load_in_4bit=True" in code) == ("qlora" in taken)
    assert ("prepare_model_for_kbit_training" in code and "get_peft_model(model, LoraConfig(r=16" in code) == ("qlora" in taken)
    assert ("bnb.optim.AdamW8bit" in code) == ("optimizer_8bit" in taken)
    assert 'attn_implementation="sdpa"' in code or "sdpa" not in taken
    qlora = next(r for r in ladder["rungs"] if r["key"] == "qlora")
    assert "get_peft_model" in qlora["code"] and "BitsAndBytesConfig" in qlora["code"]


def test_advice_takes_the_planned_qlora_numbers_from_the_ladder(ladder_run):
    _, document = ladder_run
    qlora_rung = next(r for r in document["advice"]["ladder"]["rungs"] if r["key"] == "qlora")
    step = next(s for s in document["advice"]["steps"] if s["key"] == "qlora")
    plan = document["plan"]
    assert step["saves_bytes"] == plan["predicted_peak_bytes"] - qlora_rung["peak_bytes"]
    assert step["time_change_s"] == pytest.approx(qlora_rung["step_time_s"] - plan["predicted_step_time_s"])
    assert "planned (--ladder" in step["detail"]


def test_a_ladder_where_nothing_fits_says_so_and_prints_no_code(ladder_run):
    """optimize() refuses a budget no plan fits, so a ladder with no fitting rung prints no line that would call it."""
    from autoplan.report.ladder import Ladder, Rung
    from autoplan.report.text import ladder_renderables

    _, document = ladder_run
    rungs = tuple(Rung(**(r | {"fits": False})) for r in document["advice"]["ladder"]["rungs"])
    text = words(" ".join(str(part.renderable if hasattr(part, "renderable") else part) for part in
                          ladder_renderables(Ladder(rungs, 1, 1, "cpu", None, ""))))
    lowest = min(rungs, key=lambda rung: rung.peak_bytes)
    assert "no step fits" in text and lowest.title.lstrip("+ ") in text
    assert "autoplan.optimize" not in text and "apply it" not in text


def _real_qlora(path, settings: QLoraSettings):
    peft = pytest.importorskip("peft")
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=settings.quant_type, bnb_4bit_use_double_quant=settings.double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, device_map="cpu")
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=settings.target_modules, task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("settings", [QLoraSettings(), QLoraSettings(quant_type="fp4", double_quant=False, rank=8)],
                         ids=["nf4-double", "fp4"])
def test_qlora_twin_plans_as_a_real_4bit_load(tmp_path, settings):
    pytest.importorskip("bitsandbytes")
    import autoplan
    from autoplan.instruments.quantized import quantization_state_tensors

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(tmp_path)
    real = _real_qlora(tmp_path, settings)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path))
    twin = qlora_twin(meta, settings)

    def described(model):
        return {name: (tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters()}

    assert described(twin) == described(real)
    assert [(t.shape, t.dtype) for t in quantization_state_tensors(twin)] == [(t.shape, t.dtype) for t in quantization_state_tensors(real)]
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    for precision in ("auto", "bf16"):
        real_plan = autoplan.plan(real, "1GB", example_inputs=batch, device="cpu", precision=precision)
        twin_plan = autoplan.plan(twin, "1GB", example_inputs=batch, device="cpu", precision=precision)
        assert real_plan.prediction.peak_bytes <= twin_plan.prediction.peak_bytes <= real_plan.prediction.peak_bytes * 1.01
        assert twin_plan.prediction.breakdown == real_plan.prediction.breakdown


def test_adamw8bit_state_formula_equals_bitsandbytes_state():
    """The 8-bit optimizer rung's state bytes against the state bitsandbytes' AdamW8bit holds after a step."""
    bnb = pytest.importorskip("bitsandbytes")
    from autoplan.vocabulary.tensors import unique_storage_bytes

    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((64, 96), (5000,), (300,), (33, 129))]
    optimizer = bnb.optim.AdamW8bit(params)
    for p in params:
        p.grad = torch.randn_like(p)
    try:
        optimizer.step()
    except (RuntimeError, NotImplementedError) as error:  # a build without CPU 8-bit kernels
        pytest.skip(f"bitsandbytes cannot step AdamW8bit on the CPU here: {error}")
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert any(t.dtype == torch.uint8 for t in state) and any(t.dtype == torch.float32 and t.numel() == 300 for t in state)
    assert unique_storage_bytes(state) == adamw8bit_state_bytes([p.numel() for p in params])


@pytest.mark.slow  # the whole pipeline
def test_ladder_without_the_qlora_extra_is_one_line_and_exit_7(tiny_config, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # an import of it now fails, as when it is not installed
    result = runner.invoke(app, ["plan", f"hf:{tiny_config}", "--budget", "4MB", "--device", "cpu", "--ladder"])
    assert result.exit_code == ExitCode.MISSING_EXTRA == 7
    assert_one_line_error(result, ExitCode.MISSING_EXTRA)
    assert 'pip install -e ".[qlora]"' in result.stderr and "bitsandbytes" in result.stderr and "--ladder" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.slow  # the whole pipeline
def test_ladder_of_a_model_that_is_not_a_transformers_one_is_a_usage_error():
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    result = runner.invoke(app, ["plan", "tests/cli_factories.py:tiny_mlp", "--budget", "1GB", "--device", "cpu", "--ladder"])
    assert_one_line_error(result, ExitCode.USAGE, "--ladder takes a Hugging Face model")


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("package", ["peft", "trl", "bitsandbytes"])
def test_a_target_that_needs_a_missing_qlora_package_is_exit_7(tmp_path, monkeypatch, package):
    factory = tmp_path / "needs_extra.py"
    factory.write_text(f"import torch\n\ndef build():\n    import {package}\n    return torch.nn.Linear(2, 2), (torch.ones(1, 2),)\n")
    monkeypatch.setitem(sys.modules, package, None)
    result = runner.invoke(app, ["plan", f"{factory}:build", "--budget", "1GB", "--device", "cpu"])
    assert result.exit_code == ExitCode.MISSING_EXTRA
    assert_one_line_error(result, ExitCode.MISSING_EXTRA)
    assert f"needs {package}" in words(result.stderr) and 'pip install -e ".[qlora]"' in result.stderr


def test_require_qlora_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(MissingExtraError, match=r'peft, which is not installed: pip install -e "\.\[qlora\]"'):
        require_qlora("the test")
