"""A process's file descriptor pointed at the null device for a while: what C++ prints straight to it
(highspy's banner on fd 1, kineto's start and stop lines on fd 2) reaches no one, which redirecting
`sys.stdout` / `sys.stderr` would not do."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator


@contextlib.contextmanager
def silenced(fd: int) -> Iterator[None]:
    """File descriptor `fd` (1 or 2) on the null device inside the block; what Python buffered for it is written first."""
    (sys.stdout if fd == 1 else sys.stderr).flush()
    try:
        saved = os.dup(fd)
    except OSError:  # no such descriptor (a detached process): nothing to keep clean
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
