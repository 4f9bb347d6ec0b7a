"""cli.exits: how the command ends on an error: one line on stderr, never kilobytes of it."""

from __future__ import annotations

import pytest
import typer

from autoplan.cli.exits import LONGEST_ERROR_LINE, CliError, ExitCode, fail_with
from tests.cli.test_flags import autoplan


def test_a_message_of_kilobytes_is_cut_to_one_line_that_says_how_much_was_left_out(capsys) -> None:
    message = "shapes differ: " + ", ".join(f"tensor {i}: (8, 8)" for i in range(400)) + " END"
    with pytest.raises(typer.Exit) as ended:
        fail_with(CliError(ExitCode.CANNOT_PLAN, message), debug=False)
    assert ended.value.exit_code == ExitCode.CANNOT_PLAN
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith("autoplan: error: shapes differ: tensor 0: (8, 8)") and "END" not in line
    left_out = len(message) - len(message[:LONGEST_ERROR_LINE].rstrip())
    assert line.endswith(f" … ({left_out:,} more characters; --debug prints the whole error)")
    with pytest.raises(typer.Exit):
        fail_with(CliError(ExitCode.CANNOT_PLAN, message), debug=True)
    assert capsys.readouterr().err.splitlines()[-1] == f"autoplan: error: {message}"


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("command", ["plan", "verify"])
def test_torch_sized_errors_from_the_model_reach_the_terminal_as_one_short_line(command) -> None:
    """The model's backward raises one line of about 7 KB: the person reads what and where, in one line."""
    result = autoplan(command, "tests/cli_factories.py:long_error", "--budget", "1GB", *(["--on", "cpu"] if command == "verify" else []))
    assert result.returncode == ExitCode.CANNOT_PLAN, result.stderr
    line, = result.stderr.splitlines()
    assert line.startswith("autoplan: error: could not profile _LongError: RuntimeError: shapes differ: tensor 0")
    assert len(line) <= LONGEST_ERROR_LINE + 100 and "tests/cli_factories.py:" in line, line
