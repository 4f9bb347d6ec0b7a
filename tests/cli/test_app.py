"""The command line, driven through typer's CliRunner: options, JSON schema, errors and exit codes."""

from __future__ import annotations

import json
import re
import math
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import autoplan
from autoplan.report.advice import least_activation_choices
from autoplan.vocabulary.formatting import format_bytes, format_seconds
from autoplan.cli.app import JSON_SCHEMA, app
from autoplan.cli.exits import ExitCode
from autoplan.inputs.devices import DEVICES
from autoplan.memory.model import sharded_peak
from autoplan.mesh import Mesh
from tests.cli_factories import small_gpt, tiny_gpt, wide_gpt_on_meta

FACTORY = "tests/cli_factories.py:tiny_gpt"
SMALL_FACTORY = "tests/cli_factories.py:small_gpt"  # activations beyond what the caching allocator's segments round away
COMPILED_FACTORY = "tests/cli_factories.py:compiled_mlp"  # torch.compile(model), never compiled
STEP_KEYS = ["bf16", "tf32", "sdpa", "float8", "compile", "checkpointing", "offload", "grad_accumulation", "shorter_sequences",
             "optimizer_8bit", "qlora", "fsdp", "tensor-parallel"]
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def words(text: str) -> str:
    """The report with its line wrapping undone (CliRunner's terminal is 80 columns)."""
    return " ".join(text.split())


def run_json(tmp_path, *args: str):
    path = tmp_path / "plan.json"
    result = run(*args, "--json", str(path))
    assert path.exists(), result.output
    return result, json.loads(path.read_text())


