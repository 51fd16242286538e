"""The project's own measurement and docs tooling, kept out of the installed package: the GPU
suite, the support matrix, the docs' figures and GPU tables, the planner's breakdown plot,
allocator traces and the one-off benchmark steps whose records docs/benchmarks.md quotes.

Run from a source checkout, e.g. `python -m benchmarks.suite --smoke`; the tests import it
through pyproject's pytest `pythonpath`. It imports tiledmlp; tiledmlp never imports it
(tests/package/test_import_layers.py).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the source checkout


def checkout_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the checkout first on PYTHONPATH, so that a fresh
    `python -m benchmarks.X` finds this folder wherever it is started from."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env
