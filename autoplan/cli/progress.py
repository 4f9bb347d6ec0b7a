"""The progress line `autoplan plan` and `autoplan verify` show on stderr while planning runs long.

Planning a large model takes seconds to a minute (tracing, then profiling every distinct unit,
solving, simulating the whole step); a person at a terminal should see which stage it is in. The
line appears only after SHOW_AFTER_S (a quick plan never flickers), only when both stdout and
stderr are terminals (never in logs, pipes or CI), never with `--json -` (stdout is data then),
and it is cleared before the report is printed.
"""

from __future__ import annotations

import re
import threading
from typing import TextIO

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

SHOW_AFTER_S = 1.0  # planning that ends sooner shows nothing

_UNIT = re.compile(r"profiling unit (?P<index>\d+)/(?P<count>\d+)(?::\s*(?P<name>.*))?")


def progress_wanted(stdout: TextIO, stderr: Console, *, json_to_stdout: bool) -> bool:
    """Show progress only to a person watching a terminal, and never inside data written to stdout."""
    return not json_to_stdout and stderr.is_terminal and _is_terminal(stdout)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


class PlanningProgress:
    """A transient rich progress line fed by `autoplan.plan(progress=...)`'s stage messages.

    Use as a context manager and pass the instance as the `progress` callback. "profiling unit
    3/12: layers.2" becomes "profiling unit 3 of 12: layers.2"; any other message ("tracing",
    "solving", "verifying the plan with a simulated training step") is shown as it is, next to a
    spinner and the time since planning started. (Identical units are profiled once, so the count
    may jump.)
    """

    def __init__(self, console: Console, *, enabled: bool, show_after_s: float = SHOW_AFTER_S) -> None:
        self.enabled = enabled
        self.show_after_s = show_after_s
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                            transient=True, redirect_stderr=False, redirect_stdout=False, disable=not enabled)
        self.task = self.bar.add_task("loading the model", total=None)
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._shown = False
        self._closed = False

    def __enter__(self) -> "PlanningProgress":
        if self.enabled:
            if self.show_after_s <= 0:
                self._show()
            else:
                self._timer = threading.Timer(self.show_after_s, self._show)
                self._timer.daemon = True
                self._timer.start()
        return self

    def _show(self) -> None:
        with self._lock:
            if not self._closed and not self._shown:
                self.bar.start()
                self._shown = True

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            if self._shown:
                self.bar.stop()

    def __call__(self, message: str) -> None:
        found = _UNIT.fullmatch(message)
        if found:
            message = f"profiling unit {found['index']} of {found['count']}" + (f": {found['name']}" if found["name"] else "")
        self.bar.update(self.task, description=message)
