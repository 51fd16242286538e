"""The schema of an option: its keys (ours and other frameworks'), their parsers and help.

Each field of a run's configuration is declared with `option(...)`, which keeps its `Option` in
the field's metadata: the help text, its default as the help says it, the section of the help
it is listed in, the keys that set it and, per key, the parser that turns a spelled value
(text, a number, a bool) into the field's typed value, the framework that spells it so, and
the help, metavar and choices a command line shows. The configurations declared so are
PatchConfig (config/patch.py: tiling, loss, norms, layers, offloading, sequence parallelism),
TrainOptions (train/run_options.py: the model, the data, the training, the engines, the
output, with a PatchConfig nested) and `plan`'s request (cli/plan_args.py, whose tiling and
sequence-parallel fields reuse PatchConfig's keys). Everything else that names an option is derived from these fields: the key table
(config/keys.py), the flags of `tiledmlp train`, `check`, `plan`, `bench` and `swift-plugin`
(cli/flags.py), the axolotl and ms-swift plugins' arguments and the documentation's tables.

Invariant: adding an option is one `option(...)` field here plus the feature that applies it;
no other table lists options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["OURS", "Key", "Option", "default_text", "flag", "keys_of", "option", "option_of"]

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
        choices: the values a command line offers (its "did you mean" comes from them); ()
            for any value the parser takes.
        listed: False for one of ours that a command lists only where it names the key itself
            (`--tile-budget-gb` is `plan`'s, and only another spelling of --num-tiles in
            `train`).
    """

    name: str
    parse: Callable[[Any, str], Any]
    framework: str = OURS
    help: str = ""
    metavar: str = ""
    kind: str = "bool"
    sets: bool = True
    keyword: bool = False
    choices: tuple[str, ...] = ()
    listed: bool = True

    @property
    def ours(self) -> bool:
        return self.framework == OURS

    @property
    def flag(self) -> str:
        """The command-line flag of this key (`--num-tiles`)."""
        return flag(self.name)


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
        default_text: what the help says the default is where the value alone does not say
            it ("never", "the Python stdlib source"); "" to say nothing; None: the value.
    """

    help: str
    keys: tuple[Key, ...] = ()
    group: str = "tiling"
    feature: bool = False
    same_losses: bool = False
    default_text: str | None = None


def option(
    *,
    help: str,
    keys: tuple[Key, ...] = (),
    group: str = "tiling",
    feature: bool = False,
    same_losses: bool = False,
    default_text: str | None = None,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that carries its Option (the one place the option is described)."""
    meta = {
        "option": Option(
            help=help,
            keys=keys,
            group=group,
            feature=feature,
            same_losses=same_losses,
            default_text=default_text,
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


def flag(name: str) -> str:
    """The command-line flag of a key or field name (`num_tiles` -> `--num-tiles`)."""
    return "--" + name.replace("_", "-")


def default_text(field: dataclasses.Field[Any], spec: Option) -> str:
    """' (default: X)' as a command's help ends an option's line: the Option's default_text,
    else the field's default value (booleans in lower case); '' when there is nothing to
    say (no default_text and a default of None)."""
    if spec.default_text is not None:
        return f" (default: {spec.default_text})" if spec.default_text else ""
    value = field.default
    if value is dataclasses.MISSING or value is None:
        return ""
    return f" (default: {str(value).lower() if isinstance(value, bool) else value})"
