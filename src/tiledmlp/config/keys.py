"""Option keys of every source, ours and other frameworks', read once into typed values.

A recipe written for ms-swift, axolotl or unsloth, a `tiledmlp train` config file, an argparse
Namespace or a training-arguments object all name the same features; `read_keys` maps each
spelling to one field of PatchConfig and parses its value once (config/values.py):

| field                  | tiledmlp                 | other frameworks' keys                       |
|------------------------|--------------------------|----------------------------------------------|
| tiled_mlp              | tiled_mlp, use_tiled_mlp | ms-swift `use_tiled_mlp`; axolotl `tiled_mlp: true`; unsloth `tiled_mlp: "arctic" / "target:<GB>"` (turns tiling on with that policy) |
| tiles                  | num_tiles, tile_tokens, tile_budget_gb | ms-swift / axolotl `tiled_mlp_num_shards` |
| tiled_loss             | tiled_loss               | axolotl `chunked_cross_entropy`              |
| loss_tiles             | loss_num_tiles           | axolotl `chunked_cross_entropy_num_chunks`   |
| tiled_norms            | tiled_norms              |                                              |
| tiled_layers           | tiled_layers             |                                              |
| activation_offloading  | activation_offloading    | axolotl `activation_offloading`              |
| sequence_parallel_size | sequence_parallel_size   | ms-swift `sequence_parallel_size`; axolotl `sequence_parallel_degree`, `context_parallel_size` |
| generic, hidden_size   | generic, hidden_size     |                                              |

axolotl's `tiled_mlp_use_original_mlp` is accepted when true (tiledmlp always runs the model's
own MLP) and refused when false. Every key may also carry the prefix `tiledmlp_`
(`tiledmlp_tiled_loss`), so that a config file shared with a framework that reads the bare key
itself can address tiledmlp alone. A key with the value None counts as absent.

Invariant: nothing is dropped silently. Keys that start with `tiled`, `tiledmlp` or `tile_` but
are not known are refused with the closest known key; two keys for one field must agree.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tiledmlp.config.values import (
    is_bool_text,
    parse_bool,
    parse_budget_gb,
    parse_int,
    parse_tile_policy,
)
from tiledmlp.ops.policy import TilePolicy

__all__ = ["KEYS", "PREFIX", "KeyValue", "items_of", "read_keys"]

PREFIX = "tiledmlp_"
_OURS = ("tiled", "tile_")  # key prefixes claimed by tiledmlp: unknown ones are typos


def _tokens(value: Any, name: str) -> TilePolicy:
    return TilePolicy.of("auto", parse_int(value, name))


def _loss_tiles(value: Any, name: str) -> TilePolicy:
    return parse_tile_policy(value, name)


def _count(value: Any, name: str) -> int:
    return parse_int(value, name)


@dataclass(frozen=True)
class _Key:
    field: str
    parse: Callable[[Any, str], Any]
    framework: str = "tiledmlp"


# key -> the field it sets and its parser; "tiled_mlp" (a flag or a tile mode) is special-cased
KEYS: dict[str, _Key] = {
    "use_tiled_mlp": _Key("tiled_mlp", parse_bool, "ms-swift"),
    "tiled_mlp": _Key("tiled_mlp", parse_bool, "axolotl / unsloth"),
    "tiled_mlp_num_shards": _Key("tiles", parse_tile_policy, "ms-swift / axolotl"),
    "num_tiles": _Key("tiles", parse_tile_policy),
    "tile_tokens": _Key("tiles", _tokens),
    "tile_budget_gb": _Key("tiles", parse_budget_gb),
    "tiled_loss": _Key("tiled_loss", parse_bool),
    "chunked_cross_entropy": _Key("tiled_loss", parse_bool, "axolotl"),
    "loss_num_tiles": _Key("loss_tiles", _loss_tiles),
    "chunked_cross_entropy_num_chunks": _Key("loss_tiles", _loss_tiles, "axolotl"),
    "tiled_norms": _Key("tiled_norms", parse_bool),
    "tiled_layers": _Key("tiled_layers", parse_bool),
    "activation_offloading": _Key("activation_offloading", parse_bool),
    "sequence_parallel_size": _Key("sequence_parallel_size", _count),
    "sequence_parallel_degree": _Key("sequence_parallel_size", _count, "axolotl"),
    "context_parallel_size": _Key("sequence_parallel_size", _count, "axolotl"),
    "generic": _Key("generic", parse_bool),
    "hidden_size": _Key("hidden_size", _count),
    "tiled_mlp_use_original_mlp": _Key("", parse_bool, "axolotl"),
}


@dataclass(frozen=True)
class KeyValue:
    """A parsed value and the key it came from (for messages)."""

    value: Any
    key: str
    raw: Any


def items_of(source: Any) -> Iterator[tuple[str, Any]]:
    """(key, value) pairs of a mapping, a dataclass (training arguments), an argparse Namespace
    or any object with attributes."""
    if isinstance(source, Mapping):
        yield from ((str(k), v) for k, v in source.items())
    elif dataclasses.is_dataclass(source) and not isinstance(source, type):
        yield from ((f.name, getattr(source, f.name, None)) for f in dataclasses.fields(source))
    else:
        yield from vars(source).items()


def read_keys(
    source: Any, *, only: tuple[str, ...] | None = None, what: str = "key"
) -> dict[str, KeyValue]:
    """The PatchConfig fields that `source`'s keys set (see the module docstring).

    Args:
        source: a mapping, dataclass, Namespace or object; keys with dashes are read as with
            underscores.
        only: the fields the caller supports; a known key for another field is refused.
        what: what to call the keys in messages ("key", "option").

    Returns:
        field -> KeyValue; "tiles" holds a TilePolicy, flags a bool, sizes an int.

    Raises:
        ValueError: a bad value, an unknown key claimed by tiledmlp (with the closest known
            one), a key for a field outside `only`, or two keys for one field that disagree.
    """
    found: dict[str, KeyValue] = {}
    for raw_key, raw in items_of(source):
        if raw is None:
            continue
        key = raw_key.strip().lstrip("-").replace("-", "_")
        name = key.removeprefix(PREFIX) if key.removeprefix(PREFIX) in KEYS else key
        if name not in KEYS:
            if key.startswith(_OURS):
                raise ValueError(_unknown(raw_key, what, only))
            continue
        for field, value in _parse(name, raw):
            if only is not None and field not in only:
                raise ValueError(f"{what} {raw_key!r} is not supported here")
            _put(found, field, KeyValue(value, raw_key, raw))
    return found


def _parse(name: str, raw: Any) -> list[tuple[str, Any]]:
    """(field, value) pairs one key sets."""
    spec = KEYS[name]
    if name == "tiled_mlp" and not is_bool_text(raw):
        # unsloth's modes under tiled_mlp: tiling on, with that policy
        return [("tiled_mlp", True), ("tiles", parse_tile_policy(raw, name))]
    value = spec.parse(raw, name)
    if name == "tiled_mlp_use_original_mlp":
        if not value:
            raise ValueError(
                "tiled_mlp_use_original_mlp: false asks for a stand-in MLP; tiledmlp always "
                "tiles the model's own MLP (exact for every recognised or generic module): "
                "drop the key or set it to true"
            )
        return []
    return [(spec.field, value)]


def _put(found: dict[str, KeyValue], field: str, new: KeyValue) -> None:
    old = found.get(field)
    if old is None:
        found[field] = new
    elif old.value != new.value:
        raise ValueError(f"{old.key}={old.raw!r} and {new.key}={new.raw!r} disagree; give one")


def _unknown(key: str, what: str, only: tuple[str, ...] | None) -> str:
    known = [k for k, spec in KEYS.items() if only is None or spec.field in only or not spec.field]
    plain = key.strip().lstrip("-").replace("-", "_")
    close = difflib.get_close_matches(plain.removeprefix(PREFIX), known, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown {what} {key!r}{hint} (tiledmlp's keys: {', '.join(sorted(known))})"
