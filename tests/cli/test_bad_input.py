"""Bad and unusual input through `autoplan plan`, `autoplan verify` and the Python API (issue 13).

Every case is one a new user hits: the answer must be a documented exit code and one line on
stderr naming what was wrong and what to do (never a traceback, never a plan that claims to fit
when it does not). The CLI table runs in-process through typer's CliRunner; the cases that depend
on the process itself (a closed pipe, `sys.path`, torch's own logging) run `autoplan` in a
subprocess. Targets are the tiny factories of tests/cli_factories.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import autoplan
from autoplan.errors import OptionError
from autoplan.cli.exits import ExitCode
from autoplan.cli.app import app
from tests.cli_factories import tiny_gpt, tiny_mlp
from tests.cli.test_app import assert_one_line_error, words

ROOT = Path(__file__).resolve().parents[2]
GPT = "tests/cli_factories.py:tiny_gpt"
MLP = "tests/cli_factories.py:tiny_mlp"
runner = CliRunner()
# the line of tests/cli_factories.py whose branch on a tensor's value the error must name
BRANCH_LINE = next(i for i, line in enumerate((ROOT / "tests" / "cli_factories.py").read_text().splitlines(), 1)
                   if "if y.sum() > 0:" in line)


def run(*args: str):
    return runner.invoke(app, list(args))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> Path:
    """Target files that end the process or misuse argparse, and tiny hf: configs, broken on purpose."""
    folder = tmp_path_factory.mktemp("targets")
    write(folder / "argparse_at_import.py", """\
        import argparse
        parser = argparse.ArgumentParser()
        parser.add_argument("--lr", required=True)
        args = parser.parse_args()  # runs on import: the script was not meant to be imported
        def build():
            raise AssertionError("never reached")
        """)
    small = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 32, "n_head": 2,
             "n_positions": 64, "vocab_size": 128}
    (folder / "gpt2_64.json").write_text(json.dumps(small))
    (folder / "heads.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 65,
                                                   "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 128}))
    (folder / "string.json").write_text(json.dumps(small | {"n_layer": "two"}))
    (folder / "array.json").write_text("[1, 2, 3]")
    (folder / "unknown_type.json").write_text(json.dumps({"model_type": "nosuchmodel"}))
    return folder


# -- the table: one command, one exit code, one line naming the problem --------------------------------

CASES = {
    # 1. a budget above the device's memory is a mistake, not a FITS
    "budget over the device": (["plan", GPT, "--budget", "240GB", "--device", "rtx-4090"], ExitCode.USAGE,
                               ["240", "rtx-4090", "--allow-over-device"]),
    # 4. a target that ends the process
    "sys.exit in the factory": (["plan", "tests/cli_factories.py:exits", "--budget", "1GB"], ExitCode.FACTORY_FAILED,
                                ["exits()", "SystemExit"]),
    "sys.exit in the factory (verify)": (["verify", "tests/cli_factories.py:exits", "--budget", "1GB", "--on", "cpu"],
                                         ExitCode.FACTORY_FAILED, ["SystemExit"]),
    "argparse at import": (["plan", "{targets}/argparse_at_import.py:build", "--budget", "1GB"], ExitCode.FACTORY_FAILED,
                           ["SystemExit", "__main__"]),
    # 6. a solver time limit that is no limit
    "time limit 0": (["plan", GPT, "--budget", "1GB", "--time-limit", "0"], ExitCode.USAGE, ["--time-limit"]),
    # 8. torch's own output stays out of the one line (verify printed the failed export's graph)
    "untraceable (verify)": (["verify", "tests/cli_factories.py:untraceable", "--budget", "1GB", "--on", "cpu"],
                             ExitCode.CANNOT_PLAN, ["could not trace"]),
    # 9. a branch on a tensor's value inside a unit: the model's line and the fix
    "branch inside a unit": (["plan", "tests/cli_factories.py:branch_in_block", "--budget", "1GB"], ExitCode.CANNOT_PLAN,
                             [f"cli_factories.py:{BRANCH_LINE}", "if y.sum() > 0", "torch.where"]),
    # 12. the smaller ones
    "reserve over the budget": (["plan", GPT, "--budget", "100MB", "--reserve", "200MB", "--device", "h100"], ExitCode.USAGE,
                                ["reserve", "200", "100"]),
    "kept size with an unknown unit": (["plan", GPT, "--budget", "1GB", "--kept-on-device", "10XB"], ExitCode.USAGE,
                                       ["--kept-on-device takes a size", "unknown unit 'XB'"]),
    "kept size as a percentage": (["plan", GPT, "--budget", "1GB", "--kept-on-device", "50%"], ExitCode.USAGE,
                                  ["--kept-on-device takes a size", "percentage"]),
    "a100 without a size": (["plan", GPT, "--budget", "1GB", "--device", "a100"], ExitCode.USAGE, ["a100-40gb", "a100-80gb"]),
    "v100 without a size": (["plan", GPT, "--budget", "1GB", "--device", "v100"], ExitCode.USAGE, ["v100-16gb", "v100-32gb"]),
    "budget without a unit": (["plan", GPT, "--budget", "20"], ExitCode.USAGE, ["needs a unit", '"20GB"']),
    "units with a typo": (["plan", GPT, "--budget", "1GB", "--units", "transformer.h.*,typo"], ExitCode.USAGE, ["typo"]),
    "world size not ASCII": (["plan", GPT, "--budget", "1GB", "--world-size", "²"], ExitCode.USAGE, ["--world-size"]),
    "untraceable names the CLI option": (["plan", "tests/cli_factories.py:untraceable", "--budget", "1GB"],
                                         ExitCode.CANNOT_PLAN, ["--units"]),
    # issue 25: no loss to backpropagate was "could not profile: ValueError: ..."; the model is to change
    "integer output": (["plan", "tests/cli_factories.py:integer_output", "--budget", "1GB"], ExitCode.CANNOT_PLAN,
                       ["no floating-point tensor", "from forward"]),
    "integer output (verify)": (["verify", "tests/cli_factories.py:integer_output", "--budget", "1GB", "--on", "cpu"],
                                ExitCode.CANNOT_PLAN, ["no floating-point tensor", "from forward"]),
    # issue 39: a complex loss was torch's "grad can be implicitly created only for real scalar outputs"
    "complex loss": (["plan", "tests/cli_factories.py:complex_loss", "--budget", "1GB"], ExitCode.CANNOT_PLAN,
                     ["the loss must be a real scalar", "complex64 tensor", "from forward", "loss_fn="]),
    # issue 39: "Cannot access storage of SparseTensorImpl", with no word of the embedding or what to do
    "sparse embedding": (["plan", "tests/cli_factories.py:sparse_embedding", "--budget", "1GB"], ExitCode.CANNOT_PLAN,
                         ["sparse gradients (tokens: sparse=True)", "dense gradients only", "sparse=False"]),
}
HF_CASES = {
    # 2. a sequence longer than the model's positions
    "seq-len over the positions": (["plan", "hf:{targets}/gpt2_64.json", "--budget", "1GB", "--device", "h100", "--seq-len", "65"],
                                   ExitCode.USAGE, ["65", "64"]),
    "seq-len over the positions (verify)": (["verify", "hf:{targets}/gpt2_64.json", "--budget", "1GB", "--on", "cpu",
                                             "--seq-len", "65"], ExitCode.USAGE, ["65", "64"]),
    # 7. a config with wrong values is the user's mistake (4), not a bug (1)
    "config: heads do not divide": (["plan", "hf:{targets}/heads.json", "--budget", "1GB"], ExitCode.NOT_FOUND, ["65"]),
    "config: a string for a number": (["plan", "hf:{targets}/string.json", "--budget", "1GB"], ExitCode.NOT_FOUND, ["n_layer"]),
    "config: a JSON array": (["plan", "hf:{targets}/array.json", "--budget", "1GB"], ExitCode.NOT_FOUND, ["JSON object"]),
    "config: unknown model_type": (["plan", "hf:{targets}/unknown_type.json", "--budget", "1GB"], ExitCode.NOT_FOUND,
                                   ["nosuchmodel"]),
}
# An error that names a Python argument names the command line's way to the same fix too.
CLI_WAY = {"units=[": "--units", "loss_fn=": "from forward", "allow_over_device": "--allow-over-device",
           "time_limit_s": "--time-limit", "example_inputs=": "return (model, example_inputs)"}


def _check(case: tuple, targets: Path):
    argv, code, fragments = case
    result = run(*(arg.replace("{targets}", str(targets)) for arg in argv))
    assert_one_line_error(result, code, *fragments)
    line = result.stderr.strip()
    assert len(line) < 1000, f"{len(line)} characters on one line"  # a sentence or three, not a dump
    for argument, cli in CLI_WAY.items():
        assert argument not in line or cli in line, line
    return result


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("case", list(CASES))
def test_cli_bad_input(case: str, targets: Path) -> None:
    _check(CASES[case], targets)


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("case", list(HF_CASES))
def test_cli_bad_hf_config(case: str, targets: Path) -> None:
    pytest.importorskip("transformers")
    _check(HF_CASES[case], targets)


@pytest.mark.slow  # the whole pipeline
def test_budget_error_lists_only_what_the_cli_takes() -> None:
    line = run("plan", GPT, "--budget", "20").stderr
    assert "int of bytes" not in line and "B" in line.split("Accepted:")[1]  # "1234B" is how the CLI says bytes


@pytest.mark.slow  # the whole pipeline
def test_transformers_missing_is_exit_7(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    assert_one_line_error(run("plan", "hf:gpt2", "--budget", "1GB"), ExitCode.MISSING_EXTRA, "pip install")


# -- 1. over the device, on purpose ---------------------------------------------------------------------


@pytest.mark.slow  # the whole pipeline
def test_allow_over_device_plans_and_says_so() -> None:
    result = run("plan", GPT, "--budget", "240GB", "--device", "rtx-4090", "--allow-over-device")
    assert result.exit_code == ExitCode.FITS, result.output
    assert "more than rtx-4090" in words(result.stdout)


@pytest.mark.slow  # the whole pipeline
def test_api_budget_over_the_device() -> None:
    model, inputs = tiny_gpt()
    with pytest.raises(ValueError, match="allow_over_device=True"):
        autoplan.plan(model, "240GB", example_inputs=inputs, device="rtx-4090")
    plan = autoplan.plan(model, "240GB", example_inputs=inputs, device="rtx-4090", allow_over_device=True)
    assert plan.outcome.feasible and any("more than rtx-4090" in note for note in plan.notes)
    assert "more than rtx-4090" in plan.report()


# -- 2. sequence length beyond the model's positions (API) ----------------------------------------------


@pytest.mark.slow  # the whole pipeline
def test_api_seq_len_over_the_positions(targets: Path) -> None:
    pytest.importorskip("transformers")
    from autoplan.inputs.hf_models import example_inputs_for, model_from_config

    model = model_from_config(str(targets / "gpt2_64.json"))
    with pytest.raises(ValueError, match="64"):
        autoplan.plan(model, "1GB", device="h100", seq_len=65)
    with pytest.raises(ValueError, match="64"):
        example_inputs_for(model, 1, 65)
    assert autoplan.plan(model, "1GB", device="h100", seq_len=64).feasible  # the maximum itself is fine


# -- 3. the "apply it:" snippet reproduces the plan -----------------------------------------------------

VARYING = ("solve_time_s",)  # wall-clock time of the solver


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize(
    "options",
    [
        ["--reserve", "100MB", "--precision", "fp32", "--optimizer", "sgd", "--units", "transformer.h.0", "--world-size", "2"],
        ["--precision", "bf16", "--optimizer", "sgd-momentum", "--units", "transformer.h.*", "--reserve", "0"],
        ["--drop-outputs", "--accumulation-steps", "2", "--optimizer-impl", "fused"],  # another training loop
    ],
)
def test_apply_snippet_reproduces_the_plan(tmp_path, options) -> None:
    path = tmp_path / "plan.json"
    result = run("plan", GPT, "--budget", "1GB", "--device", "h100", *options, "--json", str(path))
    assert result.exit_code == ExitCode.FITS, result.output
    lines = result.stdout.splitlines()
    after = lines[lines.index("apply it:") + 1:]
    # the call as printed: wrapped inside its brackets where it is long, continued 4 spaces deeper
    code = "\n".join(after[: next(i for i, line in enumerate(after) if not line.startswith(("model =", "scaler =", "    ")))])
    assert code.startswith("model = autoplan.optimize(") and "model, " in code
    model, batch = tiny_gpt()
    namespace = {"autoplan": autoplan, "torch": torch, "model": model, "batch": batch}
    # optimize() is plan() then apply(); with world_size > 1 it needs torchrun, so compare the plan it makes
    exec(code.replace("autoplan.optimize(", "autoplan.plan(", 1), namespace)
    expected = json.loads(path.read_text())["plan"]
    got = json.loads(namespace["model"].to_json())
    for key in VARYING:
        expected.pop(key), got.pop(key)
    assert got == expected


# -- 6. the solver's time limit -------------------------------------------------------------------------


def test_solver_time_out_is_not_infeasible() -> None:
    from autoplan.errors import SolverTimeoutError
    from autoplan.solve.ilp import minimum_peak, solve
    from tests.solve.test_ilp import asked, keep_peak, random_chain

    profile = random_chain(1, 200, three_modes=True, passed=True)  # CBC needs seconds for this one
    with pytest.raises(SolverTimeoutError, match="ran out of time") as raised:
        solve(profile, asked(int(keep_peak(profile) * 0.7), time_limit_s=0.001))
    assert raised.value.time_limit_s == 0.001 and "time_limit_s" in str(raised.value)
    with pytest.raises(SolverTimeoutError):
        minimum_peak(profile, asked(time_limit_s=0.001))


@pytest.mark.slow  # the whole pipeline
def test_time_out_of_the_fastest_plan_falls_back_to_a_plan_that_fits(monkeypatch) -> None:
    """When the search for the fastest plan runs out of time, the lowest-peak plan (which fits) is the answer."""
    import autoplan.solve.search as search
    from autoplan.errors import SolverTimeoutError

    def out_of_time(profile, request, margin_bytes=0):
        raise SolverTimeoutError(request.time_limit_s)

    monkeypatch.setattr(search, "solve", out_of_time)
    model, inputs = tiny_gpt()
    plan = autoplan.plan(model, "1GB", example_inputs=inputs, device="h100", reserve=0, time_limit_s=3)
    assert plan.outcome.feasible and plan.prediction.peak_bytes == plan.prediction.minimum_peak_bytes <= plan.request.usable_bytes
    assert any("ran out of time" in note and "time_limit_s" in note for note in plan.notes)


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("limit", [0, -1, float("nan"), float("inf")])
def test_api_time_limit_must_be_positive(limit) -> None:
    model, inputs = tiny_gpt()
    with pytest.raises(ValueError, match="time_limit_s"):
        autoplan.plan(model, "1GB", example_inputs=inputs, device="h100", time_limit_s=limit)


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("flag,value", [("fuse_loss", "no"), ("segments", 0), ("compile", "False"), ("allow_over_device", None)])
def test_api_yes_no_arguments_take_bools_only(flag, value) -> None:
    """`fuse_loss="no"` is truthy: read as a bool it would fuse the loss the caller asked to keep."""
    model, inputs = tiny_gpt()
    with pytest.raises(OptionError, match=f"{flag} takes True or False; got {value!r}"):
        autoplan.plan(model, "1GB", example_inputs=inputs, device="h100", **{flag: value})


# -- 8. torch's loggers ----------------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.slow  # the whole pipeline
def test_torch_logs_are_silent_without_debug() -> None:
    handler = _Records()
    # torch's loggers do not all propagate (torch._logging gives some their own handlers): listen to each
    names = ["torch", "torch.fx.experimental.symbolic_shapes"] + [n for n in logging.root.manager.loggerDict if n.startswith("torch.")]
    loggers = {id(logger): logger for logger in map(logging.getLogger, names) if logger.name == "torch" or not logger.propagate}
    for logger in loggers.values():
        logger.addHandler(handler)
    try:
        result = run("verify", "tests/cli_factories.py:untraceable", "--budget", "1GB", "--on", "cpu")
    finally:
        for logger in loggers.values():
            logger.removeHandler(handler)
    assert result.exit_code == ExitCode.CANNOT_PLAN
    assert [r.getMessage() for r in handler.records if r.levelno >= logging.WARNING] == []
    assert logging.root.manager.disable == logging.NOTSET  # put back for whoever runs next in this process


# -- 10. a repeated block that never runs -----------------------------------------------------------------


@pytest.mark.slow  # the whole pipeline
def test_block_that_never_runs_is_skipped_and_named(tmp_path) -> None:
    path = tmp_path / "plan.json"
    result = run("plan", "tests/cli_factories.py:unused_block", "--budget", "1GB", "--json", str(path))
    assert result.exit_code == ExitCode.FITS, result.output
    plan = json.loads(path.read_text())["plan"]
    assert [u["name"] for u in plan["units"]] == ["blocks.0", "blocks.1"]
    note = next(n for n in plan["notes"] if "blocks.2" in n)
    assert "never ran" in note and "note: " + note in words(result.stdout)


# -- 5 and 11: the process itself: a closed pipe, and where the target's imports come from ---------------


def _autoplan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`autoplan ARGS | head -0` run from `cwd`: the reader is gone before anything is written."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    # -P: like the `autoplan` script, not like `python -c`, the working directory is not put first on sys.path
    command = [sys.executable, "-P", "-c", "from autoplan.cli.app import app; app()", *args]
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    stderr = process.communicate(timeout=120)[1]
    return subprocess.CompletedProcess(command, process.returncode, "", stderr)


@pytest.mark.slow  # the whole pipeline
def test_closed_pipe_sibling_imports_and_a_profile_py_in_the_working_directory(tmp_path) -> None:
    """One process (each costs seconds of imports) for the three things only a real process shows:
    the target's sibling module imports from another directory (exit 5 if not), the working
    directory's profile.py shadows no standard module (exit 6 if it does), and a reader that
    stops early costs neither the --json file nor the exit code (exit 1 and no file if it does)."""
    write(tmp_path / "project" / "helper.py", """\
        import torch.nn as nn
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
            def forward(self, x):
                return self.fc(x).relu()
        """)
    write(tmp_path / "project" / "model.py", """\
        import torch
        import torch.nn as nn
        from helper import Block  # a sibling module: works from any working directory
        def build():
            return nn.Sequential(Block(), Block()), (torch.randn(2, 4),)
        """)
    elsewhere = tmp_path / "elsewhere"
    write(elsewhere / "profile.py", 'raise RuntimeError("the profile.py of the working directory was imported")\n')
    path = tmp_path / "plan.json"
    result = _autoplan("plan", str(tmp_path / "project" / "model.py") + ":build", "--budget", "1GB", "--device", "h100",
                       "--json", str(path), cwd=elsewhere)
    assert result.returncode == ExitCode.FITS, result.stderr
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr
    assert json.loads(path.read_text())["plan"]["feasible"] is True


# -- 12. the smaller ones ---------------------------------------------------------------------------------


@pytest.mark.slow  # the whole pipeline
def test_graph_unit_names_survive_the_report() -> None:
    result = run("plan", "tests/models.py:make_flat", "--budget", "1GB", "--device", "h100")
    assert result.exit_code == ExitCode.FITS, result.output
    assert "graph[fc_in:gelu]" in result.stdout


@pytest.mark.slow  # the whole pipeline
def test_api_accepts_numpy_integers_and_torch_devices() -> None:
    numpy = pytest.importorskip("numpy")
    model, inputs = tiny_mlp()
    by_int = autoplan.plan(model, 10**9, example_inputs=inputs, device="cpu")
    by_numpy = autoplan.plan(model, numpy.int64(10**9), example_inputs=inputs, device=torch.device("cpu"))
    assert by_numpy.request.budget_bytes == 10**9 and by_numpy.target.device == "cpu"
    assert by_numpy.prediction.peak_bytes == by_int.prediction.peak_bytes
    with pytest.raises(ValueError, match="bool"):
        autoplan.plan(model, numpy.bool_(True), example_inputs=inputs, device="cpu")


@pytest.mark.slow  # the whole pipeline
def test_api_units_with_a_typo() -> None:
    model, inputs = tiny_gpt()
    with pytest.raises(ValueError, match="typo"):
        autoplan.plan(model, "1GB", example_inputs=inputs, device="h100", units=["transformer.h.*", "typo"])


# -- 13. an integer batch into a float model -------------------------------------------------------------


@pytest.mark.slow  # the whole pipeline
def test_integer_batch_into_a_float_layer_is_refused_not_planned() -> None:
    """Fake tensors' matmul accepts int64 × float32; the real kernel refuses it: no plan may say FITS."""
    from autoplan.errors import ProfileError

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    batch = torch.randint(0, 5, (8, 16))
    with pytest.raises(RuntimeError, match="same dtype"):
        model(batch)  # what the user's first real step would do
    with pytest.raises(ProfileError, match=r"different dtypes, float32 and int64.*\.float\(\)"):
        autoplan.plan(model, "1GB", example_inputs=(batch,), device="cpu")
    assert autoplan.plan(model, "1GB", example_inputs=(batch.float(),), device="cpu").feasible


