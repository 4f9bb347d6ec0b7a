"""The `autoplan` command's entry points: `run` (pyproject's console script, and `python -m autoplan`) and `main`."""

from __future__ import annotations

import atexit
import os
import sys
import threading

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


def run() -> None:
    """The `autoplan` script and `python -m autoplan`: `main()`, then the process ends without the interpreter's
    teardown where nothing can be lost (`exit_without_teardown`). `main()` itself raises SystemExit as a
    command does, for a caller in the same process."""
    try:
        main()
    except SystemExit as done:
        exit_without_teardown(done)
        raise


def exit_without_teardown(done: SystemExit) -> None:
    """End the process now, with `done`'s code, where nothing can be lost; else return (the caller re-raises).

    Freeing torch's and transformers' modules at interpreter exit takes most of a second (the counted
    `hf:llama-3-8b` answer, `python benchmarks/scale.py hf:llama-3-8b --world-size 1 --seq-len 4096` on the
    development VM: 5.4 s with it, 4.7 s without) and frees nothing the OS does not. Taken only with an
    integer code, no other thread that the interpreter would wait for, every atexit handler run (a factory's
    own included) and both streams flushed.
    """
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)  # CPython's; elsewhere the interpreter's own exit
    code = 0 if done.code is None else done.code
    if not isinstance(code, int) or run_exit_handlers is None:
        return
    if any(thread.is_alive() and not thread.daemon for thread in threading.enumerate() if thread is not threading.main_thread()):
        return
    if not _flushed():  # a closed or broken stream: the interpreter's exit reports it as it always has
        return
    run_exit_handlers()
    _flushed()
    os._exit(code)


def _flushed() -> bool:
    """Whether stdout and stderr are there and took what was written to them."""
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is None:
                return False
            stream.flush()
    except (OSError, ValueError):
        return False
    return True
