"""The subcommands' flags, made from the schema (config/schema.py): one flag per key of a
field declared with `option(...)` (TrainOptions' and PatchConfig's), with that field's help,
default, metavar and choices.

Two ways a flag's value is taken: as text (`train` and `check`: every option defaults to "not
given" and train/options.py parses what was given, over a config file's keys), or parsed by the
key's own parser as argparse reads it (`plan`, `bench`: a bad value is argparse's one-line
error naming the flag).

Invariant: no subcommand writes the name, parser or help of a schema option by hand; a key of
ours without help, or of another framework, is accepted and left out of --help.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.schema import Key, Option, default_text, keys_of, option_of

__all__ = [
    "RUN_GROUPS",
    "add_config_flags",
    "add_field_flags",
    "add_run_flags",
    "add_typed_flag",
    "flag_help",
    "schema_key",
]

# TrainOptions' and PatchConfig's sections -> the title of their group in `train --help`
RUN_GROUPS = {
    "model": "model",
    "data": "data",
    "tiling": "tiling",
    "long context": "long context",
    "distributed": "distributed (under torchrun)",
    "training": "training",
    "output": "output",
    "pre-flight": "pre-flight (memory)",
}


def schema_key(config_type: type, name: str) -> tuple[dataclasses.Field[Any], Option, Key]:
    """The field, Option and Key of the key `name` of a schema-declared config."""
    for found in keys_of(config_type):
        if found[2].name == name:
            return found
    raise KeyError(f"{config_type.__name__} declares no key {name!r}")


def flag_help(
    field: dataclasses.Field[Any], spec: Option, key: Key, defaults: Any = None
) -> str | None:
    """What --help says of `key`'s flag, None when it is left out (another framework's
    spelling, an alias, a key the commands name themselves): the key's help, or the field's
    for its first key, ending with the default (`defaults`' value for a PatchConfig switch,
    the field's default for the run's options)."""
    text = key.help or (spec.help if key is spec.keys[0] else "")
    if not (key.ours and key.listed and text):
        return None
    if "(default" not in text:
        if defaults is not None and key.kind == "bool":
            text += f" (default: {str(getattr(defaults, field.name)).lower()})"
        elif defaults is None:
            text += default_text(field, spec)
    return text.replace("%", "%%")  # argparse formats help with %


def _add_text_flag(adder: Any, key: Key, help: str | None, dest: str | None = None) -> None:
    """A flag whose value is kept as text (train/options.py parses it); a switch alone is
    true."""
    extra: dict[str, Any] = {} if dest is None else {"dest": dest}
    text = argparse.SUPPRESS if help is None else help
    if key.kind == "bool":
        adder.add_argument(key.flag, nargs="?", const="true", metavar="true|false", help=text,
                           **extra)  # fmt: skip
    elif key.choices:
        adder.add_argument(key.flag, choices=key.choices, metavar=key.metavar or "N", help=text,
                           **extra)  # fmt: skip
    else:
        adder.add_argument(key.flag, metavar=key.metavar or "N", help=text, **extra)


def add_run_flags(
    where: Mapping[str, Any],
    hidden: Any,
    *,
    patch_defaults: Any = None,
    skip: tuple[str, ...] = (),
    after: Mapping[str, Callable[[Any], None]] | None = None,
) -> None:
    """The flags of a run's options (TrainOptions, with PatchConfig's keys where its `patch`
    field is), each in the group `where` maps its section to; fields of a section `where`
    leaves out, and those named in `skip`, get no flag. Aliases and other frameworks' keys go
    to `hidden`, not listed in --help. `after` adds a command's own flags to a field's group
    right after that field's (`--no-preflight`)."""
    from tiledmlp.train.options import TrainOptions

    for field in dataclasses.fields(TrainOptions):
        if field.name in skip:
            continue
        if field.name == "patch":
            for f, feature, key in keys_of(PatchConfig):
                text = flag_help(f, feature, key, patch_defaults)
                adder = where.get(feature.group) if text is not None else hidden
                if adder is not None:
                    _add_text_flag(adder, key, text)
            continue
        spec = option_of(field)
        if spec is not None and spec.group in where:
            add_field_flags(where[spec.group], hidden, field.name)
            if after is not None and field.name in after:
                after[field.name](where[spec.group])


