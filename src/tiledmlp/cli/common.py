"""Shared pieces of the subcommands: the one-line usage error and argparse value types.

Invariant: a bad flag value is reported as one line naming what was expected (exit status 2).
"""

from __future__ import annotations

import argparse

__all__ = [
    "DTYPE_CHOICES",
    "UsageError",
    "bool_value",
    "dtype_name",
    "positive_int",
    "seq_lens",
    "tiles",
]

# --dtype spellings accepted everywhere (aliases as in Hugging Face and DeepSpeed configs)
DTYPE_CHOICES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
_CANONICAL = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class UsageError(Exception):
    """A bad flag value: reported in one line, exit status 2."""


def dtype_name(text: str) -> str:
    """The torch dtype name of a --dtype spelling (bf16 -> bfloat16, ...)."""
    return _CANONICAL.get(text, text)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def tiles(text: str) -> int | str:
    from tiledmlp.patching.args import parse_tiles

    try:
        return parse_tiles(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, 'auto', 'arctic' or 'target:<GB>', got {text!r}"
        ) from None


def seq_lens(text: str) -> tuple[int, ...]:
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(
            "expected comma-separated sequence lengths, e.g. 1024,4096"
        )
    return tuple(positive_int(p.strip()) for p in parts)


def bool_value(text: str) -> bool:
    from tiledmlp.patching.args import parse_bool

    try:
        return parse_bool(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}") from None
