"""The `autoplan` command's entry point (pyproject's console script, and `python -m autoplan`)."""

from __future__ import annotations

import os
import sys

from autoplan.cli.interrupt import exit_on_interrupt

OUTPUT_FAILED = 8  # ExitCode.OUTPUT_FAILED, without importing the command line before it is needed
CLOSED_STDOUT = (b"autoplan: error: stdout is closed, so the report has nowhere to go: redirect it instead "
                 b"(> report.txt, or > /dev/null with --json FILE)\n")


def main() -> None:
    exit_on_interrupt()  # before the heavy imports: Ctrl-C from here on is exit 130 and one line
    if sys.stdout is None:  # started with file descriptor 1 closed (`autoplan ... >&-`)
        os.write(2, CLOSED_STDOUT)  # not a planning failure of the model (it was exit 6, 'NoneType' has no 'flush')
        raise SystemExit(OUTPUT_FAILED)
    from autoplan.cli.app import app

    app(prog_name="autoplan")
