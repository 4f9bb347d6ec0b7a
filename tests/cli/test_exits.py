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


def _printed(monkeypatch, columns: str | None, *, terminal: bool = False) -> list[str]:
    """What print_report writes of a 100-column line and a table to a console that is (not) a terminal."""
    import io

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from autoplan.cli.exits import print_report

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    table = Table()
    table.add_column("unit")
    table.add_column("mode")
    table.add_row("base_model.model.model.layers.2–base_model.model.model.layers.3 (segment) " + "x" * 60, "full")
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=terminal, width=80 if terminal else None, color_system=None)
    print_report(console, [Text("word " * 20), table])
    return buffer.getvalue().splitlines()


def test_a_report_to_a_file_or_a_pipe_is_as_wide_as_its_tables(monkeypatch) -> None:
    # issue 39: written to a non-terminal, the report took rich's 80 columns, and wrapped every cell of the units table
    lines = _printed(monkeypatch, None)
    assert lines[0].strip() == ("word " * 20).strip()  # 100 columns: on one line under the 120 taken where no width is known
    row = next(line for line in lines if "layers.3 (segment)" in line)
    assert "xxxx │ full" in row  # the table widened the report: its row is not wrapped
    assert max(len(line) for line in _printed(monkeypatch, "90")) <= 90  # COLUMNS, when set, is the width
    assert max(len(line) for line in _printed(monkeypatch, None, terminal=True)) <= 80  # a terminal's own width stands


FACTORY_WITH_LOOSE_ENDS = '''
import atexit, threading, time
import torch

def _write(name, text):
    with open(name, "w") as file:
        file.write(text)

def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), (torch.randn(4, 8),)

def with_exit_handler():
    atexit.register(_write, {atexit_file!r}, "handler ran")
    return _model()

def with_thread():
    threading.Thread(target=lambda: (time.sleep(5), _write({thread_file!r}, "thread ran"))).start()  # outlives the plan
    return _model()
'''


@pytest.mark.slow  # processes that plan
def test_the_command_skips_the_interpreters_teardown_but_loses_nothing(tmp_path) -> None:
    """`autoplan` (cli.main.run) ends with os._exit (torch's teardown is most of a second), after running the atexit handlers (the
    factory's too); while a non-daemon thread of the factory still runs, it waits for it as the interpreter would.
    The report and the exit code are the command's either way."""
    atexit_file, thread_file = tmp_path / "atexit.txt", tmp_path / "thread.txt"
    factory = tmp_path / "loose_ends.py"
    factory.write_text(FACTORY_WITH_LOOSE_ENDS.format(atexit_file=str(atexit_file), thread_file=str(thread_file)))
    for builder, written, text in (("with_exit_handler", atexit_file, "handler ran"), ("with_thread", thread_file, "thread ran")):
        result = autoplan("plan", f"{factory}:{builder}", "--budget", "1GB", "--device", "cpu")
        assert result.returncode == ExitCode.FITS and result.stdout.startswith("FITS"), result.stderr
        assert written.read_text() == text
    tight = autoplan("plan", "tests/cli_factories.py:tiny_mlp", "--budget", "1KB", "--device", "cpu")
    assert tight.returncode == ExitCode.DOES_NOT_FIT and tight.stdout.startswith("DOES NOT FIT"), tight.stderr