def assert_one_line_error(result, code: ExitCode, *fragments: str) -> None:
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("autoplan: error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture(scope="module")
def floor_budget() -> int:
    """The smallest budget a plan fits for the small GPT at batch 4 (reserve 0), from the API: its lowest peak, or
    the caching allocator's least limit for those choices where that is higher."""
    model, inputs = small_gpt()
    return autoplan.plan(model, "1GB", example_inputs=inputs, device="h100", reserve=0).prediction.minimum_budget_bytes


# -- help and devices --------------------------------------------------------------------------


@pytest.mark.slow  # the whole pipeline
def test_help_lists_commands_and_every_plan_option() -> None:
    top = run("--help")
    assert top.exit_code == 0 and "plan" in top.output and "devices" in top.output
    plan_help = run("plan", "--help")
    assert plan_help.exit_code == 0
    for option in ("--budget", "--device", "--batch-size", "--seq-len", "--optimizer", "--precision", "--world-size",
                   "--json", "--plot", "--units", "--reserve", "--debug", "hf:CONFIG"):
        assert option in plan_help.output, option
    assert run("devices", "--help").exit_code == 0
    assert run("--version").output.strip() == f"autoplan {autoplan.__version__}"


# What each call below gets back without importing torch: (exit code, a fragment of its output).
ANSWERED_BEFORE_TORCH = {
    "--help": (0, "Usage: autoplan"),
    "plan --help": (0, "--verbose"),
    "verify --help": (0, "--steps"),
    "--version": (0, "autoplan 0.1.0"),
    "devices": (0, "h100-80gb"),
    "plan model.py:build --budget 20XB": (2, "unknown unit 'XB'"),
    "plan model.py:build --budget 1GB --device h1000": (2, "unknown device 'h1000'"),
    "plan model.py:build --budget 1GB --time-limit 0": (2, "--time-limit"),
    "plan model.py:build --budget 1GB --plot memory.txt": (2, "--plot file must end in"),
    "plan model.py:build --budget 1GB --batch-size 0": (2, "--batch-size"),
    "verify model.py:build --budget 20Gb": (2, "gigabits"),
    "verify model.py:build --budget 1GB --on tpu": (2, "--on must be cuda or cpu"),
}


@pytest.mark.slow  # a process
def test_help_and_mistyped_options_are_answered_before_torch_is_imported(tmp_path) -> None:
    """`--help`, `devices` and an option's bad value cost no torch import (3–6 s on a laptop): the
    command's own process, through its entry point, imports torch only to plan (issue 27)."""
    import subprocess
    from pathlib import Path

    script = tmp_path / "calls.py"
    script.write_text(
        "import contextlib, io, json, shlex, sys\n"
        "from autoplan.cli.main import main\n"
        "answers = {}\n"
        "for call in json.loads(sys.argv[1]):\n"
        "    sys.argv = ['autoplan', *shlex.split(call)]\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):\n"
        "        try:\n"
        "            main()\n"
        "        except SystemExit as done:\n"
        "            code = done.code or 0\n"
        "    answers[call] = [code, out.getvalue(), 'torch' in sys.modules]\n"
        "print(json.dumps(answers))\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script), json.dumps(list(ANSWERED_BEFORE_TORCH))], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    for call, (code, output, torch_imported) in json.loads(done.stdout).items():
        assert (code, ANSWERED_BEFORE_TORCH[call][1] in words(output)) == (ANSWERED_BEFORE_TORCH[call][0], True), (call, output)
        assert not torch_imported, f"autoplan {call} imported torch"


@pytest.mark.slow  # a process
def test_the_package_imports_its_public_names_when_first_used() -> None:
    """`import autoplan` is light, and `autoplan.plan`/`apply`/`verify` stay the functions once their
    namesake modules (autoplan/plan.py, autoplan/apply/, autoplan/verify/) are imported."""
    import subprocess

    code = ("import sys, autoplan; light = 'torch' not in sys.modules; "
            "import autoplan.plan, autoplan.apply, autoplan.verify.real; from autoplan.plan import Plan; "
            "print(light, [callable(getattr(autoplan, n)) for n in ('plan', 'apply', 'verify', 'optimize')], autoplan.Plan is Plan)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.stdout.split("\n")[0] == "True [True, True, True, True] True", done.stderr


def test_devices_lists_every_profile_with_its_memory() -> None:
    result = run("devices")
    assert result.exit_code == 0
    for name, device in DEVICES.items():
        assert name in result.output
    assert f"{DEVICES['h100-80gb'].memory_bytes / 2**30:.0f} GiB" in result.output


@pytest.mark.slow  # the whole pipeline
def test_devices_reads_at_80_columns_in_both_units() -> None:
    result = runner.invoke(app, ["devices"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    assert max(len(line) for line in result.output.splitlines()) <= 80
    assert "24 GiB (25.8 GB)" in result.output and "80 GiB (85.9 GB)" in result.output  # the 4090 and the H100
    assert "…" not in result.output  # nothing cut to fit
    assert "8.9" in result.output and "custom:memory=" in result.output


# -- plan: report, JSON, options -----------------------------------------------------------------


@pytest.mark.slow  # the whole pipeline
def test_plan_that_fits_report_and_json_schema(tmp_path) -> None:
    result, doc = run_json(tmp_path, "plan", FACTORY, "--budget", "1GB", "--device", "h100-80gb")
    assert result.exit_code == ExitCode.FITS, result.output
    assert set(doc) == {"schema", "autoplan_version", "target", "budget", "inputs", "plan", "advice"}
    assert doc["schema"] == JSON_SCHEMA and doc["target"] == FACTORY and doc["budget"] == "1GB"
    assert doc["inputs"] == {"batch_size": 4, "seq_len": 32, "parameter_count": tiny_gpt()[0].num_params()}
    plan = doc["plan"]
    for key in ("feasible", "budget_bytes", "usable_bytes", "predicted_peak_bytes", "simulated_peak_bytes",
                "baseline_peak_bytes", "minimum_peak_bytes", "predicted_step_time_s", "fastest_step_time_s",
                "breakdown", "peak_phase", "units", "device", "optimizer"):
        assert key in plan, key
    assert plan["feasible"] is True and plan["budget_bytes"] == 10**9 and plan["device"] == "h100-80gb"
    assert [u["name"] for u in plan["units"]] == ["transformer.h.0", "transformer.h.1"]
    assert set(plan["units"][0]) >= {"name", "mode", "precision", "saved_bytes", "recompute_flops", "step_time_s"}
    advice = doc["advice"]
    assert set(advice) == {"fits", "peak_bytes", "usable_bytes", "over_bytes", "first_fix", "steps", "fsdp", "requested_world_size",
                           "ladder"}
    assert advice["ladder"] is None  # planned only with --ladder
    assert [s["key"] for s in advice["steps"]] == STEP_KEYS
    for step in advice["steps"]:
        assert set(step) == {"key", "title", "status", "detail", "saves_bytes", "time_change_s", "code"}
        assert step["status"] in ("chosen", "try", "n/a") and step["detail"]
    assert advice["fits"] is True and advice["over_bytes"] == 0 and advice["first_fix"] is None
    assert advice["fsdp"]["world_size"] == 1  # fits one GPU
    # The report says the same numbers, verdict first.
    out = words(result.stdout)
    assert out.startswith("FITS")
    assert format_bytes(plan["predicted_peak_bytes"]) in out and format_bytes(plan["usable_bytes"]) in out
    assert format_bytes(plan["breakdown"]["optimizer"]) in out
    assert "transformer.h.0–1 ×2" in out  # identical blocks folded into one row
    assert 'autoplan.optimize(model, "1GB", example_inputs=batch, device="h100-80gb")' in out
    assert "what to change, in order" in out


@pytest.mark.slow  # the whole pipeline
def test_compile_plans_for_torch_compile_and_says_so(tmp_path) -> None:
    """--compile is autoplan.plan(compile=True): times priced as compiled, the code to apply it says so,
    and the advice's compile step points a plan without it at --compile (issue 27, first hour)."""
    for command in ("plan", "verify"):
        assert "--compile" in run(command, "--help").output, command
    eager, eager_doc = run_json(tmp_path, "plan", FACTORY, "--budget", "1GB", "--device", "h100-80gb")
    result, doc = run_json(tmp_path, "plan", FACTORY, "--budget", "1GB", "--device", "h100-80gb", "--compile")
    assert result.exit_code == eager.exit_code == ExitCode.FITS, result.output
    assert doc["plan"]["time_source"] == "roofline, compiled (elementwise fused)"
    assert eager_doc["plan"]["time_source"] == "roofline"
    assert doc["plan"]["request"]["compile"] is True and "compile" not in eager_doc["plan"]["request"]
    assert "compile=True" in words(result.stdout)  # the code that reproduces the plan
    advice = {doc_["plan"]["time_source"]: next(s["detail"] for s in doc_["advice"]["steps"] if s["key"] == "compile")
              for doc_ in (doc, eager_doc)}
    assert "autoplan plan --compile" in advice["roofline"]
    assert "this plan was made for it" in advice["roofline, compiled (elementwise fused)"]


@pytest.mark.slow  # the whole pipeline
def test_plan_that_does_not_fit_exits_3_with_advice(tmp_path, floor_budget) -> None:
    budget = str(floor_budget - 2**16)  # bytes just under the floor
    result, doc = run_json(tmp_path, "plan", SMALL_FACTORY, "--budget", f"{budget}B", "--device", "h100", "--reserve", "0")
    assert result.exit_code == ExitCode.DOES_NOT_FIT, result.output
    assert result.stdout.lstrip().startswith("DOES NOT FIT")
    assert "autoplan.optimize(" not in result.stdout  # it would raise InfeasibleBudgetError
    advice = doc["advice"]
    # short by what the floor is over the budget, the caching allocator's need beyond the allocated peak included
    assert advice["fits"] is False and advice["over_bytes"] == floor_budget - int(budget)
    steps = {s["key"]: s for s in advice["steps"]}
    accumulation = steps["grad_accumulation"]
    assert accumulation["status"] == "try" and "again in that loop: fits" in accumulation["detail"]  # the accumulating loop
    # the largest micro-batch that fits when planned again in the accumulating loop (gradients alive between
    # micro-batches), the global batch of 4 kept
    found = re.search(r"micro-batch (\d+) × (\d+) accumulation steps keeps the global batch of 4", accumulation["detail"])
    assert found and int(found[1]) < 4 and int(found[1]) * int(found[2]) == 4
    # the first fix's own estimate brings the peak under the budget
    first = steps[advice["first_fix"]]
    assert doc["plan"]["predicted_peak_bytes"] - first["saves_bytes"] <= advice["usable_bytes"] <= int(budget)
    # FSDP: the smallest GPU count whose per-GPU estimate fits, and it adds up
    fsdp = advice["fsdp"]
    parts = ("parameters", "gradients", "optimizer", "gathered_parameters", "communication_buffers", "activations")
    assert fsdp["world_size"] >= 2 and fsdp["total"] == sum(fsdp[p] for p in parts) <= advice["usable_bytes"]
    assert f"{fsdp['world_size']} × h100-80gb" in steps["fsdp"]["detail"]


@pytest.mark.slow  # the whole pipeline
def test_options_reach_the_plan(tmp_path) -> None:
    result, doc = run_json(
        tmp_path, "plan", "tests.cli_factories:tiny_gpt", "--budget", "2GB", "--device", "a100-80gb",
        "--batch-size", "2", "--seq-len", "16", "--optimizer", "sgd", "--precision", "fp32",
        "--units", "transformer.h.0", "--reserve", "0", "--world-size", "4",
    )
    assert result.exit_code == ExitCode.FITS, result.output
    plan = doc["plan"]
    assert plan["device"] == "a100-80gb" and plan["optimizer"] == "sgd" and plan["usable_bytes"] == plan["budget_bytes"]
    assert [u["name"] for u in plan["units"]] == ["transformer.h.0"]
    assert all(u["precision"] == "fp32" for u in plan["units"]) and plan["breakdown"]["optimizer"] == 0
    assert doc["inputs"]["batch_size"] == 2 and doc["inputs"]["seq_len"] == 16
    model, inputs = tiny_gpt(batch_size=2, seq_len=16)
    same = autoplan.plan(model, "2GB", example_inputs=inputs, device="a100-80gb", optimizer="sgd", precision="fp32",
                         units=["transformer.h.0"], reserve=0, world_size=4)
    assert plan["predicted_peak_bytes"] == same.prediction.peak_bytes  # the sizes and the world size reached the plan
    assert plan["world_size"] == 4 and plan["fsdp"]["total"] == plan["predicted_peak_bytes"]
    requested = doc["advice"]["requested_world_size"]
    assert requested["world_size"] == 4 and requested["parameters"] == math.ceil(requested["parameters"] * 4 / 4)
    assert "per rank on 4 GPUs (FSDP2" in words(result.stdout)
    steps = {s["key"]: s for s in doc["advice"]["steps"]}
    assert steps["bf16"]["status"] == "n/a" and "--precision auto" in steps["bf16"]["detail"]
    assert steps["optimizer_8bit"]["status"] == "n/a"  # plain SGD keeps no state
    # asked for 4 GPUs, the FSDP step is the plan itself: it said "not needed: the plan fits one GPU" (issue 27)
    assert steps["fsdp"]["status"] == "chosen" and "planned for 4 × a100-80gb under FSDP2" in steps["fsdp"]["detail"]


@pytest.mark.slow  # the whole pipeline
def test_precision_bf16_puts_every_unit_in_bf16(tmp_path) -> None:
    result, doc = run_json(tmp_path, "plan", FACTORY, "--budget", "1GB", "--device", "h100", "--precision", "bf16")
    assert result.exit_code == ExitCode.FITS
    assert {u["precision"] for u in doc["plan"]["units"]} == {"bf16"} and doc["plan"]["rest_precision"] == "bf16"
    assert doc["advice"]["steps"][0]["status"] == "chosen"


@pytest.mark.slow  # the whole pipeline
def test_wide_model_on_meta_recommends_the_smallest_fsdp_size(tmp_path) -> None:
    """Its states alone are over 8 GB: simulated anyway, FSDP's fewest GPUs come with the activations counted."""
    result, doc = run_json(tmp_path, "plan", "tests/cli_factories.py:wide_gpt_on_meta", "--budget", "8GB", "--device", "rtx-4090",
                           "--simulate-anyway")
    assert result.exit_code == ExitCode.DOES_NOT_FIT, result.output
    fsdp = doc["advice"]["fsdp"]
    usable = doc["advice"]["usable_bytes"]  # the plan's, less what the caching allocator needs beyond the peak
    assert usable <= doc["plan"]["usable_bytes"]
    # Recompute with the API: N fits, N - 1 does not.
    model, inputs = wide_gpt_on_meta()
    profiles = []
    autoplan.plan(model, "8GB", example_inputs=inputs, device="rtx-4090", on_profile=profiles.append, count_first=False)
    least = least_activation_choices(profiles[0])
    n = fsdp["world_size"]
    assert sharded_peak(profiles[0], least, Mesh.fsdp(n)).total == fsdp["total"] <= usable
    assert sharded_peak(profiles[0], least, Mesh.fsdp(n - 1)).total > usable
    assert f"{n} × rtx-4090: per GPU {format_bytes(fsdp['total'])}" in words(result.stdout)


@pytest.mark.slow  # the whole pipeline
def test_plot_writes_an_image(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.svg"
    result = run("plan", FACTORY, "--budget", "1GB", "--device", "h100", "--plot", str(path))
    assert result.exit_code == ExitCode.FITS, result.output
    assert path.read_text().lstrip().startswith(("<?xml", "<svg")) and "memory over one training step" in path.read_text()


# -- errors: one line on stderr, documented exit codes --------------------------------------------


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize(
    "args, code, fragment",
    [
        (["--budget", "20"], ExitCode.USAGE, "needs a unit"),
        (["--budget", "-1GB"], ExitCode.USAGE, "positive"),
        (["--budget", "1GB", "--device", "h900"], ExitCode.USAGE, "unknown device 'h900'"),
        (["--budget", "1GB", "--reserve", "lots"], ExitCode.USAGE, "invalid reserve"),
        (["--budget", "1GB", "--world-size", "0"], ExitCode.USAGE, "--world-size"),
        (["--budget", "1GB", "--tensor-parallel", "two"], ExitCode.USAGE, "--tensor-parallel must be a whole number"),
        (["--budget", "1GB", "--tensor-parallel", "auto"], ExitCode.USAGE, 'world_size="auto" too'),
        (["--budget", "1GB", "--plot", "memory.txt"], ExitCode.USAGE, ".png"),
        (["--budget", "1GB", "--moe-capacity", "0"], ExitCode.USAGE, "moe_capacity (--moe-capacity on the command line) must be a positive"),
    ],
)
def test_bad_option_values(args, code, fragment) -> None:
    assert_one_line_error(run("plan", FACTORY, *args), code, fragment)


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize(
    "target, code, fragment",
    [
        ("missing/model.py:build", ExitCode.NOT_FOUND, "no such file: missing/model.py"),
        ("tests/cli_factories.py:nope", ExitCode.NOT_FOUND, "no function 'nope'"),
        ("no_such_package.models:build", ExitCode.NOT_FOUND, "no module named 'no_such_package.models'"),
        ("tests/cli_factories.py", ExitCode.USAGE, "names no factory"),
        ("tests/cli_factories.py:raises", ExitCode.FACTORY_FAILED, "raises() raised RuntimeError: the dataset is not downloaded"),
        ("tests/cli_factories.py:model_only", ExitCode.FACTORY_FAILED, "return (model, example_inputs)"),
        ("tests/cli_factories.py:untraceable", ExitCode.CANNOT_PLAN, "could not trace _DataDependent"),
    ],
)
def test_bad_targets(target, code, fragment) -> None:
    assert_one_line_error(run("plan", target, "--budget", "1GB"), code, fragment)


@pytest.mark.slow  # the whole pipeline
def test_option_a_factory_does_not_take() -> None:
    result = run("plan", "tests/cli_factories.py:no_sizes", "--budget", "1GB", "--batch-size", "2")
    assert_one_line_error(result, ExitCode.USAGE, "no_sizes() takes no batch_size", "--batch-size")


@pytest.mark.slow  # the whole pipeline
def test_units_matching_nothing() -> None:
    result = run("plan", FACTORY, "--budget", "1GB", "--units", "layers.*")
    assert_one_line_error(result, ExitCode.USAGE, "layers.*")


@pytest.mark.slow  # the whole pipeline
def test_debug_shows_the_traceback() -> None:
    result = run("plan", "tests/cli_factories.py:raises", "--budget", "1GB", "--debug")
    assert result.exit_code == ExitCode.FACTORY_FAILED
    assert "Traceback" in result.stderr and "the dataset is not downloaded" in result.stderr


@pytest.mark.slow  # the whole pipeline
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a file every write to fails (ENOSPC)")
def test_unwritable_json() -> None:
    """A write that fails after planning (a full disk): exit 8. A folder that does not exist is exit 2 before
    planning (tests/cli/test_flags.py)."""
    result = run("plan", FACTORY, "--budget", "1GB", "--json", "/dev/full")
    assert result.exit_code == ExitCode.OUTPUT_FAILED and "cannot write /dev/full: No space left on device" in result.stderr


@pytest.mark.slow  # the whole pipeline
def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = run("plan", FACTORY, "--budget", "1GB", "--plot", str(tmp_path / "m.png"))
    assert_one_line_error(result, ExitCode.MISSING_EXTRA, 'pip install "autoplan[plot]"')
    assert not (tmp_path / "m.png").exists()


# -- hf: targets (need autoplan.hf from the hf branch) ------------------------------------------


@pytest.mark.slow  # the whole pipeline
def test_hf_preset_planned_on_meta(tmp_path) -> None:
    result, doc = run_json(tmp_path, "plan", "hf:gpt2", "--budget", "80GB", "--device", "h100",
                           "--batch-size", "1", "--seq-len", "32")
    assert result.exit_code == ExitCode.FITS, result.output
    assert len(doc["plan"]["units"]) == 12 and doc["inputs"]["seq_len"] == 32
    assert doc["inputs"]["parameter_count"] > 100_000_000


@pytest.mark.slow  # the whole pipeline
def test_hf_local_config(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64,
                                  "n_head": 2, "n_positions": 64, "vocab_size": 128}))
    result, doc = run_json(tmp_path, "plan", f"hf:{config}", "--budget", "1GB", "--device", "h100", "--seq-len", "16")
    assert result.exit_code == ExitCode.FITS, result.output
    assert len(doc["plan"]["units"]) == 2


@pytest.mark.slow  # the whole pipeline
def test_hf_unknown_preset() -> None:
    result = run("plan", "hf:no-such-model", "--budget", "1GB")
    assert_one_line_error(result, ExitCode.NOT_FOUND, "no-such-model", "llama-3-70b", "config.json")
    assert result.stderr.count("llama-3-70b") == 1  # the presets are listed once


# -- verify ----------------------------------------------------------------------------------------


@pytest.mark.slow  # the whole pipeline
def test_verify_on_cpu_runs_real_steps_and_reports_the_measured_peak(tmp_path):
    path = tmp_path / "verify.json"
    result = run("verify", FACTORY, "--budget", "200MB", "--on", "cpu", "--steps", "2", "--json", str(path))
    assert result.exit_code == ExitCode.FITS, result.output
    assert "the plan held" in words(result.stdout)
    document = json.loads(path.read_text())
    assert document["schema"] == "autoplan.verify/1"
    verification = document["verification"]
    assert verification["steps"] == 2 and verification["peak_source"] == "CPU allocator's count, 512 B blocks"
    assert verification["held"] is True and verification["measured_peak_bytes"] > 0
    assert abs(verification["peak_error"]) <= 0.01
    assert document["plan"]["predicted_peak_bytes"] == verification["predicted_peak_bytes"]


@pytest.mark.slow  # the whole pipeline
def test_verify_shows_the_plan_it_checked_and_what_the_step_times_are(tmp_path):
    """Issue 27, first hour: verify printed only its table, and the time row (seconds measured against
    microseconds predicted, no error) did not say what either number was."""
    path = tmp_path / "verify.json"
    result = run("verify", FACTORY, "--budget", "200MB", "--on", "cpu", "--steps", "2", "--json", str(path))
    assert result.exit_code == ExitCode.FITS, result.output
    document = json.loads(path.read_text())
    plan, verification = document["plan"], document["verification"]
    out = words(result.stdout)
    # the plan it checked, before the measurements: verdict, one row per (folded) unit with its choice
    assert out.startswith("FITS") and out.index("transformer.h.0–1 ×2") < out.index("real training steps on cpu")
    unit = plan["units"][0]
    assert re.search(rf"transformer\.h\.0–1 ×2 │ {unit['mode']} │ {unit['precision']}", out), out
    # the time row says what each number is and why it has no error
    assert re.search(r"step time \(see below\) │ [\d.]+ \w?s │ [\d.]+ \w?s │ │ n/a", out), out
    assert "measured: " in out and "the median of 1 step after the first on cpu (CPU wall clock while torch.profiler records every allocation" in out
    assert f"predicted: {format_seconds(plan['predicted_step_time_s'])} for cpu (roofline)" in out
    assert "no error: a roofline is FLOPs and bytes over cpu's datasheet peak rates, a lower bound" in out
    assert verification["step_time_error"] is None and verification["predicted_time_source"] == plan["time_source"] == "roofline"
    assert verification["planned_device"] == "cpu"


@pytest.mark.slow  # the whole pipeline
def test_verify_runs_the_loss_as_planned_fused_or_as_written(tmp_path):
    factory = "examples/llama.py:build"  # its Llama returns its loss: at batch 8 × 256 the head is fused
    measured = {}
    for flag in ("--fuse-loss", "--loss-as-written"):
        path = tmp_path / f"{flag}.json"
        result = run("verify", factory, "--budget", "200MB", "--on", "cpu", "--steps", "2", "--batch-size", "8",
                     "--seq-len", "256", "--reserve", "0", flag, "--json", str(path))
        assert result.exit_code == ExitCode.FITS, result.output
        document = json.loads(path.read_text())
        assert document["verification"]["measured_peak_bytes"] == document["plan"]["predicted_peak_bytes"]
        measured[flag] = ((document["plan"]["fused_loss"], document["plan"]["fused_loss_logits"]), document["verification"]["measured_peak_bytes"])
    assert measured["--fuse-loss"][0] == (True, "2048×512 logits") and measured["--loss-as-written"][0] == (False, "")
    assert measured["--fuse-loss"][1] < measured["--loss-as-written"][1]


@pytest.mark.slow  # the whole pipeline, twice
def test_verify_takes_a_compiled_model_as_plan_does(tmp_path):
    """Issue 39: verify of a factory returning torch.compile(Net()) exited 6, "cannot plan OptimizedModule:
    TypeError: ... does not support len()": it passed on `model or target.model`, and bool() of an
    OptimizedModule asks the wrapped module for its len(). plan planned it; verify plans and trains the same units."""
    _, planned = run_json(tmp_path, "plan", COMPILED_FACTORY, "--budget", "1GB", "--device", "cpu")
    path = tmp_path / "verify.json"
    result = run("verify", COMPILED_FACTORY, "--budget", "1GB", "--on", "cpu", "--steps", "2", "--json", str(path))
    assert result.exit_code == ExitCode.FITS, result.output
    verified = json.loads(path.read_text())
    assert [unit["name"] for unit in verified["plan"]["units"]] == [unit["name"] for unit in planned["plan"]["units"]]
    assert verified["verification"]["held"] is True


@pytest.mark.slow  # the whole pipeline
def test_verify_exits_does_not_fit_when_no_plan_fits():
    model, inputs = tiny_gpt()  # the floor of the device it runs on: a GPU's counts cuBLAS's workspaces, the CPU's not
    lowest = autoplan.plan(model, "1GB", example_inputs=inputs, device="cpu", reserve=0).prediction.minimum_peak_bytes
    result = run("verify", FACTORY, "--budget", f"{lowest // 2}B", "--on", "cpu", "--reserve", "0")
    assert result.exit_code == ExitCode.DOES_NOT_FIT, result.output


@pytest.mark.slow  # the whole pipeline
def test_verify_option_errors():
    assert run("verify", FACTORY, "--budget", "200MB", "--steps", "1").exit_code == ExitCode.USAGE
    assert_one_line_error(run("verify", FACTORY, "--budget", "200MB", "--on", "tpu"), ExitCode.USAGE, "--on")
    if not __import__("torch").cuda.is_available():
        assert_one_line_error(run("verify", FACTORY, "--budget", "200MB", "--on", "cuda"), ExitCode.USAGE, "no CUDA")


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_json_to_stdout_is_json_on_the_real_file_descriptor(solver: str) -> None:
    """The installed command as a separate process: the solver's C++ banner (highspy ≥ 1.16 prints it
    to fd 1 whatever msg=False says) must not reach stdout, which CliRunner's sys.stdout never sees.
    With CBC (where highspy is missing) too."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    without_highs = "import pulp; pulp.HiGHS.available = lambda self: False; " if solver == "cbc" else ""
    command = [sys.executable, "-c", without_highs + "from autoplan.cli.app import app; app()", "plan", FACTORY, "--budget", "1GB",
               "--device", "h100-80gb", "--json", "-"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["plan"]["feasible"] is True and doc["target"] == FACTORY


def test_states_over_the_budget_are_answered_by_counting_and_simulated_on_request(tmp_path) -> None:
    """The tiny GPT's states at 100 KB on one GPU: the count answers (no plot: nothing was simulated to draw);
    --simulate-anyway gives the whole report with the same verdict and the same states."""
    pytest.importorskip("matplotlib")
    plot = tmp_path / "memory.png"
    counted, document = run_json(tmp_path, "plan", FACTORY, "--budget", "100KB", "--device", "h100", "--reserve", "0",
                                 "--plot", str(plot))
    assert counted.exit_code == ExitCode.DOES_NOT_FIT, counted.output
    assert document["plan"]["decided_by"] == "state count" and document["plan"]["units"] == []
    assert [step["key"] for step in document["advice"]["steps"]] == STEP_KEYS and document["advice"]["first_fix"] is None
    assert not plot.exists() and "no plot written" in words(counted.stderr)
    assert "counted, not simulated" in words(counted.stdout) and "--simulate-anyway" in words(counted.stdout)
    simulated, whole = run_json(tmp_path, "plan", FACTORY, "--budget", "100KB", "--device", "h100", "--reserve", "0",
                                "--simulate-anyway")
    assert simulated.exit_code == ExitCode.DOES_NOT_FIT and whole["plan"]["decided_by"] == "simulation"
    assert whole["plan"]["state_bytes"] == document["plan"]["state_bytes"] == document["plan"]["predicted_peak_bytes"]
    assert whole["plan"]["units"] and "simulated training step" in words(simulated.stdout)
