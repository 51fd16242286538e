"""The seeds' option names at the edge: use_tiled_mlp and tiled_mlp_num_shards.

Users of DeepSpeed/ArcticTraining-style recipes configure `use_tiled_mlp: true` and
`tiled_mlp_num_shards: N`; this maps them once onto patch_model's num_tiles.

Invariant: nothing is patched unless use_tiled_mlp is explicitly true.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from tiledmlp.patching.patch import PatchReport, patch_model

__all__ = ["parse_bool", "parse_tiles", "patch_from_args"]

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off", ""}


def _get(source: Any, key: str) -> Any:
    if isinstance(source, Mapping):
        return source.get(key)
    return getattr(source, key, None)


def parse_bool(value: Any, name: str = "use_tiled_mlp") -> bool:
    """A flag value from a config or command line: a bool, None (false) or true/false text."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{name} must be true or false, got {value!r}")


def parse_tiles(value: Any, name: str = "tiled_mlp_num_shards") -> int | str:
    """A tile count from a config or command line: a positive int, "auto", "arctic", or None
    (auto)."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "arctic"):
            return text
        if text.isdigit() and int(text) > 0:
            return int(text)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"{name} must be a positive int, 'auto' or 'arctic', got {value!r}")


def patch_from_args(model: nn.Module, args: Any) -> PatchReport | None:
    """Patches `model` when `args` (a dict, argparse Namespace, or training arguments object)
    says use_tiled_mlp=true; tiled_mlp_num_shards (default "auto") becomes num_tiles.

    Returns:
        The PatchReport, or None when tiling is off.
    """
    if not parse_bool(_get(args, "use_tiled_mlp")):
        return None
    return patch_model(model, num_tiles=parse_tiles(_get(args, "tiled_mlp_num_shards")))
