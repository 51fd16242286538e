"""TrainOptions: the options of a training run, each declared once on its field with the
schema's `option(...)` (help, default, section of the help, every key that spells it and that
key's parser: config/schema.py), and checked as a whole when constructed.

`tiledmlp train`'s and `check`'s flags (cli/flags.py), the --config FILE keys and the command
line reference's train table derive from these fields; the feature options are PatchConfig's
own schema, nested as `TrainOptions.patch`. train/options.py reads keys of any spelling into
one.

Invariant: a TrainOptions that constructs is a run that can start: every value is in range,
the model and the data exist and can be read, the switches agree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiledmlp.config.gpus import GPUS
from tiledmlp.config.patch import FEATURES, PatchConfig
from tiledmlp.config.schema import Key, option, option_of
from tiledmlp.config.values import (
    DTYPES,
    as_float,
    as_int,
    as_list,
    as_path,
    as_text,
    parse_bool,
    parse_dtype,
)
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.ops.tiling.values import check_int, check_positive_number
from tiledmlp.train.defaults import DEFAULT_PATCH

__all__ = ["DEFAULT_PATCH", "ENGINES", "SCHEDULES", "TrainOptions"]

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


def _key(name: str, parse: Any, metavar: str = "N", **kwargs: Any) -> Key:
    return Key(name, parse, metavar=metavar, kind=kwargs.pop("kind", "str"), **kwargs)


def _models() -> str:
    from tiledmlp.models.presets import PRESETS

    return ", ".join(sorted(PRESETS))


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """A training run: each field is declared once with its help, default, section of the
    help, and every key that spells it with that key's parser (config/schema.py); `tiledmlp
    train`'s flags, the --config FILE keys and the docs' table derive from them.

    patch: what patch_model applies to the model (None: nothing), parsed once from the
    feature keys of PatchConfig's schema (options_from); default: the tiled MLPs and the tiled
    loss.
    """

    model: str = option(
        default="tiny",
        group="model",
        help=f"a preset ({_models()}), trained from scratch, or a local model folder (e.g. a "
        "previous --output-dir) or a Hugging Face Hub id (org/name, from the local cache or the "
        "Hub), fine-tuned, or a model's config.json, trained from random init",
        keys=(_key("model", as_text, "NAME_OR_DIR"),),
    )
    dtype: str = option(
        default="float32",
        group="model",
        help="weights and activations: float32/fp32, bfloat16/bf16 (pure bf16 weights; "
        "DeepSpeed keeps fp32 masters), float16/fp16 (mixed precision with loss scaling, CUDA "
        "only)",
        keys=(_key("dtype", parse_dtype, "|".join(DTYPES)),),
    )
    seed: int = option(
        default=0,
        group="model",
        help="model init and data order seed",
        keys=(_key("seed", as_int, "SEED", kind="int"),),
    )
    data: Path | None = option(  # noqa: RUF009 (option() returns a dataclasses.field)
        default=None,
        group="data",
        default_text="the Python stdlib source",
        help="a local file or folder: .txt/.md, .jsonl, .json (an array of records), .csv, "
        ".parquet, .arrow, or a folder written by datasets' save_to_disk (all but text and "
        ".jsonl need the data extra)",
        keys=(_key("data", as_path, "PATH"),),
    )
    data_field: str | None = option(
        default=None,
        group="data",
        default_text="text, else messages",
        help="the records' field to train on: text, or chat turns through the tokenizer's chat "
        "template",
        keys=(_key("data_field", as_text, "NAME"),),
    )
    seq_len: int = option(
        default=2048,
        group="data",
        help="tokens per sequence",
        keys=(_key("seq_len", as_int, kind="int"),),
    )
    max_data_bytes: int = option(
        default=4_000_000,
        group="data",
        help="read at most about this much text",
        keys=(_key("max_data_bytes", as_int, kind="int"),),
    )
    gradient_checkpointing: bool = option(
        default=False,
        group="long context",
        help="the model's own (non-reentrant) checkpointing",
        keys=(_key("gradient_checkpointing", parse_bool, "true|false", kind="bool"),),
    )
    every_n_layers: int = option(
        default=1,
        group="long context",
        help="with --gradient-checkpointing, checkpoint every N-th decoder layer only "
        "(transformers' activation_checkpointing_enable(every_n_layers=N), transformers 5.25 "
        "and later): the others keep their activations, faster where the memory allows",
        keys=(_key("every_n_layers", as_int, kind="int"),),
    )
    torch_compile: bool = option(
        default=False,
        group="long context",
        help="torch.compile the patched model (the Trainer's torch_compile, inductor): the "
        "tiled ops are custom operators inside its graphs",
        keys=(
            _key("torch_compile", parse_bool, "true|false", kind="bool"),
            _key("compile", parse_bool, "true|false", kind="bool"),
        ),
    )
    # the feature options: PatchConfig's own schema (tiling, loss, norms, layers, offloading,
    # sequence parallelism), listed here in `tiledmlp train --help`
    patch: PatchConfig | None = DEFAULT_PATCH
    deepspeed: Path | None = option(  # noqa: RUF009 (option() returns a dataclasses.field)
        default=None,
        group="distributed",
        help="DeepSpeed JSON config; 'auto' values are filled by the Trainer",
        keys=(_key("deepspeed", as_path, "CONFIG"), _key("deepspeed_config", as_path, "CONFIG")),
    )
    fsdp: str | None = option(
        default=None,
        group="distributed",
        help="FSDP2, one unit per decoder layer (the Trainer's --fsdp; on CPU-only machines "
        "tiledmlp shards the model itself)",
        keys=(_key("fsdp", as_text, "full_shard"),),
    )
    fsdp_config: Path | None = option(  # noqa: RUF009 (option() returns a dataclasses.field)
        default=None,
        group="distributed",
        help="JSON of the Trainer's fsdp_config keys, over tiledmlp's (fsdp_version 2, the "
        "decoder layer class to wrap); GPUs only",
        keys=(_key("fsdp_config", as_path, "FILE"),),
    )
    ddp_timeout: int = option(
        default=1800,
        group="distributed",
        help="how long a collective waits for the other ranks before every survivor stops "
        "naming the rank that stopped answering (the Trainer's ddp_timeout)",
        keys=(_key("ddp_timeout", as_int, "SECONDS", kind="int"),),
    )
    engine: str = option(
        default="auto",
        group="distributed",
        help=f"{', '.join(ENGINES)}; auto: DeepSpeed with --deepspeed, FSDP2 with --fsdp, DDP "
        "under torchrun with several processes, else one process",
        keys=(_key("engine", as_text, "NAME", choices=ENGINES),),
    )
    max_steps: int = option(
        default=12,
        group="training",
        help="optimizer steps",
        keys=(_key("max_steps", as_int, kind="int"), _key("steps", as_int, kind="int")),
    )
    per_device_train_batch_size: int = option(
        default=1,
        group="training",
        help="sequences per micro-batch and process",
        keys=(
            _key("per_device_train_batch_size", as_int, kind="int"),
            _key("batch_size", as_int, kind="int"),
        ),
    )
    gradient_accumulation_steps: int = option(
        default=1,
        group="training",
        help="micro-batches per optimizer step",
        keys=(_key("gradient_accumulation_steps", as_int, kind="int"),),
    )
    learning_rate: float | None = option(
        default=None,
        group="training",
        default_text="presets 2e-3 x 256 / hidden_size, e.g. tiny 2e-3, llama3-8b 1.25e-4; model "
        "directories 2e-5",
        help="peak AdamW learning rate",
        keys=(_key("learning_rate", as_float, "LR", kind="float"), _key("lr", as_float, "LR")),
    )
    lr_scheduler_type: str = option(
        default="linear",
        group="training",
        help=f"learning-rate schedule: {', '.join(SCHEDULES)}",
        keys=(_key("lr_scheduler_type", as_text, "NAME", choices=SCHEDULES),),
    )
    warmup_steps: int = option(
        default=0,
        group="training",
        help="linear warmup steps",
        keys=(_key("warmup_steps", as_int, kind="int"),),
    )
    weight_decay: float = option(
        default=0.0,
        group="training",
        default_text="0",
        help="AdamW weight decay",
        keys=(_key("weight_decay", as_float, "W", kind="float"),),
    )
    max_grad_norm: float = option(
        default=1.0,
        group="training",
        help="gradient clipping norm, 0 for none",
        keys=(_key("max_grad_norm", as_float, "NORM", kind="float"),),
    )
    eval_steps: int | None = option(
        default=None,
        group="training",
        default_text="never",
        help="evaluate on held-out sequences every N steps",
        keys=(_key("eval_steps", as_int, kind="int"),),
    )
    eval_sequences: int = option(
        default=4,
        group="training",
        help="held-out sequences for evaluation",
        keys=(_key("eval_sequences", as_int, kind="int"),),
    )
    output_dir: Path | None = option(  # noqa: RUF009 (option() returns a dataclasses.field)
        default=None,
        group="output",
        default_text="nothing is saved",
        help="save the trained model, its tokenizer, summary.json, metrics.jsonl and the loss "
        "curve (curve.png with matplotlib, else curve.svg) here, a directory that works as "
        "--model",
        keys=(_key("output_dir", as_path, "DIR"),),
    )
    save_steps: int | None = option(
        default=None,
        group="output",
        default_text="never",
        help="save OUTPUT_DIR/checkpoint-N every N steps",
        keys=(_key("save_steps", as_int, kind="int"),),
    )
    save_total_limit: int | None = option(
        default=None,
        group="output",
        default_text="all",
        help="keep at most this many checkpoints",
        keys=(_key("save_total_limit", as_int, kind="int"),),
    )
    resume_from_checkpoint: str | None = option(
        default=None,
        group="output",
        help="continue that run from OUTPUT_DIR/checkpoint-N, or the newest one with 'latest', "
        "with the run's own settings (recorded in the checkpoint; an option given that changes "
        "the run is refused, one that changes only memory or speed is applied and said; "
        "--max-steps at most the run's own)",
        keys=(_key("resume_from_checkpoint", as_text, "DIR|latest"),),
    )
    logging_steps: int = option(
        default=1,
        group="output",
        help="log the loss every N steps",
        keys=(_key("logging_steps", as_int, kind="int"),),
    )
    report_to: str = option(
        default="none",
        group="output",
        help="none, tensorboard, wandb, ... comma-separated; each needs its package (pip "
        "install tensorboard)",
        keys=(_key("report_to", as_list, "LIST"),),
    )
    preflight: bool = option(
        default=True,
        group="pre-flight",
        help="before loading anything, plan the run's memory and refuse, in one line naming what "
        "fits, a run that cannot fit; a note when it is within 10% of the memory, and when "
        "--seq-len passes the model's max_position_embeddings (a note, not a refusal: extending "
        "a model's context is a recipe of its own; set rope_scaling in its config.json to "
        "extend it by RoPE scaling)",
        keys=(_key("preflight", parse_bool, "true|false", kind="bool"),),
    )
    memory_gb: float | None = option(
        default=None,
        group="pre-flight",
        default_text="the GPU's free memory, or on the CPU the available RAM within the "
        "cgroup's limit",
        help="the memory the pre-flight checks the run against, in GiB",
        keys=(_key("memory_gb", as_float, "GB", kind="float"),),
    )
    gpu: str | None = option(
        default=None,
        group="pre-flight",
        default_text="the GPU here",
        help="plan and judge the run for this card (" + ", ".join(GPUS) + ") by its whole "
        "memory, as `tiledmlp plan --gpu` does, instead of the free memory read here: a run "
        "planned for another machine (this machine's RAM is then not checked)",
        keys=(_key("gpu", as_text, "CARD", choices=tuple(GPUS)),),
    )

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
        # imported here: the package's facade imports torch, which plan's cached answers skip
        from tiledmlp.sequence_parallel.sizes import check_sequence_divisible

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
            if self.gpu is not None:
                raise ValueError(
                    f"give --gpu or --memory-gb, not both: --gpu {self.gpu} is a card of "
                    f"{GPUS[self.gpu].gib:.1f} GiB"
                )
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
        if self.gpu is not None and self.gpu not in GPUS:
            raise ValueError(f"--gpu must be one of {', '.join(GPUS)}, got {self.gpu!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.lr_scheduler_type not in SCHEDULES:
            raise ValueError(
                f"--lr-scheduler-type must be one of {', '.join(SCHEDULES)}, got "
                f"{self.lr_scheduler_type!r}"
            )

    def _check_switches(self) -> None:
        """Switches that need another one."""
        check_int("--every-n-layers", self.every_n_layers, minimum=1)
        if self.every_n_layers > 1 and not self.gradient_checkpointing:
            raise ValueError(
                f"--every-n-layers {self.every_n_layers} chooses which layers are checkpointed: "
                "add --gradient-checkpointing"
            )
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
        from tiledmlp.train.data import check_data  # here: both import torch, which plan's
        from tiledmlp.train.model_source import check_model  # cached answers skip

        if self.data is not None:
            check_data(Path(self.data))  # known format, readable with what is installed
        check_model(self.model)  # a preset (did-you-mean), a loadable folder, config or Hub id

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
