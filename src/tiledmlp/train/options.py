"""The options of a training run, from keyword arguments, a config file and the command line.

One name per option, the Hugging Face TrainingArguments name where one exists (max_steps,
learning_rate, per_device_train_batch_size, ...). `options_from` accepts the same keys from any
source, with dashes or underscores, today's short names (steps, lr, batch_size,
deepspeed_config) and other frameworks' keys for tiledmlp's features (ms-swift's use_tiled_mlp
/ tiled_mlp_num_shards, axolotl's tiled_mlp: true, unsloth's tiled_mlp: "arctic" |
"target:<GB>", ...), read by tiledmlp.config.read_keys (the key table is in config/keys.py). A
config file is YAML (.yaml/.yml) or JSON holding those keys; command-line flags override it.

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
from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.values import DTYPES, parse_bool, parse_dtype
from tiledmlp.ops.policy import TilePolicy
from tiledmlp.ops.values import check_int, check_positive_number
from tiledmlp.sequence_parallel.sizes import check_sequence_divisible
from tiledmlp.train.data import check_data
from tiledmlp.train.model_source import model_name_error

__all__ = [
    "ALIASES",
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
# PatchConfig field (config/keys.py) -> TrainOptions field, for the keys read by read_keys
_FEATURE_FIELDS = {
    "tiled_mlp": "use_tiled_mlp",
    "tiles": "num_tiles",
    "tiled_loss": "tiled_loss",
    "tiled_norms": "tiled_norms",
    "tiled_layers": "tiled_layers",
    "activation_offloading": "activation_offloading",
    "sequence_parallel_size": "sequence_parallel_size",
}
_FEATURE_KEYS = tuple(k for k, spec in KEYS.items() if spec.field in _FEATURE_FIELDS)


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """A training run (see `tiledmlp train --help` for each field).

    learning_rate None: the documented default for the model (train/presets.py).
    data_field None: the records' "text" field, else their "messages" (chat turns through the
    tokenizer's chat template) (train/data.py).
    resume_from_checkpoint: a checkpoint directory, or "latest" (the newest checkpoint-N in
    output_dir).
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
    use_tiled_mlp: bool = True
    num_tiles: int | str = "auto"
    tiled_loss: bool = True
    gradient_checkpointing: bool = False
    activation_offloading: bool = False
    tiled_norms: bool = False
    tiled_layers: bool = False
    kernels: bool = True
    dtype: str = "float32"
    engine: str = "auto"
    deepspeed: Path | None = None
    fsdp: str | None = None
    fsdp_config: Path | None = None
    seed: int = 0
    max_data_bytes: int = 4_000_000
    sequence_parallel_size: int = 1
    ddp_timeout: int = 1800

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_choices()
        self._check_switches()
        self._check_engine()
        self._check_paths()

    def _check_numbers(self) -> None:
        """The tile policy, the counts and the rates."""
        TilePolicy.of(self.num_tiles, name="--num-tiles")
        _check_positive("sequence_parallel_size", self.sequence_parallel_size)
        check_sequence_divisible(
            self.seq_len,
            self.sequence_parallel_size,
            seq_name="--seq-len",
            size_name="--sequence-parallel-size",
        )
        for name in ("seq_len", "per_device_train_batch_size", "max_steps", "logging_steps"):
            _check_positive(name, getattr(self, name))
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
        if self.activation_offloading and not self.gradient_checkpointing:
            raise ValueError(
                "--activation-offloading moves the inputs of checkpointed layers: add "
                "--gradient-checkpointing"
            )
        if self.tiled_norms and not self.use_tiled_mlp:
            raise ValueError(
                "--tiled-norms tiles on top of the tiled MLPs: drop --use-tiled-mlp false"
            )
        if self.tiled_layers and not self.use_tiled_mlp:
            raise ValueError(
                "--tiled-layers tiles on top of the tiled MLPs: drop --use-tiled-mlp false"
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
        """What patch_model applies for this run (None: nothing): the tiled MLPs with their
        loss and norms when --use-tiled-mlp, offloading and sequence parallelism either way."""
        tiled = self.use_tiled_mlp
        if not (tiled or self.activation_offloading or self.sequence_parallel_size > 1):
            return None
        return PatchConfig(
            tiles=TilePolicy.of(self.num_tiles),
            tiled_mlp=tiled,
            tiled_loss=tiled and self.tiled_loss,
            tiled_norms=tiled and self.tiled_norms,
            tiled_layers=tiled and self.tiled_layers,
            activation_offloading=self.activation_offloading,
            sequence_parallel_size=self.sequence_parallel_size,
            kernels=self.kernels,
        )

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


def known_keys() -> set[str]:
    """Every canonical option name, and other frameworks' keys for the same options (also
    with the prefix tiledmlp_)."""
    features = {*_FEATURE_KEYS, *(PREFIX + k for k in _FEATURE_KEYS)}
    return {f.name for f in dataclasses.fields(TrainOptions)} | features


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
    fields = {f.name: f for f in dataclasses.fields(TrainOptions)}
    canonical: dict[str, Any] = {}
    features: dict[str, Any] = {}
    for raw, value in values.items():
        key = canonical_key(raw)
        if key.removeprefix(PREFIX) in _FEATURE_KEYS:
            if key in features and features[key] != value:
                raise ValueError(f"{source} {key} given twice with different values")
            features[key] = value
            continue
        if key not in fields:
            known = sorted({*fields, *ALIASES, *_FEATURE_KEYS})
            raise ValueError(f"unknown {source} {raw!r}; known: {', '.join(known)}")
        converted = _convert(key, value, fields[key].type)
        if key in canonical and canonical[key] != converted:
            raise ValueError(f"{source} {key} given twice with different values")
        canonical[key] = converted
    for field, kv in read_keys(features, only=tuple(_FEATURE_FIELDS), what=source).items():
        canonical[_FEATURE_FIELDS[field]] = kv.value.num_tiles if field == "tiles" else kv.value
    return TrainOptions(**canonical)


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
