"""Typed configuration, parsed once at the edge.

- `TilePolicy` (ops/tiling/policy.py): how tokens are cut into tiles; `TilePolicy.of(num_tiles,
  tile_tokens)`, `TilePolicy.budget(gb)`; resolves to a plan from shapes; `for_loss()`.
- `PatchConfig` (config/patch.py): everything patch_model does (MLPs, loss, norms, offloading,
  sequence parallelism, the generic path); `PatchConfig.from_kwargs(kwargs)` is patch_model's.
- The schema (config/schema.py): each PatchConfig field carries its help and every key that
  spells it (ours and ms-swift / axolotl / unsloth keys) with that key's parser; the key
  table, the train options and flags, the axolotl plugin's arguments and the docs derive from
  it.
- `TiledMLPConfig` (config/tiled.py): the tile policy of one TiledMLP module.
- `StepSpec` (config/plan.py): the training step the planner estimates (sequence, dtype,
  checkpointing, optimizer, tile policy, device, engine, sequence parallelism); the planner
  takes it with a `PatchConfig` (None: untiled).
- The named stacks (config/stacks.py): `STACK_PATCHES`, each stack's PatchConfig by its public
  name (`STACKS`, in order); `stack_patch(name, tiles)` with a TilePolicy.
- `read_keys` (config/keys.py): our keys and other frameworks' (ms-swift / axolotl / unsloth)
  from a dict, a Namespace, a config file's mapping or a training-arguments object, each
  parsed once by the value parsers of config/values.py (flags, tile policies, GiB budgets,
  counts, dtypes).

Invariant: every check lives once, at construction; the layers below take these objects and
never parse or validate them again.
"""

from tiledmlp.config.keys import KEYS, key_table, read_keys
from tiledmlp.config.patch import FEATURES, PatchConfig
from tiledmlp.config.schema import Key, Option, option_of
from tiledmlp.config.tiled import TiledMLPConfig
from tiledmlp.config.values import (
    DTYPES,
    parse_bool,
    parse_budget_gb,
    parse_dtype,
    parse_int,
    parse_tile_policy,
)
from tiledmlp.ops.tiling.policy import TilePolicy

__all__ = [
    "DTYPES",
    "FEATURES",
    "KEYS",
    "Key",
    "Option",
    "PatchConfig",
    "TiledMLPConfig",
    "TilePolicy",
    "parse_bool",
    "parse_budget_gb",
    "parse_dtype",
    "parse_int",
    "key_table",
    "option_of",
    "parse_tile_policy",
    "read_keys",
]
