"""Shared pieces of the subcommands: the one-line usage error and argparse value types.

Invariant: a bad flag value is reported as one line naming what was expected (exit status 2).
"""

from __future__ import annotations

import argparse

from tiledmlp.config.values import DTYPES, parse_dtype, parse_int

__all__ = [
    "DTYPE_CHOICES",
    "UsageError",
    "dtype_name",
    "positive_int",
    "seq_lens",
]

# --dtype spellings accepted everywhere (aliases as in Hugging Face and DeepSpeed configs)
DTYPE_CHOICES = tuple(DTYPES)


class UsageError(Exception):
    """A bad flag value: reported in one line, exit status 2."""


def dtype_name(text: str) -> str:
    """The torch dtype name of a --dtype spelling (bf16 -> bfloat16, ...)."""
    return parse_dtype(text, "--dtype")


def positive_int(text: str) -> int:
    try:
        return parse_int(text, "value")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None


def seq_lens(text: str) -> tuple[int, ...]:
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(
            "expected comma-separated sequence lengths, e.g. 1024,4096"
        )
    return tuple(positive_int(p.strip()) for p in parts)
