"""patch_from_args: patch a model from a recipe's keys, ours or other frameworks'.

`patch_from_args(model, args)` takes a dict (a YAML/JSON config), an argparse Namespace or a
training-arguments object, reads every tiledmlp feature from it with config.read_keys (the key
table is in tiledmlp/config/keys.py) and calls patch_model with the resulting PatchConfig:

- the tiled MLP: ms-swift `use_tiled_mlp: true`, axolotl `tiled_mlp: true`, unsloth
  `tiled_mlp: "arctic"` or `"target:<GB>"`; the tile policy from `tiled_mlp_num_shards: N`,
  `num_tiles`, `tile_tokens` or `tile_budget_gb: <GB>`;
- the tiled loss: `tiled_loss` (axolotl `chunked_cross_entropy`), its tiles `loss_num_tiles`
  (axolotl `chunked_cross_entropy_num_chunks`);
- `tiled_norms`, `tiled_layers`, `activation_offloading`, and sequence parallelism from
  `sequence_parallel_size` (ms-swift) or axolotl's `sequence_parallel_degree` /
  `context_parallel_size`;
- `generic`, `hidden_size` as in patch_model;
- any of these with the prefix `tiledmlp_` (`tiledmlp_tiled_loss: true`), for config files
  whose framework reads the bare key itself.

Under a framework that applies a feature itself (its own sequence parallelism or chunked loss),
leave that key out of `args` or use the `tiledmlp_` spelling for tiledmlp's: patch_from_args
applies every feature its keys turn on.

Invariant: nothing is patched unless a key turns a feature on; nothing is ignored silently: an
unknown `tiled*` / `tile_*` key is refused with the closest known key, two keys for one option
must agree, and a tile policy given while nothing is turned on is logged as unused.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from tiledmlp.config.keys import read_keys
from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.values import parse_bool, parse_budget_gb, parse_tile_policy
from tiledmlp.patching.patch import PatchReport, patch_model

__all__ = [
    "config_from_args",
    "parse_bool",
    "parse_budget_gb",
    "parse_tiles",
    "patch_from_args",
    "tiling_from_args",
]

logger = logging.getLogger(__name__)

_FEATURES = ("tiled_mlp", "tiled_loss", "tiled_norms", "tiled_layers", "activation_offloading")


def config_from_args(args: Any) -> PatchConfig | None:
    """The PatchConfig that `args`' keys ask for (module docstring), or None when they turn
    nothing on.

    Raises:
        ValueError: a bad value, an unknown tiledmlp key (with the closest known one), or two
            keys that disagree.
    """
    found = read_keys(args)
    values = {field: kv.value for field, kv in found.items()}
    values.setdefault("tiled_mlp", False)
    on = any(values.get(f) for f in _FEATURES) or values.get("sequence_parallel_size", 1) > 1
    if not on:
        unused = [kv.key for f, kv in found.items() if f not in _FEATURES and f != "tiled_mlp"]
        if unused:
            logger.warning(
                "patch_from_args: %s given but no feature is turned on (use_tiled_mlp / "
                "tiled_mlp, tiled_loss, tiled_norms, tiled_layers, activation_offloading, "
                "sequence_parallel_size > 1): nothing patched",
                ", ".join(unused),
            )
        return None
    return PatchConfig(**values)


def patch_from_args(model: nn.Module, args: Any) -> PatchReport | None:
    """Patches `model` with every feature `args` (a dict, argparse Namespace or training
    arguments object) turns on, in our keys or other frameworks' (module docstring).

    Returns:
        The PatchReport, or None when no key turns a feature on.

    Raises:
        ValueError: see config_from_args, and patch_model's errors.
    """
    config = config_from_args(args)
    return None if config is None else patch_model(model, config)


def tiling_from_args(args: Any) -> tuple[bool, int | str]:
    """Whether `args` turns the tiled MLP on, and its tile policy as num_tiles ("auto" when
    none is given; see config_from_args for every feature)."""
    found = read_keys(args)
    enabled = found["tiled_mlp"].value if "tiled_mlp" in found else False
    tiles = found["tiles"].value.num_tiles if "tiles" in found else "auto"
    return enabled, tiles


def parse_tiles(value: Any, name: str = "tiled_mlp_num_shards") -> int | str:
    """A tile policy's num_tiles spelling from text or a value (config.parse_tile_policy)."""
    return parse_tile_policy(value, name).num_tiles