# -- 14. complex values (issue 39) -------------------------------------------------------------------------


@pytest.mark.slow  # the whole pipeline
def test_a_complex_model_is_planned_with_a_real_loss_and_its_complex_loss_is_refused() -> None:
    """A complex input was torch's "grad can be implicitly created only for real scalar outputs": from autoplan's own
    per-unit backward (a complex root) when the loss was real, and from the step's when the loss was complex."""
    from autoplan.errors import LossError
    from tests.cli_factories import complex_loss

    model, batch = complex_loss()
    with pytest.raises(LossError, match=r"the loss must be a real scalar .* complex64 tensor .*loss_fn="):
        autoplan.plan(model, "1GB", example_inputs=batch, device="cpu")
    plan = autoplan.plan(model, "1GB", example_inputs=batch, device="cpu", loss_fn=lambda out: out["signal"].abs().pow(2).mean())
    assert plan.feasible and plan.prediction.peak_bytes > 0


# -- random option values never crash ---------------------------------------------------------------------

SIZE_LIKE = st.from_regex(r"\s?[+-]?\d{0,4}(\.\d{0,2})?\s?(B|KB|MB|GB|TB|GiB|kb|%|e9|)?\s?", fullmatch=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(option=st.sampled_from(["--budget", "--reserve", "--device", "--world-size"]),
       value=st.one_of(st.text(max_size=12), SIZE_LIKE, st.sampled_from(["h100", "cpu", "4090", "auto", "1", "0", "80%", "²", "٣", "1e999GB", "nan", "inf GB"])))
def test_random_option_values_exit_cleanly(option: str, value: str) -> None:
    args = {"--budget": "1GB", "--device": "h100"} | {option: value}
    result = run("plan", MLP, *(f"{key}={text}" for key, text in args.items()))
    assert result.exit_code in (ExitCode.FITS, ExitCode.USAGE, ExitCode.DOES_NOT_FIT), (args, result.output)
    assert "Traceback" not in result.output
    if result.exit_code == ExitCode.USAGE:
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("option,value,says", [
    ("menu_size", -1, "menu_size takes a whole number"), ("menu_size", 2.5, "menu_size takes a whole number"),
    ("profile", "gpu", "profile must be 'auto', 'measure' or 'roofline'; got 'gpu'"),
    ("precision", "int8", "precision must be 'auto', 'auto-float8', 'fp32', 'bf16', 'fp16', 'float8' or 'float8-rowwise'; got 'int8'"),
    ("optimizer", "lion", "optimizer .*: unknown optimizer 'lion'; expected one of"),  # issue 27: was a ProfileError
])
def test_api_options_are_checked_before_tracing(option, value, says) -> None:
    model, inputs = tiny_gpt()
    with pytest.raises(OptionError, match=says):
        autoplan.plan(model, "1GB", example_inputs=inputs, device="h100", **{option: value})


# -- a newcomer's hour (issue 27): each rough edge, one line ----------------------------------------


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize(("budget", "says"), [("20Gb", "Gb is gigabits; write GB for bytes"), ("512Mb", "Mb is megabits"),
                                              ("0", "a budget must be positive")])
def test_budgets_a_newcomer_mistypes_say_what_they_are(budget: str, says: str) -> None:
    result = run("plan", MLP, "--budget", budget, "--device", "cpu")
    assert_one_line_error(result, ExitCode.USAGE, says)


@pytest.mark.slow  # the whole pipeline
def test_cuda_as_a_device_is_this_machines_gpu_or_says_to_name_one() -> None:
    result = run("plan", MLP, "--budget", "1GB", "--device", "cuda")
    if torch.cuda.is_available():
        assert result.exit_code in (ExitCode.FITS, ExitCode.DOES_NOT_FIT), result.output
    else:
        assert_one_line_error(result, ExitCode.USAGE, "not a CUDA device of this machine", "name the GPU to plan for")


@pytest.mark.slow  # the whole pipeline
def test_an_empty_batch_is_refused() -> None:
    model, _ = tiny_mlp()
    with pytest.raises(OptionError, match="the batch is empty: argument 0 has shape \\(0, 8\\)"):
        autoplan.plan(model, "1GB", example_inputs=(torch.randn(0, 8),), device="cpu")
    result = run("plan", MLP, "--budget", "1GB", "--device", "cpu", "--batch-size", "0")
    assert result.exit_code == ExitCode.USAGE, result.output  # typer's own check: batch size ≥ 1


@pytest.mark.slow  # the whole pipeline
def test_plan_and_verify_train_with_grad_whatever_the_callers_grad_mode() -> None:
    """Issue 27: plan() under torch.no_grad() (or after a factory's torch.set_grad_enabled(False)) gave torch's
    "element 0 of tensors does not require grad"; a training step is planned, and the caller's mode is left as it was."""
    model, inputs = tiny_mlp()
    expected = autoplan.plan(model, "1GB", example_inputs=inputs, device="cpu")
    with torch.no_grad():
        planned = autoplan.plan(model, "1GB", example_inputs=inputs, device="cpu")
        result = autoplan.verify(model, planned, example_inputs=inputs, steps=2)
        assert not torch.is_grad_enabled()
    assert planned.decisions.choices() == expected.decisions.choices() and planned.prediction.peak_bytes == expected.prediction.peak_bytes
    assert result.held


@pytest.mark.slow  # a process
def test_a_factory_that_turns_grad_off_is_planned_in_a_real_process(tmp_path) -> None:
    path = write(tmp_path / "no_grad_factory.py", """\
        import torch
        from tests.cli_factories import tiny_mlp
        def build():
            torch.set_grad_enabled(False)  # e.g. left over from an evaluation script
            return tiny_mlp()
        """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "autoplan", "plan", f"{path}:build", "--budget", "1GB", "--device", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == ExitCode.FITS, done.stderr
    assert done.stdout.startswith("FITS") and "does not require grad" not in done.stderr


@pytest.mark.slow  # a process
def test_a_closed_stdout_is_an_output_error_not_the_models() -> None:
    """Issue 27: `autoplan plan ... >&-` ended with exit 6, "cannot plan _TwoBlocks: AttributeError: 'NoneType'
    object has no attribute 'flush'", blaming the model; the report has nowhere to go: exit 8, one line."""
    from autoplan.cli.main import OUTPUT_FAILED

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "autoplan", "plan", MLP, "--budget", "1GB", "--device", "cpu"], cwd=ROOT,
                          env=env, stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=lambda: os.close(1))
    assert done.returncode == OUTPUT_FAILED == ExitCode.OUTPUT_FAILED, done.stderr
    assert done.stderr.splitlines() == ["autoplan: error: stdout is closed, so the report has nowhere to go: redirect it "
                                        "instead (> report.txt, or > /dev/null with --json FILE)"]