def add_field_flags(group: Any, hidden: Any, name: str, help: str | None = None) -> None:
    """The flags of one TrainOptions field: its first key in `group` (with `help` in place of
    the schema's where given), its other keys hidden (values kept as text)."""
    from tiledmlp.train.options import TrainOptions

    field = next(f for f in dataclasses.fields(TrainOptions) if f.name == name)
    spec = option_of(field)
    assert spec is not None, name  # a field without a schema has no flag
    for key in spec.keys:
        text = flag_help(field, spec, key)
        if key is spec.keys[0]:
            _add_text_flag(group, key, text if help is None else help, dest=field.name)
        else:
            _add_text_flag(hidden, key, None, dest=field.name)


def add_typed_flag(
    group: Any,
    config_type: type,
    name: str,
    *,
    default: Any = None,
    help: str | None = None,
) -> None:
    """The flag of the key `name` of a schema-declared config, its value parsed by the key's
    parser as argparse reads it (a bad value: argparse's one-line error); `help` replaces the
    schema's help where the command means something else by it (bench's own default)."""
    _, spec, key = schema_key(config_type, name)
    _add_typed(group, key, help if help is not None else (key.help or spec.help), default)


def add_config_flags(
    where: Mapping[str, Any],
    config_type: type,
    *,
    after: Mapping[str, Callable[[Any], None]] | None = None,
) -> None:
    """A flag per field of a schema-declared command request (`plan`'s PlanArgs), parsed as
    argparse reads it: the field's first key, in the group `where` maps its section to, with
    the field's help (else the key's: a key shared with PatchConfig keeps its words) and
    default. `after` adds a flag declared elsewhere right after a field's."""
    for field in dataclasses.fields(config_type):
        spec = option_of(field)
        if spec is None:
            continue
        default = (
            field.default_factory()  # type: ignore[misc,operator]
            if field.default is dataclasses.MISSING
            else field.default
        )
        _add_typed(where[spec.group], spec.keys[0], spec.help or spec.keys[0].help, default)
        if after is not None and field.name in after:
            after[field.name](where[spec.group])


def _add_typed(group: Any, key: Key, text: str, default: Any) -> None:
    """A flag parsed by its key's parser; a key of kind "flag" is a switch without a value."""
    if key.kind == "flag":
        group.add_argument(key.flag, action="store_true", help=text.replace("%", "%%"))
        return
    if key.kind == "bool":  # a switch alone is true, as train's flags read it
        group.add_argument(key.flag, type=_parser(key), default=default, nargs="?",
                           const=True, metavar=key.metavar or None,
                           help=text.replace("%", "%%"))  # fmt: skip
        return
    group.add_argument(
        key.flag,
        type=_parser(key),
        default=default,
        choices=key.choices or None,
        metavar=key.metavar or None,
        help=text.replace("%", "%%"),
    )


def _parser(key: Key) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return key.parse(text, key.flag)
        except ValueError as e:  # argparse names the flag itself: "argument --num-tiles: ..."
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{key.flag} ")) from None

    parse.__name__ = key.name  # argparse names the type in some messages
    return parse


def flag_tables(parser: argparse.ArgumentParser) -> str:
    """The command line reference's tables of a subcommand's flags, one per group of its
    --help ("options" is "general"), each listed flag with its metavar and help: what
    docs/reference/cli.md holds for the commands whose flags come from the schema."""
    out: list[str] = []
    for group in parser._action_groups:
        rows = [
            f"| `{_spelled(action)}` | {action.help.replace('%%', '%')} |"
            for action in group._group_actions
            if action.help not in (None, argparse.SUPPRESS)
            and action.option_strings
            and action.option_strings[0] not in ("-h", "-v")
        ]
        if rows:
            title = "general" if group.title == "options" else group.title
            out += [f"**{title}**", "", "| flag | meaning |", "|---|---|", *rows, ""]
    return "\n".join(out)


def _spelled(action: argparse.Action) -> str:
    """`--flag METAVAR` as the reference writes it (| escaped for the table)."""
    name = action.option_strings[-1]
    if action.nargs == 0:
        return name
    metavar = action.metavar if isinstance(action.metavar, str) else None
    if metavar is None and action.choices:  # the choices, as --help shows them
        metavar = "|".join(str(c) for c in action.choices)
    return (f"{name} {metavar}" if metavar else name).replace("|", "\\|")
