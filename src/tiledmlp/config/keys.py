"""Option keys of every source, ours and other frameworks', read once into typed values.

A recipe written for ms-swift, axolotl or unsloth, a `tiledmlp train` config file, an argparse
Namespace or a training-arguments object all name the same features; `read_keys` maps each
spelling to one field of PatchConfig and parses its value once, with the parser the field's
schema gives it (config/patch.py; the table is `KEYS`, rendered by `key_table()` into
docs/guides/integrations.md). unsloth's modes under `tiled_mlp` ("arctic", "target:<GB>")
turn tiling on with that policy; axolotl's `tiled_mlp_use_original_mlp` is accepted when true
(tiledmlp always runs the model's own MLP) and refused when false. Every key may also carry
the prefix `tiledmlp_` (`tiledmlp_tiled_loss`), so that a config file shared with a framework
that reads the bare key itself can address tiledmlp alone. A key with the value None counts as
absent.

Invariant: nothing is dropped silently. Keys that start with `tiled`, `tiledmlp` or `tile_` but
are not known are refused with the closest known key; two keys for one field must agree.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.schema import Key, option_of
from tiledmlp.ops.tiling.policy import TilePolicy

__all__ = [
    "KEYS",
    "PREFIX",
    "KeyValue",
    "SchemaKey",
    "items_of",
    "key_table",
    "option_table",
    "read_keys",
    "spelled_keys",
]

PREFIX = "tiledmlp_"
_OURS = ("tiled", "tile_")  # key prefixes claimed by tiledmlp: unknown ones are typos


@dataclass(frozen=True)
class SchemaKey:
    """A key of the schema and the PatchConfig field it sets ("" when it sets none)."""

    field: str
    parse: Callable[[Any, str], Any]
    framework: str
    key: Key


def _schema_keys() -> list[SchemaKey]:
    """Every key of every PatchConfig field, in field order (the same key may appear once per
    framework that spells it)."""
    return [
        SchemaKey(f.name if key.sets else "", key.parse, key.framework, key)
        for f in dataclasses.fields(PatchConfig)
        if (spec := option_of(f)) is not None
        for key in spec.keys
    ]


SCHEMA_KEYS: tuple[SchemaKey, ...] = tuple(_schema_keys())
# key -> the field it sets and its parser (tiledmlp's own spelling first)
KEYS: dict[str, SchemaKey] = {}
for _k in SCHEMA_KEYS:
    KEYS.setdefault(_k.key.name, _k)


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
    value = spec.parse(raw, name)
    if not spec.field:
        return []  # a key that is checked and sets nothing
    if isinstance(value, TilePolicy) and spec.field not in _POLICY_FIELDS:
        return [(spec.field, True), ("tiles", value)]  # a switch spelled as its policy (unsloth)
    return [(spec.field, value)]


_POLICY_FIELDS = ("tiles", "loss_tiles")


def _put(found: dict[str, KeyValue], field: str, new: KeyValue) -> None:
    old = found.get(field)
    if old is None or (old.value == TilePolicy() and isinstance(new.value, TilePolicy)):
        found[field] = new  # "auto" (num_tiles' default) yields to tile_tokens or a budget
    elif new.value == TilePolicy() and isinstance(old.value, TilePolicy):
        return
    elif old.value != new.value:
        raise ValueError(f"{old.key}={old.raw!r} and {new.key}={new.raw!r} disagree; give one")


def _unknown(key: str, what: str, only: tuple[str, ...] | None) -> str:
    known = [k for k, spec in KEYS.items() if only is None or spec.field in only or not spec.field]
    plain = key.strip().lstrip("-").replace("-", "_")
    close = difflib.get_close_matches(plain.removeprefix(PREFIX), known, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown {what} {key!r}{hint} (tiledmlp's keys: {', '.join(sorted(known))})"


def key_table() -> str:
    """The docs' table of every option's keys, ours and other frameworks', from the schema."""
    rows = ["| option | tiledmlp | other frameworks' keys |", "|---|---|---|"]
    for f in dataclasses.fields(PatchConfig):
        spec = option_of(f)
        if spec is None or not spec.keys:
            continue
        ours = ", ".join(f"`{k.name}`" for k in spec.keys if k.ours)
        theirs = "; ".join(f"{k.framework} `{k.name}`" for k in spec.keys if not k.ours)
        rows.append(f"| `{f.name}` | {ours} | {theirs} |")
    return "\n".join(rows) + "\n"


def option_table() -> str:
    """The docs' table of PatchConfig's fields (type, default, help), from the schema."""
    rows = ["| field | type | default | what it does |", "|---|---|---|---|"]
    for f in dataclasses.fields(PatchConfig):
        spec = option_of(f)
        if spec is None:
            continue
        default = getattr(PatchConfig(), f.name)
        kind = str(f.type).replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{kind}` | `{default}` | {spec.help} |")
    return "\n".join(rows) + "\n"


def spelled_keys(config: PatchConfig) -> dict[str, Any]:
    """`config` as our main keys spell it (JSON values: a tile policy as its num_tiles or
    tile_tokens, the attention kernel as its name): what read_keys reads back into the same
    PatchConfig. A process group (Python only) has no spelling and is left out.

    Raises:
        ValueError: a loss tile policy of tokens per tile (only the Python API sets one; no
            key spells it).
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(PatchConfig):
        spec = option_of(f)
        value = getattr(config, f.name)
        ours = [k for k in spec.keys if k.ours and k.sets] if spec is not None else []
        if not ours or value is None:
            continue
        if isinstance(value, TilePolicy):
            if value.rule == "tokens" and f.name == "tiles":
                out["tile_tokens"] = value.tile_tokens
            elif value.rule == "tokens":
                raise ValueError(
                    f"{f.name}={value} has no key (the loss's tiles are a count or 'auto')"
                )
            else:
                out[ours[0].name] = value.num_tiles
        elif isinstance(value, bool | int | str):
            out[ours[0].name] = value
        else:
            out[ours[0].name] = str(value)  # a typed value as it is spelled (the kernel)
    return out
