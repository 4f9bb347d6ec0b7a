"""Ctrl-C on the command line: exit 130 with one line, wherever the process was.

Python turns SIGINT into a KeyboardInterrupt raised wherever the main thread is. During planning
that can be inside a callback torch runs from C++ (a dispatch mode, a hook, a weakref finalizer
run while a tensor is freed): there it either unwinds into a traceback or, where C++ cannot
propagate it, ends the process with "terminate called after throwing an instance of
'python_error'". So the command line raises nothing: its SIGINT handler writes one line to the
real stderr (the planning's stderr may be redirected, `cli.exits.quiet`) and leaves with
`os._exit(130)`, the shell's code for "ended by SIGINT". Python runs the handler between two
bytecodes of the main thread, so it never interrupts C++ half-way. Nothing is written after it:
no half-written --json or --plot file is left behind, since files are written only at the end.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command Ctrl-C ended
MESSAGE = b"autoplan: interrupted\n"


def exit_interrupted(*_signal_args) -> None:
    """Flush what the report printed so far, say "interrupted" on the real stderr, exit 130 at once."""
    for stream in (sys.stdout, sys.__stdout__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a reader gone away, a closed redirect: nothing more to show there
            pass
    try:
        os.write(2, MESSAGE)
    except OSError:
        pass
    os._exit(INTERRUPTED)


def exit_on_interrupt() -> None:
    """From now on, SIGINT ends the command line at once with exit 130 and one line."""
    signal.signal(signal.SIGINT, exit_interrupted)


def is_command_line() -> bool:
    """Whether this process is the `autoplan` command (the console script or `python -m autoplan`),
    for an interrupt during the package's own imports, before the command could install its handler."""
    argv = getattr(sys, "orig_argv", [])
    module = argv[argv.index("-m") + 1 : argv.index("-m") + 2] if "-m" in argv else []  # python's own -m comes first
    return Path(sys.argv[0]).stem == "autoplan" or module == ["autoplan"]
