"""Command-line interface: `tiledmlp train`, `check`, `bench`, `plan`, `env` and
`swift-plugin`, one module each.

Sits on top of everything; nothing imports it. Conventions: flags take dashes or underscores
(`--max-steps` = `--max_steps`); `-v` works before or after the subcommand; `--version`.
Errors in user input end with a one-line message and exit status 2, never a traceback or a
usage dump: what was expected, and the closest valid value or flag; long flags are never
matched by a prefix.

Invariant: argv is normalised once (underscores in flag names become dashes) before argparse
sees it; values are never touched.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

from tiledmlp.allocator import prefer_expandable_segments
from tiledmlp.cli.common import UsageError
from tiledmlp.cli.leave import leave
from tiledmlp.cli.output import results_only

__all__ = ["console", "main"]

logger = logging.getLogger("tiledmlp")
# subcommand -> its module (imported when the command line names it, or for the full help)
_COMMANDS = {
    "bench": "tiledmlp.cli.bench",
    "train": "tiledmlp.cli.train",
    "check": "tiledmlp.cli.check",
    "plan": "tiledmlp.cli.plan",
    "env": "tiledmlp.cli.env",
    "swift-plugin": "tiledmlp.cli.swift_plugin",
}


# the commands whose work is all written when their `run` returns (each prints its answer;
# `plan` has also renamed its cache file into place and joined its forked planner processes):
# their process ends without the interpreter's finalization (cli/leave.py)
_WRITTEN_ON_RETURN = frozenset({"plan", "check", "env"})


def _module(command: str) -> ModuleType:
    return importlib.import_module(_COMMANDS[command])


def _asked(words: Sequence[str]) -> tuple[str, ...]:
    """The subcommands whose parsers are built: the one the command line names (its first word
    that is not a flag: the top-level flags take no value), else all of them (for the full
    help, or the error naming the closest command); none for `--version` before a command.
    Building one command's parser imports only its module: `tiledmlp plan` reads a cached
    answer without importing the trainer or torch."""
    for word in words:
        if word in ("-h", "--help"):  # the top-level help lists every command
            break
        if word == "--version":  # printed by the top-level parser alone
            return ()
        if not word.startswith("-"):
            return (word,) if word in _COMMANDS else tuple(_COMMANDS)
    return tuple(_COMMANDS)


class _ParseError(SystemExit):
    """A usage error found while parsing: `prog` and the one-line message (a SystemExit with
    status 2, as argparse's own, for callers of the parser that catch that)."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(2)
        self.prog = prog
        self.message = message

    def __str__(self) -> str:
        return self.message


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one error style: one line (no usage dump), the closest valid
    value for a choice, and no prefix matching of long flags (`--max` is not `--max-steps`:
    a prefix that works today would change meaning when a flag is added)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise _ParseError(self.prog, message)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is None or value in choices:
            return
        names = [str(c) for c in choices]
        close = difflib.get_close_matches(str(value), names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise argparse.ArgumentError(
            action, f"expected one of {', '.join(names)}, got {value!r}{hint}"
        )


def _build_parser(commands: Sequence[str] = tuple(_COMMANDS)) -> argparse.ArgumentParser:
    """The parser of `tiledmlp` with the subcommands `commands` (every one by default)."""
    import tiledmlp

    parser = _Parser(
        prog="tiledmlp",
        description="Tiled MLPs for long-sequence training: train, benchmark, plan memory.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    parser.add_argument("--version", action="version", version=f"tiledmlp {tiledmlp.__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    for command in commands:
        _module(command).add_parser(sub)
    for child in sub.choices.values():
        child.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            default=argparse.SUPPRESS,
            help="log progress to stderr (also before the subcommand)",
        )
    return parser


def normalise_argv(argv: Sequence[str]) -> list[str]:
    """`--a_b[=value]` -> `--a-b[=value]`; everything after a bare `--` is left alone."""
    out: list[str] = []
    rest = False
    for token in argv:
        if rest or not token.startswith("--") or token == "--":
            rest = rest or token == "--"
            out.append(token)
            continue
        name, eq, value = token.partition("=")
        out.append(name.replace("_", "-") + eq + value)
    return out


def _unknown_message(
    parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]
) -> str:
    """'unrecognized argument --max-step; did you mean --max-steps?' (the closest flag of the
    subcommand, when one is close)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = sorted(sub.choices[args.command]._option_string_actions)
    first = unknown[0].split("=")[0]
    starting = [f for f in flags if f.startswith(first) and first.startswith("--")]
    close = difflib.get_close_matches(first, flags, n=1) if first.startswith("-") else []
    if starting:  # a prefix is never taken for a flag (allow_abbrev=False): name them
        hint = (
            f"; did you mean {' or '.join(starting[:3])}{' or ...' if len(starting) > 3 else ''}?"
        )
    elif close:
        hint = f"; did you mean {close[0]}?"
    else:
        hint = f"; see tiledmlp {args.command} --help"
    plural = "s" if len(unknown) > 1 else ""
    return f"unrecognized argument{plural} {' '.join(unknown)}{hint}"


def _collective_error(e: Exception) -> bool:
    """Whether `e` is a rank's CollectiveError: only a command that imported the collectives
    (and torch with them) can raise one, so a command that did not never imports them here."""
    collectives = sys.modules.get("tiledmlp.sequence_parallel.collectives")
    return collectives is not None and isinstance(e, collectives.CollectiveError)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line `argv` (default: sys.argv[1:]) and returns its exit status."""
    words = normalise_argv(sys.argv[1:] if argv is None else argv)
    parser = _build_parser(_asked(words))
    try:
        args, unknown = parser.parse_known_args(words)
    except _ParseError as e:
        print(f"{e.prog}: error: {e}", file=sys.stderr)
        return 2
    args.argv = words  # `train` prints the whole command that resumes an interrupted run
    if unknown:
        print(f"tiledmlp {args.command}: error: {_unknown_message(parser, args, unknown)}",
              file=sys.stderr)  # fmt: skip
        return 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # bitsandbytes (imported with the Trainer's PEFT support) warns on every CPU start that
        # an optional kernel package is missing; nothing here uses it.
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # before anything initialises CUDA: train and bench run with expandable segments unless
    # PYTORCH_CUDA_ALLOC_CONF says otherwise (tiledmlp/allocator.py)
    prefer_expandable_segments()
    try:
        with results_only():
            return int(_module(args.command).run(args))
    except (UsageError, ValueError) as e:
        print(f"tiledmlp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not _collective_error(e):
            raise
        # Another rank stopped answering: one line naming it, then leave at once (tearing down
        # a process group with a dead peer can hang or abort).
        print(f"tiledmlp {args.command}: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    except KeyboardInterrupt:
        print(f"tiledmlp {args.command}: interrupted", file=sys.stderr)
        return 130


def console() -> NoReturn:
    """The `tiledmlp` command and `python -m tiledmlp`: main() on sys.argv, then exit with its
    status (cli/leave.py: a process a distributed launcher started skips the interpreter's
    teardown, where gloo's threads can abort it after a successful run; so does a command of
    _WRITTEN_ON_RETURN anywhere, that teardown taking about a second)."""
    asked = _asked(normalise_argv(sys.argv[1:]))
    written = len(asked) == 1 and asked[0] in _WRITTEN_ON_RETURN
    leave(main(), finalize=False if written else None)


if __name__ == "__main__":
    console()
