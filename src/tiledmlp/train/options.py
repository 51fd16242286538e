"""The options of a training run, from keyword arguments, a config file and the command line.

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
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiledmlp.config.keys import KEYS, PREFIX, read_keys
from tiledmlp.config.patch import FEATURES, PatchConfig
from tiledmlp.config.schema import option_of
from tiledmlp.config.values import DTYPES, parse_bool, parse_dtype
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.ops.tiling.values import check_int, check_positive_number
from tiledmlp.sequence_parallel.sizes import check_sequence_divisible
from tiledmlp.train.data import check_data
from tiledmlp.train.defaults import DEFAULT_PATCH
from tiledmlp.train.model_source import model_name_error

__all__ = [
    "ALIASES",
    "DEFAULT_PATCH",
    "DTYPES",
    "TrainOptions",
    "canonical_key",
    "known_keys",
    "options_from",
    "read_config_file",
]

# alias -> canonical name
ALIASES = {
    "steps": "max_steps",
    "lr": "learning_rate",
    "batch_size": "per_device_train_batch_size",
    "deepspeed_config": "deepspeed",
}
ENGINES = ("auto", "single", "ddp", "fsdp2", "deepspeed")
SCHEDULES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "warmup_stable_decay",
)


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """A training run (see `tiledmlp train --help` for each field).

    learning_rate None: the documented default for the model (models/presets.py).
    data_field None: the records' "text" field, else their "messages" (chat turns through the
    tokenizer's chat template) (train/data.py).
    resume_from_checkpoint: a checkpoint directory, or "latest" (the newest checkpoint-N in
    output_dir).
    patch: what patch_model applies to the model (None: nothing), parsed once from the
    feature keys (options_from); default: the tiled MLPs and the tiled loss.
    preflight: plan the run's memory before loading anything and refuse one that cannot fit
    (cli/preflight.py); memory_gb: the memory it is checked against, in GiB (None: the GPU's
    free memory, or the available RAM on the CPU).
    """

    model: str = "tiny"
    data: Path | None = None
    data_field: str | None = None
    seq_len: int = 2048
    per_device_train_batch_size: int = 1
    max_steps: int = 12
    learning_rate: float | None = None
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    logging_steps: int = 1
    report_to: str = "none"
    eval_steps: int | None = None
    eval_sequences: int = 4
    save_steps: int | None = None
    save_total_limit: int | None = None
    output_dir: Path | None = None
    resume_from_checkpoint: str | None = None
    gradient_checkpointing: bool = False
    patch: PatchConfig | None = DEFAULT_PATCH
    dtype: str = "float32"
    engine: str = "auto"
    deepspeed: Path | None = None
    fsdp: str | None = None
    fsdp_config: Path | None = None
    seed: int = 0
    max_data_bytes: int = 4_000_000
    ddp_timeout: int = 1800
    preflight: bool = True
    memory_gb: float | None = None

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_choices()
        self._check_switches()
        self._check_engine()
        self._check_paths()

    def _check_numbers(self) -> None:
        """The patch configuration, the counts and the rates."""
        if self.patch is not None and not isinstance(self.patch, PatchConfig):
            raise TypeError(
                f"TrainOptions.patch must be a PatchConfig or None, got {self.patch!r}; build "
                "the options with options_from"
            )
        check_sequence_divisible(
            self.seq_len,
            self.sequence_parallel_size,
            seq_name="--seq-len",
            size_name="--sequence-parallel-size",
        )
        for name in ("seq_len", "per_device_train_batch_size", "max_steps", "logging_steps"):
            _check_positive(name, getattr(self, name))
        if self.memory_gb is not None:
            check_positive_number("--memory-gb", self.memory_gb)
        for name in (
            "gradient_accumulation_steps",
            "eval_sequences",
            "max_data_bytes",
            "ddp_timeout",
        ):
            _check_positive(name, getattr(self, name))
        for name in ("eval_steps", "save_steps", "save_total_limit"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        check_int("--warmup-steps", self.warmup_steps, minimum=0)
        if self.learning_rate is not None:
            check_positive_number("--learning-rate", self.learning_rate)
        if not self.max_grad_norm >= 0:
            raise ValueError(
                f"--max-grad-norm must be >= 0 (0: no clipping), got {self.max_grad_norm}"
            )

    def _check_choices(self) -> None:
        """Options that name one of a set."""
        if self.dtype not in set(DTYPES.values()):
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.lr_scheduler_type not in SCHEDULES:
            raise ValueError(
                f"--lr-scheduler-type must be one of {', '.join(SCHEDULES)}, got "
                f"{self.lr_scheduler_type!r}"
            )

    def _check_switches(self) -> None:
        """Switches that need another one."""
        offloading = self.patch is not None and self.patch.activation_offloading
        if offloading and not self.gradient_checkpointing:
            raise ValueError(
                "--activation-offloading moves the inputs of checkpointed layers: add "
                "--gradient-checkpointing"
            )

    def _check_engine(self) -> None:
        """The engine and its configuration files."""
        if self.engine == "deepspeed" and self.deepspeed is None:
            raise ValueError("--engine deepspeed needs --deepspeed CONFIG (a DeepSpeed JSON file)")
        if self.deepspeed is not None and not Path(self.deepspeed).is_file():
            raise ValueError(
                f"--deepspeed: {self.deepspeed} is not a file (a DeepSpeed JSON config)"
            )
        if self.deepspeed is not None and self.engine not in ("auto", "deepspeed"):
            raise ValueError(f"--deepspeed runs the DeepSpeed engine; drop --engine {self.engine}")
        if self.fsdp is not None and self.engine not in ("auto", "fsdp2"):
            raise ValueError(f"--fsdp runs FSDP2; drop --engine {self.engine}")
        if self.fsdp_config is not None and not Path(self.fsdp_config).is_file():
            raise ValueError(f"--fsdp-config: {self.fsdp_config} is not a file (a JSON object)")
        if self.fsdp_config is not None and self.fsdp is None and self.engine != "fsdp2":
            raise ValueError("--fsdp-config configures FSDP2: add --fsdp full_shard")
        if self.fsdp is not None and self.deepspeed is not None:
            raise ValueError("give --fsdp or --deepspeed, not both")

    def _check_paths(self) -> None:
        """The files and directories the run reads or writes."""
        if self.save_steps is not None and self.output_dir is None:
            raise ValueError("--save-steps writes OUTPUT_DIR/checkpoint-N: add --output-dir")
        if self.output_dir is not None and Path(self.output_dir).is_file():
            raise ValueError(
                f"--output-dir: {self.output_dir} is a file; expected a directory (created when "
                "missing)"
            )
        if (
            self.resume_from_checkpoint is not None
            and self.resume_from_checkpoint != "latest"
            and not Path(self.resume_from_checkpoint).is_dir()
        ):
            raise ValueError(
                f"--resume-from-checkpoint: {self.resume_from_checkpoint} is not a directory; give "
                "OUTPUT_DIR/checkpoint-N or 'latest'"
            )
        if self.resume_from_checkpoint == "latest" and self.output_dir is None:
            raise ValueError("--resume-from-checkpoint latest looks in --output-dir: add it")
        if self.data is not None:
            check_data(Path(self.data))  # known format, readable with what is installed
        model_error = model_name_error(self.model)  # a preset (did-you-mean), folder or Hub id
        if model_error is not None:
            raise ValueError(model_error)

    def patch_config(self) -> PatchConfig | None:
        """What patch_model applies for this run (None: nothing)."""
        return self.patch

    @property
    def sequence_parallel_size(self) -> int:
        """P of Ulysses sequence parallelism (1: none)."""
        return (self.patch.sequence_parallel_size or 1) if self.patch is not None else 1

    def feature_summary(self) -> dict[str, Any]:
        """Each feature option of the run under its key (the summary's and --json's names:
        use_tiled_mlp, num_tiles, tile_tokens, tiled_loss, ...), from the schema; the tile
        policies as tiled_mlp's keywords, None when the MLPs are not tiled."""
        patch = self.patch
        summary: dict[str, Any] = {}
        for f in dataclasses.fields(PatchConfig):
            spec = option_of(f)
            if spec is None or not spec.keys:
                continue
            if "TilePolicy" in str(f.type):  # as tiled_mlp's num_tiles and tile_tokens
                used = patch is not None and (patch.tiled_mlp or f.name != "tiles")
                policy: TilePolicy | None = getattr(patch, f.name) if used else None
                prefix = "" if f.name == "tiles" else "loss_"
                summary[prefix + "num_tiles"] = None if policy is None else policy.num_tiles
                summary[prefix + "tile_tokens"] = None if policy is None else policy.tile_tokens
                continue
            if patch is not None:
                value = getattr(patch, f.name)
            else:
                value = False if f.name in FEATURES else f.default
            if f.name == "sequence_parallel_size":
                value = value or 1
            if not isinstance(value, bool | int | float | str | None):
                value = str(value)  # a typed value (the attention kernel) as it is spelled
            summary[spec.keys[0].name] = value
        return summary

    def resolved_engine(self, world_size: int) -> str:
        """single, ddp, fsdp2 or deepspeed, from --engine, --deepspeed, --fsdp and the world."""
        if self.engine != "auto":
            return self.engine
        if self.deepspeed is not None:
            return "deepspeed"
        if self.fsdp is not None:
            return "fsdp2"
        return "ddp" if world_size > 1 else "single"


