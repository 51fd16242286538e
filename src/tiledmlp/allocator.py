"""The CUDA caching allocator's setting for tiledmlp's own entry points (`tiledmlp train`, the
bench, the measurement suite): `expandable_segments:True` unless the user set
PYTORCH_CUDA_ALLOC_CONF.

Without expandable segments, PyTorch's caching allocator keeps fixed-size segments, and a
long-context step whose tensors change size from layer to layer leaves reserved memory it cannot
reuse (see docs/guides/gpus.md for the measured gap between reserved and allocated memory).
With `expandable_segments:True` a segment grows in place instead.

Invariant: the setting only takes effect when it is in the environment before CUDA initialises
in this process, so `prefer_expandable_segments` is called at an entry point, before any CUDA
work; it never overrides a value the user set, and `describe` says which one is in effect.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = [
    "ALLOC_CONF_ENV",
    "EXPANDABLE",
    "allocator_setting",
    "describe",
    "prefer_expandable_segments",
]

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"
# Set beside the allocator setting when tiledmlp chose it, so that child processes (the
# suite's fresh measurement processes, torchrun's ranks) report it as tiledmlp's, not the user's.
_CHOSEN_BY = "TILEDMLP_ALLOC_CONF_DEFAULTED"


def prefer_expandable_segments(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True where the user set nothing.

    Call it before CUDA initialises (at a command's entry); afterwards the allocator has read its
    configuration and the variable changes nothing in this process.

    Args:
        environ: the environment to read and change (default: os.environ).

    Returns:
        The setting in effect, as `allocator_setting` gives it.
    """
    env = os.environ if environ is None else environ
    if not env.get(ALLOC_CONF_ENV):
        env[ALLOC_CONF_ENV] = EXPANDABLE
        env[_CHOSEN_BY] = "1"
    return allocator_setting(env)


def allocator_setting(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The CUDA allocator setting of this process: {"value": the PYTORCH_CUDA_ALLOC_CONF value
    or "" (PyTorch's default allocator), "set_by": "tiledmlp", "user" or "nobody"}.

    Args:
        environ: the environment to read (default: os.environ).
    """
    env = os.environ if environ is None else environ
    value = env.get(ALLOC_CONF_ENV, "")
    if not value:
        return {"value": "", "set_by": "nobody"}
    by = "tiledmlp" if env.get(_CHOSEN_BY) == "1" and value == EXPANDABLE else "user"
    return {"value": value, "set_by": by}


def describe(setting: dict[str, str]) -> str:
    """One line for `tiledmlp env` and logs."""
    if setting["set_by"] == "nobody":
        return f"{ALLOC_CONF_ENV} unset (PyTorch's default allocator, no expandable segments)"
    who = "tiledmlp's default" if setting["set_by"] == "tiledmlp" else "set by the user"
    return f"{ALLOC_CONF_ENV}={setting['value']} ({who})"
