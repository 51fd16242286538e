"""The options of a training run (TrainOptions, train/run_options.py), read from keyword
arguments, a config file and the command line, and spelled back as a checkpoint records them.

One name per option, the Hugging Face TrainingArguments name where one exists (max_steps,
learning_rate, per_device_train_batch_size, ...). `options_from` accepts the same keys from any
source, with dashes or underscores, today's short names (steps, lr, batch_size,
deepspeed_config) and every key of tiledmlp's features, ours and other frameworks' (ms-swift's
use_tiled_mlp / tiled_mlp_num_shards, axolotl's tiled_mlp: true, unsloth's tiled_mlp: "arctic"
| "target:<GB>", ...), declared once on PatchConfig's fields and read by
tiledmlp.config.read_keys into the run's nested PatchConfig (`TrainOptions.patch`). A config
file is YAML (.yaml/.yml) or JSON holding those keys; command-line flags override it.

Invariant: every value is parsed here, once, by the parsers of tiledmlp.config, with a message
naming the option, what was expected and how to fix it; nothing later re-interprets an option.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiledmlp.config.keys import KEYS, PREFIX, read_keys, spelled_keys
from tiledmlp.config.patch import FEATURES, PatchConfig
from tiledmlp.config.schema import Key, flag, keys_of
from tiledmlp.config.values import DTYPES
from tiledmlp.train.run_options import DEFAULT_PATCH, ENGINES, SCHEDULES, TrainOptions

__all__ = [
    "ALIASES",
    "DEFAULT_PATCH",
    "DTYPES",
    "ENGINES",
    "SCHEDULES",
    "TRAIN_KEYS",
    "TrainOptions",
    "canonical_key",
    "field_of",
    "known_keys",
    "options_from",
    "read_config_file",
    "spelled",
]


def read_config_file(path: Path) -> dict[str, Any]:
    """The keys of a YAML (.yaml/.yml) or JSON config file, as a dict.

    Raises:
        ValueError: missing file, bad syntax, or not a mapping at the top level.
    """
    if not path.is_file():
        raise ValueError(f"--config: {path} is not a file; expected a .yaml, .yml or .json file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(text)
        else:
            values = json.loads(text)
    except Exception as e:  # yaml.YAMLError, json.JSONDecodeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--config: {path} could not be parsed ({first})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(
            f"--config: {path} must hold a mapping of option names to values, got "
            f"{type(values).__name__}"
        )
    return values


@dataclass(frozen=True)
class _TrainKey:
    """One spelling of a TrainOptions field (from its schema)."""

    field: dataclasses.Field[Any]
    key: Key


def _train_keys() -> dict[str, _TrainKey]:
    """key -> the TrainOptions field it sets, for every key of the schema (the patch's keys
    are PatchConfig's)."""
    return {key.name: _TrainKey(f, key) for f, _, key in keys_of(TrainOptions)}


TRAIN_KEYS = _train_keys()
# another spelling -> the field's name (steps -> max_steps, lr -> learning_rate, ...)
ALIASES = {name: k.field.name for name, k in TRAIN_KEYS.items() if name != k.field.name}


def known_keys() -> set[str]:
    """Every canonical option name, and every key of the feature options, ours and other
    frameworks' (also with the prefix tiledmlp_)."""
    features = {*KEYS, *(PREFIX + k for k in KEYS)}
    return {k.field.name for k in TRAIN_KEYS.values()} | features


def canonical_key(raw: str) -> str:
    """An option's canonical name from any spelling (dashes, leading --, aliases); other
    frameworks' keys are kept as they are (read_keys maps them)."""
    key = str(raw).strip().lstrip("-").replace("-", "_")
    return ALIASES.get(key, key)


def options_from(values: Mapping[str, Any], source: str = "option") -> TrainOptions:
    """TrainOptions from keys of any spelling (see the module docstring).

    Args:
        values: option -> value; values may be text (as on a command line) or typed.
        source: what to call the keys in errors ("option", "--config FILE: key").

    Raises:
        ValueError: an unknown key (with the known ones listed), a bad value, or two spellings
            of one option with different values.
    """
    canonical: dict[str, Any] = {}
    features: dict[str, Any] = {}
    for raw, value in values.items():
        key = canonical_key(raw)
        if key.removeprefix(PREFIX) in KEYS:
            if key in features and features[key] != value:
                raise ValueError(f"{source} {key} given twice with different values")
            features[key] = value
            continue
        if key not in TRAIN_KEYS:
            known = sorted({*TRAIN_KEYS, *KEYS})
            raise ValueError(f"unknown {source} {raw!r}; known: {', '.join(known)}")
        converted = _parsed(TRAIN_KEYS[key], value)
        if key in canonical and canonical[key] != converted:
            raise ValueError(f"{source} {key} given twice with different values")
        canonical[key] = converted
    canonical["patch"] = train_patch(
        {field: kv.value for field, kv in read_keys(features, what=source).items()}
    )
    return TrainOptions(**canonical)


def _parsed(spelled: _TrainKey, value: Any) -> Any:
    """A field's value from a spelled one, by the key's parser (None: unset, where the
    field's default is None)."""
    name = flag(spelled.field.name)
    if value is None:
        if spelled.field.default is None:
            return None
        raise ValueError(f"{name} needs a value")
    return spelled.key.parse(value, name)


def spelled(opts: TrainOptions) -> dict[str, Any]:
    """Every option of `opts` by its main key, with JSON values (paths as text, the patch as
    its own keys, or switched off): what options_from reads back into equal options (what a
    checkpoint records of its run)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(TrainOptions):
        value = getattr(opts, f.name)
        if f.name == "patch":
            off = {"use_tiled_mlp": False, "tiled_loss": False}  # train_patch's "nothing"
            out.update(off if value is None else spelled_keys(value))
        else:
            out[f.name] = str(value) if isinstance(value, Path) else value
    return out


def field_of(key: str) -> str:
    """The field (TrainOptions' or PatchConfig's) a key of any spelling sets (the key itself
    for one that sets none)."""
    name = canonical_key(key)
    feature = KEYS.get(name.removeprefix(PREFIX))
    return (feature.field or name) if feature is not None else name


def train_patch(values: Mapping[str, Any]) -> PatchConfig | None:
    """The run's PatchConfig from the PatchConfig fields its keys set (read_keys), over the
    run's defaults (DEFAULT_PATCH: the tiled loss goes with the tiled MLPs unless a key says
    otherwise); None when nothing is turned on."""
    chosen = dict(values)
    if chosen.setdefault("tiled_mlp", DEFAULT_PATCH.tiled_mlp):
        chosen = {**_defaults_of(DEFAULT_PATCH), **chosen}
    on = any(chosen.get(f) for f in FEATURES) or (chosen.get("sequence_parallel_size") or 1) > 1
    return PatchConfig(**chosen) if on else None


def _defaults_of(config: PatchConfig) -> dict[str, Any]:
    """The fields where `config` differs from PatchConfig's defaults."""
    base = PatchConfig()
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(PatchConfig)
        if getattr(config, f.name) != getattr(base, f.name)
    }
