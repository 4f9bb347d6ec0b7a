"""The `autoplan` command's entry point (pyproject's console script, and `python -m autoplan`)."""

from __future__ import annotations

from autoplan.cli.interrupt import exit_on_interrupt


def main() -> None:
    exit_on_interrupt()  # before the heavy imports: Ctrl-C from here on is exit 130 and one line
    from autoplan.cli.app import app

    app(prog_name="autoplan")