@pytest.mark.slow  # the whole pipeline
def test_a_frozen_model_says_it_has_nothing_to_train() -> None:
    model, inputs = tiny_mlp()
    model.requires_grad_(False)
    with pytest.raises(OptionError, match="has no trainable parameters"):
        autoplan.plan(model, "1GB", example_inputs=inputs, device="cpu")


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize(("factory", "target", "code", "says"), [
    ("def build():\n    import torch\n    return torch.nn.Linear(2, 2), (torch.randn(1, 2),), 1\n", "build", ExitCode.FACTORY_FAILED,
     "build() must return (model, example_inputs); it returned 3 items"),
    ("build = 3\n", "build", ExitCode.NOT_FOUND, "'build' is not a function (it is int)"),
])
def test_a_factory_that_is_not_one_says_what_it_is(tmp_path, factory, target, code, says) -> None:
    path = write(tmp_path / "model.py", factory)
    assert_one_line_error(run("plan", f"{path}:{target}", "--budget", "1GB"), code, says)


@pytest.mark.slow  # the whole pipeline
def test_a_folder_as_target_says_to_name_the_file_in_it(tmp_path) -> None:
    assert_one_line_error(run("plan", f"{tmp_path}:build", "--budget", "1GB"), ExitCode.NOT_FOUND, "is a folder: name the .py file in it")