def _check_positive(name: str, value: int) -> None:
    check_int(f"--{name.replace('_', '-')}", value)


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


def _option_fields() -> dict[str, dataclasses.Field[Any]]:
    """TrainOptions' fields that options are read into (the patch comes from the feature
    keys)."""
    return {f.name: f for f in dataclasses.fields(TrainOptions) if f.name != "patch"}


def known_keys() -> set[str]:
    """Every canonical option name, and every key of the feature options, ours and other
    frameworks' (also with the prefix tiledmlp_)."""
    features = {*KEYS, *(PREFIX + k for k in KEYS)}
    return set(_option_fields()) | features


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
    fields = _option_fields()
    canonical: dict[str, Any] = {}
    features: dict[str, Any] = {}
    for raw, value in values.items():
        key = canonical_key(raw)
        if key.removeprefix(PREFIX) in KEYS:
            if key in features and features[key] != value:
                raise ValueError(f"{source} {key} given twice with different values")
            features[key] = value
            continue
        if key not in fields:
            known = sorted({*fields, *ALIASES, *KEYS})
            raise ValueError(f"unknown {source} {raw!r}; known: {', '.join(known)}")
        converted = _convert(key, value, fields[key].type)
        if key in canonical and canonical[key] != converted:
            raise ValueError(f"{source} {key} given twice with different values")
        canonical[key] = converted
    canonical["patch"] = train_patch(
        {field: kv.value for field, kv in read_keys(features, what=source).items()}
    )
    return TrainOptions(**canonical)


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


def _convert(key: str, value: Any, kind: Any) -> Any:
    name = f"--{key.replace('_', '-')}"
    text = str(kind)
    if value is None:
        if "None" in text:
            return None
        raise ValueError(f"{name} needs a value")
    if key == "dtype":
        return parse_dtype(value, name)
    if key == "report_to" and isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "none"
    base = text.replace(" | None", "")
    try:
        if base == "bool":
            return parse_bool(value, name)
        if base == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(str(value).strip()) if not isinstance(value, int) else value
        if base == "float":
            number = float(value)
            if not math.isfinite(number):
                raise ValueError
            return number
    except (TypeError, ValueError):
        expected = {"bool": "true or false", "int": "an integer", "float": "a number"}[base]
        raise ValueError(f"{name} expected {expected}, got {value!r}") from None
    if base == "Path":
        return Path(str(value))
    return str(value)
