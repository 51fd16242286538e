"""patch_from_args: patch a model from a recipe's keys, ours or other frameworks'.

`patch_from_args(model, args)` takes a dict (a YAML/JSON config), an argparse Namespace or a
training-arguments object, reads every tiledmlp feature from it with config.read_keys and calls
patch_model with the resulting PatchConfig. Every option's keys, ours and other frameworks'
(ms-swift `use_tiled_mlp` / `tiled_mlp_num_shards`, axolotl `tiled_mlp: true` /
`chunked_cross_entropy`, unsloth `tiled_mlp: "arctic"` or `"target:<GB>"`, ...), are declared
once on PatchConfig's fields (config/patch.py; the table is in docs/guides/integrations.md);
any of them may carry the prefix `tiledmlp_` (`tiledmlp_tiled_loss: true`), for config files
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
from tiledmlp.config.patch import FEATURES, PatchConfig
from tiledmlp.config.values import parse_bool, parse_budget_gb
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.patching.patch import PatchReport, patch_model

__all__ = [
    "config_from_args",
    "parse_bool",
    "parse_budget_gb",
    "patch_from_args",
    "tiling_from_args",
]

logger = logging.getLogger(__name__)


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
    on = any(values.get(f) for f in FEATURES) or values.get("sequence_parallel_size", 1) > 1
    if not on:
        unused = [kv.key for f, kv in found.items() if f not in FEATURES]
        if unused:
            logger.warning(
                "patch_from_args: %s given but no feature is turned on (use_tiled_mlp / "
                "tiled_mlp, %s, sequence_parallel_size > 1): nothing patched",
                ", ".join(unused),
                ", ".join(FEATURES[1:]),
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


def tiling_from_args(args: Any) -> tuple[bool, TilePolicy]:
    """Whether `args` turns the tiled MLP on, and its tile policy (TilePolicy() when none is
    given; see config_from_args for every feature)."""
    found = read_keys(args)
    enabled = found["tiled_mlp"].value if "tiled_mlp" in found else False
    tiles = found["tiles"].value if "tiles" in found else TilePolicy()
    return enabled, tiles
