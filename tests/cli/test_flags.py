"""cli.flags and the option checks of cli.app, through `autoplan` in a subprocess (real stdout, stderr, exit code).

Each case is one a newcomer hit (issue 27): a repeated option that click would have settled silently
by keeping the last, a world size no FSDP job runs, a --json file in a folder that does not exist.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.cli.flags import repeated_option

ROOT = Path(__file__).resolve().parents[2]
MLP = "tests/cli_factories.py:tiny_mlp"


def autoplan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, names, given", [
    (["--budget", "1GB", "--budget", "2GB"], "--budget / -b", "(1GB, 2GB)"),
    (["-b", "1GB", "--budget=2GB"], "--budget / -b", "(1GB, 2GB)"),
    (["-b1GB", "--device", "cpu", "--budget", "2GB"], "--budget / -b", "(1GB, 2GB)"),
    (["--budget", "1GB", "--fuse-loss", "--loss-as-written"], "--fuse-loss / --loss-as-written", "(--fuse-loss, --loss-as-written)"),
])
def test_an_option_given_twice_is_a_usage_error_naming_both_values(args, names, given) -> None:
    result = autoplan("plan", MLP, *args)
    assert result.returncode == 2, result.stderr
    assert f"{names}: given more than once {given}; give it once" in " ".join(result.stderr.split())
    assert result.stdout == "" and "Traceback" not in result.stderr


def test_options_meant_to_repeat_and_values_that_look_like_options_are_not_repeats() -> None:
    from typer.main import get_command

    from autoplan.cli.app import app

    plan = get_command(app).commands["plan"]  # type: ignore[attr-defined]
    assert repeated_option(plan.params, ["x", "--units", "a.*", "--units", "b.*", "--budget", "1GB"]) is None
    assert repeated_option(plan.params, ["x", "--json", "--budget", "--budget", "1GB"]) is None  # a file named --budget
    assert repeated_option(plan.params, ["x", "--budget", "1GB", "--", "--budget"]) is None
    assert repeated_option(plan.params, ["x", "--verbose", "-v", "--budget", "1GB"]) == ("--verbose / -v", ["--verbose", "-v"])


def test_verify_refuses_a_repeated_option_too() -> None:
    result = autoplan("verify", MLP, "--budget", "1GB", "--on", "cpu", "--steps", "2", "--steps", "3")
    assert result.returncode == 2 and "--steps: given more than once (2, 3)" in " ".join(result.stderr.split())


@pytest.mark.slow  # the whole pipeline
def test_a_world_size_no_fsdp_job_runs_is_refused_before_planning() -> None:
    result = autoplan("plan", MLP, "--budget", "1GB", "--world-size", "1000000")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == ("autoplan: error: --world-size 1,000,000 is more GPUs than FSDP shards over (at most 65,536): "
                                     "give the number of GPUs you will train on, or auto for the fewest that fit")
    assert autoplan("plan", MLP, "--budget", "1GB", "--world-size", "65536", "--device", "cpu").returncode == 0


def test_json_into_a_missing_folder_is_refused_and_no_folder_is_made(tmp_path) -> None:
    missing = tmp_path / "no" / "such"
    result = autoplan("plan", MLP, "--budget", "1GB", "--json", str(missing / "plan.json"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"autoplan: error: --json {missing / 'plan.json'}: the folder {missing} does not exist; "
                                     "create it first or write elsewhere")
    assert not (tmp_path / "no").exists()
    for option, name in (("--json", "plan.json"), ("--plot", "memory.png")):
        (tmp_path / "file").write_text("")
        result = autoplan("plan", MLP, "--budget", "1GB", option, str(tmp_path / "file" / name))
        assert result.returncode == 2 and f"the folder {tmp_path / 'file'} is not a folder" in result.stderr, result.stderr


@pytest.mark.slow  # the whole pipeline
def test_fsdp_on_the_cpu_profile_speaks_of_ranks_not_gpus() -> None:
    result = autoplan("plan", MLP, "--budget", "1GB", "--device", "cpu", "--world-size", "2")
    assert result.returncode == 0, result.stderr
    report = " ".join(result.stdout.split())
    assert "2 × cpu (per rank, FSDP)" in report and "per rank on 2 ranks (FSDP2" in report
    assert "GPU" not in report, [line for line in result.stdout.splitlines() if "GPU" in line]
