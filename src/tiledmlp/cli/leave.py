"""Ending a command's process, without the interpreter's finalization where that is safe and
worth it.

Training engines keep references to their process groups after `destroy_process_group()`
(DeepSpeed ZeRO-3 in every parameter and in module globals), so gloo's backend objects are
destroyed only during the interpreter's finalization, where their worker threads can abort the
process ("terminate called without an active exception", exit status -6) after a run that
succeeded and wrote its results. Under a launcher the command therefore ends as the interpreter
would end it, less that finalization: other non-daemon threads joined, the atexit handlers run
(logging's flush and multiprocessing's joins among them), stdout and stderr flushed, then
`os._exit` with the command's status. A command whose work is all written when it returns (see
cli/__init__.py: `plan`, `check` and `env` print their answers; `plan` has renamed its cache
file into place) ends the same way outside a launcher too: the finalization of a process that
imported torch and transformers takes about a second (every module's objects collected one by
one), longer than some of its answers. Other commands exit normally outside a launcher.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

from tiledmlp.launcher import launched

__all__ = ["leave"]


def leave(status: int, *, finalize: bool | None = None) -> NoReturn:
    """Exits with `status`: with the interpreter's finalization where `finalize` (default: outside
    a launcher), else without it (the module docstring)."""
    if finalize if finalize is not None else not launched():
        sys.exit(status)
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # closed, or a broken pipe: nothing more can be written
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)
