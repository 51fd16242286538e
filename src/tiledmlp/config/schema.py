"""The schema of an option: its keys (ours and other frameworks'), their parsers and help.

Each PatchConfig field (config/patch.py) is declared with `option(...)`, which keeps its
`Option` in the field's metadata: the help text, the keys that set it and, per key, the parser
that turns a spelled value (text, a number, a bool) into the field's typed value, the framework
that spells it so, and the help and metavar a command line shows. Everything else that names an
option is derived from these fields: the key table (config/keys.py), the options of `tiledmlp
train` and their flags, the axolotl plugin's arguments and the documentation's key table.

Invariant: adding an option is one `option(...)` field here plus the feature that applies it;
no other table lists options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["OURS", "Key", "Option", "keys_of", "option", "option_of"]

OURS = "tiledmlp"


@dataclass(frozen=True)
class Key:
    """One spelling of an option.

    Attributes:
        name: the key as written in a config file or keyword (underscores); a command-line flag
            is `--` + the name with dashes.
        parse: (value, key name) -> the field's typed value; raises ValueError naming the key.
        framework: who spells it so: tiledmlp, or another framework's name ("ms-swift",
            "axolotl", "unsloth", ...), for documentation and hidden flags.
        help: what a command line shows for it ("" for other frameworks' spellings: accepted,
            not listed in --help).
        metavar: the value's placeholder in --help; "" for a flag (true or false).
        kind: the value's Python type as a plugin's schema declares it ("bool", "int",
            "float | str", "int | str", "bool | str", "str").
        sets: False for a key that is checked but sets nothing (axolotl's
            `tiled_mlp_use_original_mlp: true`).
        keyword: True for a key that patch_model takes as a keyword argument in place of
            the field's own name (num_tiles and tile_tokens for `tiles`).
    """

    name: str
    parse: Callable[[Any, str], Any]
    framework: str = OURS
    help: str = ""
    metavar: str = ""
    kind: str = "bool"
    sets: bool = True
    keyword: bool = False

    @property
    def ours(self) -> bool:
        return self.framework == OURS


@dataclass(frozen=True)
class Option:
    """What a PatchConfig field's metadata holds (see `option`).

    Attributes:
        help: one line on what the option does (the docs' and the API's wording).
        keys: its spellings; the first of ours is the main one.
        group: where `tiledmlp train --help` lists it ("tiling", "long context",
            "distributed").
        feature: True for a switch that turns a feature on by itself (a PatchConfig must turn
            one on, or sequence parallelism).
        same_losses: True when the option changes memory and speed but not the losses (a
            resumed run may change it; see SAME_LOSSES in config/patch.py).
    """

    help: str
    keys: tuple[Key, ...] = ()
    group: str = "tiling"
    feature: bool = False
    same_losses: bool = False


def option(
    *,
    help: str,
    keys: tuple[Key, ...] = (),
    group: str = "tiling",
    feature: bool = False,
    same_losses: bool = False,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that carries its Option (the one place the option is described)."""
    meta = {
        "option": Option(
            help=help, keys=keys, group=group, feature=feature, same_losses=same_losses
        )
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def option_of(field: dataclasses.Field[Any]) -> Option | None:
    """The Option of a dataclass field, or None when the field has none."""
    found = field.metadata.get("option")
    return found if isinstance(found, Option) else None


def keys_of(config_type: type) -> Iterator[tuple[dataclasses.Field[Any], Option, Key]]:
    """(field, its Option, one of its keys) for every key of a config dataclass's options,
    each key name once, in field order: what the CLI's flags and plugins' keys are made from."""
    seen: set[str] = set()
    for field in dataclasses.fields(config_type):
        spec = option_of(field)
        if spec is None:
            continue
        for key in spec.keys:
            if key.name not in seen:
                seen.add(key.name)
                yield field, spec, key
