"""Where the CLI writes: results on stdout, everything else on stderr.

A command's result (the table, the summary, `--json`'s object) goes to stdout through `show`;
while a command runs inside `results_only()`, anything else written to stdout (a library's
print, a logging handler bound to stdout, such as DeepSpeed's "Setting accelerator to CPU"
warning) goes to stderr.

Invariant: inside `results_only()`, stdout receives only what `show` writes, so `--json` output
parses as JSON and a table is only the table.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import TextIO

__all__ = ["StderrHandler", "results_only", "show"]

_RESULT_STREAMS: list[TextIO] = []


def show(text: str = "", end: str = "\n") -> None:
    """Writes part of a command's result to stdout (the real one, inside `results_only`)."""
    out = _RESULT_STREAMS[-1] if _RESULT_STREAMS else sys.stdout
    out.write(text + end)
    out.flush()


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A logging handler that writes to whatever sys.stderr is when a record is emitted (not
    the stream of when it was made, which a caller, e.g. a test capturing stderr, may have
    closed since)."""

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.__init__ and setStream set it
        pass


def _handlers_on(stream: TextIO) -> list[logging.StreamHandler]:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    return [
        h
        for lg in loggers
        if isinstance(lg, logging.Logger)
        for h in lg.handlers
        if isinstance(h, logging.StreamHandler) and h.stream is stream
    ]


@contextlib.contextmanager
def results_only() -> Iterator[None]:
    """Sends everything but `show` to stderr while the block runs (module docstring)."""
    stdout = sys.stdout
    moved = _handlers_on(stdout)
    for handler in moved:
        handler.setStream(sys.stderr)
    _RESULT_STREAMS.append(stdout)
    sys.stdout = sys.stderr  # handlers created now (by a library imported now) bind to stderr
    try:
        yield
    finally:
        sys.stdout = stdout
        _RESULT_STREAMS.pop()
        for handler in moved:
            handler.setStream(stdout)
