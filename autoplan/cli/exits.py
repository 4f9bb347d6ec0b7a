"""How the command line ends: exit codes by error class, one line on stderr, and quiet output.

Errors autoplan raises on purpose are classes (`autoplan.errors`); `EXIT_CODES` maps each to the
exit code docs/command-line.md's table documents (tests/test_docs.py holds the two equal), and
anything else is a bug (exit 1, `--debug` for the traceback). torch's own logs and prints stay out
of the way unless `--debug`, and a reader that goes away early (`autoplan plan ... | head -1`) ends
nothing badly.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import traceback
from enum import IntEnum

import typer
from rich.console import Console

from autoplan.errors import (
    BudgetError,
    DeviceError,
    DistributedSetupError,
    FactoryError,
    InfeasibleBudgetError,
    MissingExtraError,
    ModelConfigError,
    OptionError,
    PlanMismatchError,
    ProfileError,
    SegmentError,
    SolverTimeoutError,
    TargetNotFoundError,
    TargetUsageError,
    TraceError,
    UnitPatternError,
    UnknownModelError,
)
from autoplan.cli.interrupt import INTERRUPTED as SIGINT_EXIT


class ExitCode(IntEnum):
    FITS = 0  # the plan fits the budget
    ERROR = 1  # an unexpected error (a bug): rerun with --debug and report it
    USAGE = 2  # a bad option value: budget, reserve, device, units, time limit, a size the model or factory does not take, a plan for another model
    DOES_NOT_FIT = 3  # no plan fits: the report and advice say what to change
    NOT_FOUND = 4  # the target's file, module, function or HF config does not exist, or the config is invalid
    FACTORY_FAILED = 5  # importing the target or calling its factory raised or exited, or it returned no (model, inputs)
    CANNOT_PLAN = 6  # the model could not be traced or profiled, or the solver ran out of time
    MISSING_EXTRA = 7  # an optional dependency is missing (matplotlib for --plot, transformers for hf:, bitsandbytes/peft/trl: the qlora extra)
    OUTPUT_FAILED = 8  # --json or --plot could not be written
    DID_NOT_HOLD = 9  # verify: the real run went out of memory or beyond the usable budget
    INTERRUPTED = SIGINT_EXIT  # Ctrl-C: 130, as a shell reports a command SIGINT ended (cli.interrupt)


class CliError(Exception):
    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# Errors the person can fix, by class (most specific first); anything else is a bug (ExitCode.ERROR).
EXIT_CODES: tuple[tuple[type[BaseException], ExitCode], ...] = (
    (TargetUsageError, ExitCode.USAGE),
    (UnitPatternError, ExitCode.USAGE),
    (BudgetError, ExitCode.USAGE),
    (DeviceError, ExitCode.USAGE),
    (OptionError, ExitCode.USAGE),
    (PlanMismatchError, ExitCode.USAGE),
    (DistributedSetupError, ExitCode.USAGE),  # FSDP asked for outside torchrun, or on a torch without FSDP2
    (InfeasibleBudgetError, ExitCode.DOES_NOT_FIT),
    (TargetNotFoundError, ExitCode.NOT_FOUND),
    (ModelConfigError, ExitCode.NOT_FOUND),
    (UnknownModelError, ExitCode.NOT_FOUND),
    (FactoryError, ExitCode.FACTORY_FAILED),
    (TraceError, ExitCode.CANNOT_PLAN),
    (ProfileError, ExitCode.CANNOT_PLAN),
    (SegmentError, ExitCode.CANNOT_PLAN),  # the model calls its planned blocks out of order
    (SolverTimeoutError, ExitCode.CANNOT_PLAN),
    (MissingExtraError, ExitCode.MISSING_EXTRA),
)


def exit_code_for(error: BaseException) -> ExitCode:
    return next((code for kind, code in EXIT_CODES if isinstance(error, kind)), ExitCode.ERROR)


@contextlib.contextmanager
def reported(debug: bool):
    """Errors become one line and an exit code; anything unexpected is a bug (ExitCode.ERROR)."""
    try:
        yield
    except CliError as error:
        fail_with(missing_extra(error) or error, debug)
    except typer.Exit:
        raise
    except Exception as error:
        missing = missing_extra(error)
        if missing is not None:
            fail_with(missing, debug)
        code = exit_code_for(error)
        message = str(error) if code != ExitCode.ERROR else f"{type(error).__name__}: {error}"  # a bug: say what raised
        fail_with(CliError(code, message).with_traceback(error.__traceback__), debug)


def missing_extra(error: BaseException) -> CliError | None:
    """A failure whose cause is a missing package of the qlora extra (a target's model imports peft, ...): exit 7, one line."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, MissingExtraError):
            return None  # already says what to install
        if isinstance(seen, ModuleNotFoundError):
            # imported here, not with the command line: a mistyped option is answered before torch is imported
            from autoplan.inputs.qlora_twin import QLORA_PACKAGES, missing_extra_message

            name = (seen.name or "").partition(".")[0]
            if name in QLORA_PACKAGES:
                missing = CliError(ExitCode.MISSING_EXTRA, missing_extra_message(name, "the target's model"))
                missing.__cause__ = error
                return missing
        seen = seen.__cause__ or seen.__context__
    return None


LONGEST_ERROR_LINE = 1000  # characters: autoplan's own messages stay under it; torch's can run to kilobytes (tensor metadata)


def fail_with(error: CliError, debug: bool) -> None:
    if debug:
        traceback.print_exception(error.__cause__ or error, file=sys.stderr)
    message = str(error).replace("\n", " ")
    if len(message) > LONGEST_ERROR_LINE and not debug:
        cut = message[:LONGEST_ERROR_LINE].rstrip()
        message = f"{cut} … ({len(message) - len(cut):,} more characters; --debug prints the whole error)"
    typer.echo(f"autoplan: error: {message}" + ("" if debug else "  (--debug for the traceback)" if error.code == ExitCode.ERROR else ""), err=True)
    raise typer.Exit(int(error.code))


@contextlib.contextmanager
def quiet(debug: bool):
    """torch's (and transformers') own logs and prints stay out of the one-line error, unless --debug.

    A failed torch.export prints the graph and logs warnings through handlers bound to the real
    stderr at import, so both the logging module and sys.stderr are silenced, then put back.
    """
    if debug:
        yield
        return
    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(disabled)


@contextlib.contextmanager
def prints_to_stderr(stderr, *, when: bool):
    """With `--json -`, stdout is the document's: what the target prints on it (a factory's progress
    lines, the model's own prints) goes to stderr instead."""
    if not when:
        yield
        return
    with contextlib.redirect_stdout(stderr):
        yield


def write_stdout(text: str) -> None:
    """`--json -`: the document on stdout, where a reader may also go away early."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        _reader_gone()


def print_report(console: Console, parts) -> None:
    """The report on stdout; a reader that went away (`| head -1`) is not an error: the exit code stands."""
    from autoplan.report.text import render, report_width

    setattr(console, "on_broken_pipe", _reader_gone)  # this console's only: rich's own handler exits with 1
    if not console.is_terminal:  # a file or a pipe: rich would take 80 columns and crush the tables
        console.width = report_width(console, parts)
    try:
        render(console, parts)
        console.file.flush()
    except BrokenPipeError:
        _reader_gone()


def _reader_gone() -> None:
    # nothing more can be shown; stdout goes to /dev/null so later writes and Python's flush at exit are quiet
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