@pytest.mark.slow  # the whole pipeline
def test_a_factorys_prints_go_to_stderr_when_the_json_goes_to_stdout(tmp_path) -> None:
    """`--json -` pipes into json.load even when the target prints while it builds and runs (a real process)."""
    path = write(tmp_path / "loud.py", """\
        from tests.cli_factories import tiny_mlp
        def build():
            print("building the model...")
            return tiny_mlp()
        """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    command = [sys.executable, "-P", "-c", "from autoplan.cli.app import app; app()",
               "plan", f"{path}:build", "--budget", "1GB", "--device", "cpu", "--json", "-"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == ExitCode.FITS, done.stderr
    assert json.loads(done.stdout)["plan"]["feasible"] is True
    assert "building the model..." in done.stderr and "building" not in done.stdout


@pytest.mark.slow  # the whole pipeline
def test_bf16_on_a_card_without_it_is_a_bad_option_in_cli_words() -> None:
    result = run("plan", MLP, "--budget", "1GB", "--device", "t4", "--precision", "bf16")
    assert_one_line_error(result, ExitCode.USAGE, "--precision bf16", "t4 has no bf16", "'fp16'")


@pytest.mark.slow  # the whole pipeline
def test_verify_of_a_meta_model_says_it_needs_weights(tmp_path) -> None:
    path = write(tmp_path / "meta_model.py", """\
        import torch
        from tests.cli_factories import tiny_mlp
        def build():
            with torch.device("meta"):
                model, _ = tiny_mlp()
            return model, (torch.randn(2, 8),)
        """)
    result = run("verify", f"{path}:build", "--budget", "1GB")
    assert_one_line_error(result, ExitCode.USAGE, "returns a model on the meta device", "autoplan plan takes a meta model")


def _interrupted(process: subprocess.Popen, already: str = "") -> str:
    process.send_signal(signal.SIGINT)
    stderr = already + process.communicate(timeout=60)[1]
    assert process.returncode == ExitCode.INTERRUPTED, stderr
    assert "Traceback" not in stderr and "terminate called" not in stderr and "python_error" not in stderr, stderr
    assert stderr.splitlines()[-1] == "autoplan: interrupted", stderr
    return stderr


@pytest.mark.slow  # the whole pipeline
def test_ctrl_c_exits_130_with_one_line_in_imports_and_in_planning() -> None:
    """Ctrl-C (issue 27 item 8): during the seconds of torch imports, and while planning runs the
    model on fake tensors, `autoplan` ends with exit 130 and "autoplan: interrupted", no traceback
    (it printed one, or 'terminate called after throwing an instance of python_error' from inside
    a torch callback)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-P", "-m", "autoplan", "plan", "tests/cli_factories.py:slow_mlp", "--budget", "1GB"]
    start = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # importing torch takes seconds
    assert start.poll() is None
    assert _interrupted(start) == "autoplan: interrupted\n"

    planning = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    announced = planning.stderr.readline()
    assert announced == "factory called\n", announced
    time.sleep(0.5)  # tracing and profiling: the model's forward runs for seconds
    assert planning.poll() is None
    _interrupted(planning, announced)
