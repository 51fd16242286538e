"""Command-line interface: `tiledmlp <subcommand>`. Sits on top of everything; nothing imports it."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    del argv
    print("tiledmlp: no subcommands yet", file=sys.stderr)
    return 2
