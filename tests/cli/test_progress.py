"""The progress line of `autoplan plan`: on stderr, only for a person at a terminal, only when planning runs long.

No timing is asserted: "long" is tested with a delay of 0 (shown at once) against one of a minute
(a quick plan never reaches it).
"""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from autoplan.cli.app import app
from autoplan.cli.progress import PlanningProgress, progress_wanted

FACTORY = "tests/cli_factories.py:tiny_gpt"


class Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def stderr_terminal() -> tuple[Console, io.StringIO]:
    buffer = Terminal()
    return Console(file=buffer, force_terminal=True, width=100), buffer


def test_progress_only_for_a_terminal_and_never_with_json_on_stdout() -> None:
    err, _ = stderr_terminal()
    assert progress_wanted(Terminal(), err, json_to_stdout=False)
    assert not progress_wanted(io.StringIO(), err, json_to_stdout=False)  # stdout piped or in a log
    assert not progress_wanted(Terminal(), err, json_to_stdout=True)  # --json -: stdout is data
    assert not progress_wanted(Terminal(), Console(file=io.StringIO()), json_to_stdout=False)  # stderr redirected


def test_progress_shows_the_stage_and_the_unit_being_profiled() -> None:
    err, buffer = stderr_terminal()
    with PlanningProgress(err, enabled=True, show_after_s=0) as progress:
        progress("tracing")
        progress("profiling unit 3/12: layers.2")
        progress.bar.refresh()
    assert "profiling unit 3 of 12: layers.2" in buffer.getvalue()


def test_quick_work_and_disabled_progress_write_nothing() -> None:
    for enabled, delay in ((True, 60.0), (False, 0.0)):
        err, buffer = stderr_terminal()
        with PlanningProgress(err, enabled=enabled, show_after_s=delay) as progress:
            progress("tracing")
            progress("solving")
        assert buffer.getvalue() == "", (enabled, delay)


@pytest.mark.slow  # the whole pipeline
def test_plan_with_json_on_stdout_writes_only_the_document_there() -> None:
    result = CliRunner().invoke(app, ["plan", FACTORY, "--budget", "1GB", "--device", "h100", "--json", "-"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)  # nothing but JSON on stdout
    assert document["plan"]["feasible"] is True
    assert result.stderr.lstrip().startswith("FITS")  # the report went to stderr, with no progress line
    assert "tracing" not in result.stderr and "profiling unit" not in result.stderr
