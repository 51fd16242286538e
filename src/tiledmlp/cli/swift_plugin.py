"""`tiledmlp swift-plugin`: writes the ms-swift plugin file and prints its path.

    swift sft ... --external_plugins "$(tiledmlp swift-plugin --tiled-loss --num-tiles auto)"

The flags are patch_model's options, one per key of the schema (ours listed, ms-swift's,
axolotl's and unsloth's spellings accepted and hidden), checked here by the same parser as
everywhere else; integrations/swift.py writes the file and says what it does when imported.

Invariant: stdout is the file's path alone (one line), so the command nests in `$(...)`.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]

_NOT_OPTIONS = ("out", "check", "verbose", "command", "argv")


def add_parser(sub: Any) -> None:
    """Adds `swift-plugin` to the subcommands."""
    from tiledmlp.config.patch import PatchConfig
    from tiledmlp.config.schema import keys_of
    from tiledmlp.integrations.swift import PLUGIN_NAME

    p = sub.add_parser(
        "swift-plugin",
        help="write the ms-swift plugin file (swift sft --external_plugins FILE)",
        description="Writes a plugin file that makes `swift sft` (ms-swift) patch the model it "
        "loads with these options, and prints its path: swift sft ... --external_plugins "
        '"$(tiledmlp swift-plugin --tiled-loss)". Without options: the MLPs tiled, tiles auto.',
    )
    p.add_argument(
        "--out",
        metavar="PATH",
        default=None,
        help=f"where to write it (a path ending in /{PLUGIN_NAME}, alone in its folder); "
        "default: under ~/.cache/tiledmlp/swift/, one folder per set of options",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="run tiledmlp check on the loaded model before patching it (one step unpatched "
        "and patched, every gradient compared); a failing check stops swift sft",
    )
    for field, _, key in keys_of(PatchConfig):
        flag = "--" + key.name.replace("_", "-")
        # sequence parallelism is ms-swift's own: accepted only to be refused with the reason
        shown = key.ours and key.listed and bool(key.help)
        shown = shown and field.name != "sequence_parallel_size"
        text = key.help if shown else argparse.SUPPRESS
        if key.kind == "bool":  # alone: true; the value is parsed by the key's parser
            p.add_argument(flag, nargs="?", const="true", metavar="true|false", help=text)
        else:
            p.add_argument(flag, metavar=key.metavar or "N", help=text)


def run(args: argparse.Namespace) -> int:
    """Runs `tiledmlp swift-plugin`: the file's path on stdout."""
    from tiledmlp.cli.output import show
    from tiledmlp.integrations.swift import write_plugin

    options = {
        name: value
        for name, value in vars(args).items()
        if name not in _NOT_OPTIONS and value is not None
    }
    show(str(write_plugin(options, args.out, check=args.check)))
    return 0
