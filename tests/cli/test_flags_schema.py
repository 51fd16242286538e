"""Each command's flags are the schema's (config/schema.py): `train` and `check` have one flag
per key of TrainOptions and PatchConfig, with the schema's help, metavar and choices; `plan`,
`bench` and `swift-plugin` spell the tiling and sequence-parallel options only through the
schema's keys and parsers; the command line reference's train and plan tables are the
generated ones."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tiledmlp.cli import _build_parser
from tiledmlp.cli.flags import flag_help, flag_tables
from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.schema import keys_of, option_of
from tiledmlp.train.options import DEFAULT_PATCH, TrainOptions

# flags a command declares for itself: not options of a run
_OWN = {
    "train": {"--config", "--json", "--no-preflight"},
    "check": {"--config", "--json"},
    "swift-plugin": {"--out", "--check"},
}
_SKIP = {"-h", "--help", "-v", "--verbose"}


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = _build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        name: action
        for action in parser._actions
        for name in action.option_strings
        if name not in _SKIP
    }


def _schema(*types: type) -> dict[str, tuple[Any, Any, Any]]:
    """--flag -> (field, Option, Key) of every key of the configs."""
    return {key.flag: (f, spec, key) for t in types for f, spec, key in keys_of(t)}


def test_train_has_one_flag_per_key_of_the_schema_and_nothing_else() -> None:
    flags = _flags(_commands()["train"])
    schema = _schema(TrainOptions, PatchConfig)
    assert set(flags) - _OWN["train"] == set(schema), (
        f"flags without a key: {sorted(set(flags) - _OWN['train'] - set(schema))}; keys without "
        f"a flag: {sorted(set(schema) - set(flags))}"
    )
    for name, (field, spec, key) in schema.items():
        action = flags[name]
        patch = field in dataclasses.fields(PatchConfig)
        shown = flag_help(field, spec, key, DEFAULT_PATCH if patch else None)
        assert action.help == (argparse.SUPPRESS if shown is None else shown), name
        if not patch:  # the run's own options land on their field
            assert action.dest == field.name, name
        if key.choices:
            assert tuple(action.choices or ()) == key.choices, name
        if shown is not None and key.metavar and key.kind != "bool":
            assert action.metavar == key.metavar, name


def test_every_run_option_has_a_flag_with_help() -> None:
    # a TrainOptions field without a schema would be an option no command line can set
    for field in dataclasses.fields(TrainOptions):
        spec = option_of(field)
        assert field.name == "patch" or (spec is not None and spec.keys and spec.help), field.name


def test_check_takes_trains_flags_for_the_model_the_tiling_and_the_engines() -> None:
    flags = _flags(_commands()["check"])
    schema = _schema(TrainOptions, PatchConfig)
    assert set(flags) - _OWN["check"] <= set(schema), set(flags) - _OWN["check"] - set(schema)
    patch = {key.flag for _, _, key in keys_of(PatchConfig)}
    assert patch <= set(flags), patch - set(flags)


@pytest.mark.parametrize("command", ["plan", "bench", "swift-plugin"])
def test_tiling_and_sequence_parallel_flags_are_the_schemas_keys(command: str) -> None:
    flags = _flags(_commands()[command])
    schema = _schema(PatchConfig)
    spelled = {name: schema[name] for name in flags if name in schema}
    assert "--num-tiles" in spelled, command
    for name, (_, _, key) in spelled.items():
        action = flags[name]
        if command == "swift-plugin":  # kept as text, parsed by integrations/swift.py's read_keys
            assert action.type is None, name
            continue
        if name == "--attention-kernel":  # plan's: the kernel whose buffers are planned
            continue
        # parsed by the key's own parser, shown with its metavar
        assert getattr(action.type, "__name__", None) == key.name, (command, name)
        assert action.metavar == (key.metavar or None), (command, name)
    if command == "plan":
        assert {"--num-tiles", "--tile-budget-gb", "--sequence-parallel-size"} <= set(spelled)


def test_plans_flags_are_its_requests_schema() -> None:
    from tiledmlp.cli.plan_args import PlanArgs

    flags = _flags(_commands()["plan"])
    schema = _schema(PlanArgs)
    # one flag per field of PlanArgs
    assert set(flags) == set(schema), set(flags) ^ set(schema)
    for name, (field, spec, key) in schema.items():
        action = flags[name]
        assert action.dest == field.name and action.help == (spec.help or key.help), name
        if key.kind != "flag":
            assert getattr(action.type, "__name__", None) == key.name, name
            assert tuple(action.choices or ()) == key.choices, name
    # the tiling keys are PatchConfig's own (the same name, parser and metavar)
    patch = _schema(PatchConfig)
    for name in ("--num-tiles", "--tile-budget-gb", "--sequence-parallel-size"):
        assert schema[name][2] is patch[name][2], name


def test_plan_parses_the_tile_policy_once_and_settles_the_budget_into_it() -> None:
    from tiledmlp.cli.common import UsageError
    from tiledmlp.cli.plan_args import PlanArgs
    from tiledmlp.ops.tiling.policy import TilePolicy

    parser = _build_parser()
    args = parser.parse_args(["plan", "--tile-budget-gb", "2", "--sequence-parallel-size", "2"])
    request = PlanArgs.of(args)
    assert request.num_tiles == TilePolicy.budget(2.0)
    assert request.sequence_parallel_size == 2 and request.dtype == "float32"  # train's
    assert args.num_tiles == TilePolicy()  # the parsed arguments are left as they were
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.num_tiles = TilePolicy.of(4)  # type: ignore[misc]
    both = parser.parse_args(["plan", "--num-tiles", "4", "--tile-budget-gb", "2"])
    with pytest.raises(UsageError, match="disagree"):
        PlanArgs.of(both)
    with pytest.raises(SystemExit):  # argparse's one line, from the key's parser
        parser.parse_args(["plan", "--num-tiles", "many"])


@pytest.mark.parametrize("command", ["train", "plan"])
def test_the_references_flag_tables_are_generated_from_the_schema(command: str) -> None:
    reference = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md"
    text = reference.read_text()
    start = text.index(f"<!-- {command} flags: generated from the schema")
    start = text.index("\n", start) + 1
    table = text[start : text.index(f"<!-- end of {command} flags -->", start)]
    assert table == flag_tables(_commands()[command]), (
        f"docs/reference/cli.md's {command} tables differ from the schema: paste "
        f"tiledmlp.cli.flags.flag_tables(<the {command} parser>) between its markers"
    )
