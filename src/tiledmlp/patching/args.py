"""Other frameworks' option names at the edge: the tiling keys of ms-swift, axolotl and unsloth.

- ms-swift (and DeepSpeed/ArcticTraining-style recipes): `use_tiled_mlp: true`,
  `tiled_mlp_num_shards: N`;
- axolotl: `tiled_mlp: true`, `tiled_mlp_num_shards: N`;
- unsloth's tile-mode strings under `tiled_mlp`: `"arctic"` or `"target:<GB>"` (the memory-target
  policy, ops/policy.py); an int or `"auto"` there too;
- tiledmlp's own `tile_budget_gb: <GB>` (`--tile-budget-gb`), the same memory target as a number.
This maps them once onto patch_model's num_tiles, so a recipe written for any of them runs
unchanged.

Invariant: nothing is patched unless use_tiled_mlp or tiled_mlp explicitly turns tiling on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from tiledmlp.ops.policy import target_bytes
from tiledmlp.patching.patch import PatchReport, patch_model

__all__ = [
    "parse_bool",
    "parse_budget_gb",
    "parse_tiles",
    "patch_from_args",
    "tiling_from_args",
]

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
    """A tile policy from a config or command line: a positive int, "auto", "arctic",
    "target:<GB>", or None (auto)."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "arctic"):
            return text
        if text.isdigit() and int(text) > 0:
            return int(text)
        if text.startswith("target:"):
            text = "target:" + text.removeprefix("target:").strip().removesuffix("gb")
            try:
                target_bytes(text)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            return text
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(
        f"{name} must be a positive int, 'auto', 'arctic' or 'target:<GB>', got {value!r}"
    )


def parse_budget_gb(value: Any, name: str = "tile_budget_gb") -> str:
    """The "target:<GB>" policy of a tile memory budget in GiB (a positive number)."""
    try:
        gb = float(str(value).strip().lower().removesuffix("gb")) if value is not None else -1.0
    except ValueError:
        gb = -1.0
    if isinstance(value, bool) or not gb > 0 or gb == float("inf"):
        raise ValueError(
            f"{name} must be a positive number of GiB (each MLP's working memory budget, e.g. "
            f"2 or 0.5), got {value!r}"
        )
    return f"target:{gb:g}"


def tiling_from_args(args: Any) -> tuple[bool, int | str]:
    """Whether a recipe turns tiling on, and its tile policy, from ms-swift, axolotl or unsloth keys.

    `use_tiled_mlp` (ms-swift) or `tiled_mlp` (axolotl: a bool; unsloth: a mode string such
    as "arctic" or "target:0.5") turns tiling on; `tiled_mlp_num_shards` gives the tile count,
    `tile_budget_gb` a memory target. Policies that disagree are refused.

    Raises:
        ValueError: a value of the wrong kind, or two keys that contradict each other.
    """
    use = _get(args, "use_tiled_mlp")
    mode = _get(args, "tiled_mlp")
    shards = _get(args, "tiled_mlp_num_shards")
    policy: int | str | None = None
    if mode is not None and not isinstance(mode, bool):
        try:
            on = parse_bool(mode, "tiled_mlp")
        except ValueError:
            on, policy = True, parse_tiles(mode, "tiled_mlp")
        mode = on
    if use is not None and mode is not None and parse_bool(use) != mode:
        raise ValueError(
            f"use_tiled_mlp={use!r} and tiled_mlp={_get(args, 'tiled_mlp')!r} disagree; give one"
        )
    enabled = parse_bool(use) if use is not None else bool(mode)
    if shards is not None:
        count = parse_tiles(shards)
        if policy is not None and policy != count:
            raise ValueError(
                f"tiled_mlp={_get(args, 'tiled_mlp')!r} and tiled_mlp_num_shards={shards!r} "
                "disagree; give one"
            )
        policy = count
    budget = _get(args, "tile_budget_gb")
    if budget is not None:
        target = parse_budget_gb(budget)
        if policy is not None and policy != target:
            raise ValueError(
                f"tile_budget_gb={budget!r} and the tile policy {policy!r} (tiled_mlp / "
                "tiled_mlp_num_shards) disagree; give one"
            )
        policy = target
    return enabled, "auto" if policy is None else policy


def patch_from_args(model: nn.Module, args: Any) -> PatchReport | None:
    """Patches `model` when `args` (a dict, argparse Namespace, or training arguments object)
    turns tiling on with ms-swift, axolotl or unsloth keys (see tiling_from_args); the tile policy (default
    "auto") becomes num_tiles.

    Returns:
        The PatchReport, or None when tiling is off.
    """
    enabled, num_tiles = tiling_from_args(args)
    if not enabled:
        return None
    return patch_model(model, num_tiles=num_tiles)
