"""`tiledmlp train`: train a causal LM at long context on the Hugging Face Trainer with tiled
MLPs and the tiled loss (train/run.py does the work).

Options come from defaults, then `--config FILE` (YAML or JSON, the same keys), then the command
line, each overriding the one before. Flags carry the TrainingArguments names; today's short
names (--steps, --lr, --batch-size, --deepspeed-config) and ms-swift / axolotl / unsloth flags (--use_tiled_mlp,
--tiled_mlp_num_shards, --tiled_mlp) are accepted too.

Invariant: `--json` prints one JSON object on the last stdout line; its keys (losses, first_loss,
last_loss, dtype, tokens_per_s, peak_mib, ...) are a contract.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiledmlp.cli.common import UsageError, bool_value
from tiledmlp.cli.output import show

__all__ = ["add_model_flags", "add_parser", "option_values", "run"]

_NOT_OPTIONS = ("config", "json", "verbose", "command", "argv")


def add_parser(sub: Any) -> None:
    """Adds `train` to the subcommands (every option defaults to 'not given', so that a config
    file's value is overridden only by a flag that was typed)."""
    t = sub.add_parser(
        "train",
        argument_default=argparse.SUPPRESS,
        help="train a causal LM at long context with tiled MLPs on the Hugging Face Trainer "
        "(default: the tiny preset from scratch; --output-dir keeps the result)",
        description=(
            "Trains a causal LM on packed token sequences with tiled MLPs and the tiled loss, on "
            "the Hugging Face Trainer. Default: the 'tiny' preset trained from scratch (random "
            "init from a config) on the Python standard library's own source code, byte-level "
            "tokens, nothing downloaded, nothing saved unless --output-dir is given; --model DIR "
            "fine-tunes a saved model. Under torchrun it runs DDP, FSDP2 (--fsdp) or DeepSpeed "
            "(--deepspeed). Flags take dashes or underscores (--max-steps or --max_steps); "
            "--config FILE (YAML/JSON) holds the same keys, flags override it."
        ),
        epilog=(
            "Other accepted spellings (the same options): --steps, --lr, --batch-size, "
            "--deepspeed-config; ms-swift / axolotl / unsloth tiling flags --tiled-mlp, "
            "--tiled-mlp-num-shards and --tile-budget-gb GB (= --num-tiles target:GB). The "
            "command line reference lists them all (docs/reference/cli.md)."
        ),
    )
    t.add_argument("--config", type=Path, metavar="FILE", help="YAML or JSON file of these "
                   "options (flags override it)")  # fmt: skip
    groups = _Groups(
        model=_Adder(t.add_argument_group("model")),
        data=_Adder(t.add_argument_group("data")),
        tiling=_Adder(t.add_argument_group("tiling")),
        long=_Adder(t.add_argument_group("long context")),
        dist=_Adder(t.add_argument_group("distributed (under torchrun)")),
        training=_Adder(t.add_argument_group("training")),
        output=_Adder(t.add_argument_group("output")),
        preflight=_Adder(t.add_argument_group("pre-flight (memory)")),
        hidden=_Adder(t),  # other spellings: accepted, listed in the epilog, not in the help
    )
    _add_model_and_data_flags(groups)
    _add_tiling_flags(groups)
    _add_distributed_flags(groups)
    _add_training_flags(groups)
    _add_output_flags(groups)


def _add_model_and_data_flags(groups: _Groups) -> None:
    """The model to train and the text it reads."""
    add_model_flags(groups.model)
    data = groups.data
    data("--data", metavar="PATH", help="a local file or folder: .txt/.md, .jsonl, .json (an array "
         "of records), .csv, .parquet, .arrow, or a folder written by datasets' save_to_disk "
         "(all but text and .jsonl need the data extra) (default: the Python stdlib source)")  # fmt: skip
    data("--data-field", metavar="NAME", help="the records' field to train on: text, or chat "
         "turns through the tokenizer's chat template (default: text, else messages)")  # fmt: skip
    data("--seq-len", help="tokens per sequence (default: 2048)")
    data("--max-data-bytes", help="read at most about this much text (default: 4000000)")


def add_model_flags(model: _Adder) -> None:
    """--model, --dtype and --seed (`check` shares them)."""
    from tiledmlp.models.presets import PRESETS
    from tiledmlp.train.options import DTYPES

    model("--model", metavar="NAME_OR_DIR", help=f"a preset ({', '.join(sorted(PRESETS))}), trained from scratch, "
          "or a local model folder (e.g. a previous --output-dir) or a Hugging Face Hub id "
          "(org/name, from the local cache or the Hub), fine-tuned, or a model's config.json, "
          "trained from random init (default: tiny)")  # fmt: skip
    model("--dtype", metavar="|".join(DTYPES), help="weights and activations: float32/fp32, "
          "bfloat16/bf16 (pure bf16 weights; DeepSpeed keeps fp32 masters), float16/fp16 (mixed "
          "precision with loss scaling, CUDA only) (default: float32)")  # fmt: skip
    model("--seed", metavar="SEED", help="model init and data order seed (default: 0)")


def _add_tiling_flags(groups: _Groups) -> None:
    """The feature options, one flag per key of the schema (PatchConfig's fields): ours listed
    in their group with their help, other frameworks' accepted and hidden; and the model's own
    checkpointing."""

    from tiledmlp.config.patch import PatchConfig
    from tiledmlp.config.schema import keys_of
    from tiledmlp.train.defaults import DEFAULT_PATCH

    switch = _Switch(groups.long.group)
    switch("--gradient-checkpointing", help="the model's own (non-reentrant) checkpointing")
    where = {"tiling": groups.tiling, "long context": groups.long, "distributed": groups.dist}
    for field, spec, key in keys_of(PatchConfig):
        flag = "--" + key.name.replace("_", "-")
        shown = key.ours and bool(key.help)
        adder = where[spec.group] if shown else groups.hidden  # type: ignore[index]
        text = key.help if shown else argparse.SUPPRESS
        if shown and key.kind == "bool" and "(default" not in text:
            text += f" (default: {str(getattr(DEFAULT_PATCH, field.name)).lower()})"
        if key.kind == "bool":  # alone: true; the value is parsed by the key's parser
            adder.group.add_argument(flag, nargs="?", const="true", metavar="true|false",
                                     help=text)  # fmt: skip
        else:
            adder(flag, metavar=key.metavar or "N", help=text)


def _add_distributed_flags(groups: _Groups) -> None:
    """Sequence parallelism and the engines under torchrun."""
    from tiledmlp.train.options import ENGINES

    dist = groups.dist
    hidden = groups.hidden
    dist("--deepspeed", metavar="CONFIG", help="DeepSpeed JSON config; 'auto' values are "
         "filled by the Trainer")  # fmt: skip
    hidden("--deepspeed-config", dest="deepspeed", metavar="CONFIG", help=argparse.SUPPRESS)
    dist("--fsdp", metavar="full_shard", help="FSDP2, one unit per decoder layer (the Trainer's "
         "--fsdp; on CPU-only machines tiledmlp shards the model itself)")  # fmt: skip
    dist("--fsdp-config", metavar="FILE", help="JSON of the Trainer's fsdp_config keys, over "
         "tiledmlp's (fsdp_version 2, the decoder layer class to wrap); GPUs only")  # fmt: skip
    dist("--ddp-timeout", metavar="SECONDS", help="how long a collective waits for the other "
         "ranks before every survivor stops naming the rank that stopped answering (the "
         "Trainer's ddp_timeout) (default: 1800)")  # fmt: skip
    dist("--engine", choices=ENGINES, metavar="NAME", help=f"{', '.join(ENGINES)}; auto: "
         "DeepSpeed with --deepspeed, FSDP2 with --fsdp, DDP under torchrun with several "
         "processes, else one process (default: auto)")  # fmt: skip


def _add_training_flags(groups: _Groups) -> None:
    """The optimizer, its schedule and evaluation."""
    from tiledmlp.train.options import SCHEDULES

    training = groups.training
    hidden = groups.hidden
    training("--max-steps", help="optimizer steps (default: 12)")
    hidden("--steps", dest="max_steps", help=argparse.SUPPRESS)
    training("--per-device-train-batch-size", help="sequences per micro-batch and process "
             "(default: 1)")  # fmt: skip
    hidden("--batch-size", dest="per_device_train_batch_size", help=argparse.SUPPRESS)
    training("--gradient-accumulation-steps", help="micro-batches per optimizer step "
             "(default: 1)")  # fmt: skip
    training("--learning-rate", metavar="LR", help="peak AdamW learning rate (default: presets 2e-3 x 256 / "
             "hidden_size, e.g. tiny 2e-3, llama3-8b 1.25e-4; model directories 2e-5)")  # fmt: skip
    hidden("--lr", dest="learning_rate", help=argparse.SUPPRESS)
    training("--lr-scheduler-type", choices=SCHEDULES, metavar="NAME", help="learning-rate "
             f"schedule: {', '.join(SCHEDULES)} (default: linear)")  # fmt: skip
    training("--warmup-steps", help="linear warmup steps (default: 0)")
    training("--weight-decay", metavar="W", help="AdamW weight decay (default: 0)")
    training(
        "--max-grad-norm", metavar="NORM", help="gradient clipping norm, 0 for none (default: 1.0)"
    )
    training("--eval-steps", help="evaluate on held-out sequences every N steps (default: "
             "never)")  # fmt: skip
    training("--eval-sequences", help="held-out sequences for evaluation (default: 4)")


def _add_output_flags(groups: _Groups) -> None:
    """What the run writes and resumes from."""
    output = groups.output
    output("--output-dir", metavar="DIR", help="save the trained model, its tokenizer, "
           "summary.json, metrics.jsonl and curve.png (with matplotlib) here, a directory that "
           "works as --model (default: nothing is saved)")  # fmt: skip
    output("--save-steps", help="save OUTPUT_DIR/checkpoint-N every N steps (default: never)")
    output("--save-total-limit", help="keep at most this many checkpoints (default: all)")
    output("--resume-from-checkpoint", metavar="DIR|latest", help="continue that run from "
           "OUTPUT_DIR/checkpoint-N, or the newest one with 'latest', with the run's own settings "
           "(recorded in the checkpoint; an option given that changes the run is refused, one "
           "that changes only memory or speed is applied and said; --max-steps at most the "
           "run's own)")  # fmt: skip
    output("--logging-steps", help="log the loss every N steps (default: 1)")
    output(
        "--report-to",
        metavar="LIST",
        help="none, tensorboard, wandb, ... comma-separated; each needs its package (pip "
        "install tensorboard) (default: none)",
    )
    preflight = groups.preflight
    _Switch(preflight.group)("--preflight", help="before loading anything, plan the run's "
        "memory and refuse, in one line naming what fits, a run that cannot fit; a note when "
        "it is within 10%% of the memory, and when --seq-len passes the model's "
        "max_position_embeddings (a note, not a refusal: extending a model's context is a "
        "recipe of its own; set rope_scaling in its config.json to extend it by RoPE "
        "scaling) (default: true)")  # fmt: skip
    preflight.group.add_argument("--no-preflight", dest="preflight", action="store_const",
                                 const=False, help="skip the pre-flight (= --preflight false)")  # fmt: skip
    preflight("--memory-gb", metavar="GB", help="the memory the pre-flight checks the run "
              "against, in GiB (default: the GPU's free memory, or on the CPU the available "
              "RAM within the cgroup's limit)")  # fmt: skip
    output.group.add_argument("--json", action="store_true", default=False,
                              help="print the summary as one JSON object on stdout")  # fmt: skip


@dataclass(frozen=True)
class _Groups:
    """The help's option groups of `train`, and `hidden` for the other spellings."""

    model: _Adder
    data: _Adder
    tiling: _Adder
    long: _Adder
    dist: _Adder
    training: _Adder
    output: _Adder
    preflight: _Adder
    hidden: _Adder


class _Adder:
    """add_argument for a valued option: kept as text, converted by train/options.py."""

    def __init__(self, group: Any) -> None:
        self.group = group  # a parser or an argument group

    def __call__(self, *names: str, **kwargs: Any) -> None:
        if "choices" not in kwargs:
            kwargs.setdefault("metavar", "N")  # most options are counts
        self.group.add_argument(*names, **kwargs)


class _Switch(_Adder):
    """A boolean flag: alone it means true; `--flag false` overrides a config file's true."""

    def __call__(self, *names: str, **kwargs: Any) -> None:
        self.group.add_argument(
            *names, nargs="?", const=True, type=bool_value, metavar="true|false", **kwargs
        )


def run(args: argparse.Namespace) -> int:
    """Runs `tiledmlp train`."""
    from tiledmlp.train.options import options_from

    values = option_values(args)
    opts = options_from(values)
    # Imported after the options are checked: a bad option is reported before the Trainer's
    # imports (transformers, accelerate) take seconds.
    from tiledmlp.cli.preflight import preflight
    from tiledmlp.train.run import run as train

    summary = train(opts, given=values, before_load=preflight)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.json:
        show(json.dumps(summary))
    else:
        _print_summary(summary, getattr(args, "argv", []))
    return 130 if summary["interrupted"] else 0


def option_values(args: argparse.Namespace) -> dict[str, Any]:
    """The options given, by canonical key: `--config FILE`'s keys, then the flags typed (a
    key the options do not know is one line, with the closest known one)."""
    from tiledmlp.train.options import canonical_key, known_keys, read_config_file

    given = {k: v for k, v in vars(args).items() if k not in _NOT_OPTIONS}
    values: dict[str, Any] = {}
    config = getattr(args, "config", None)
    if config is not None:
        known = known_keys()
        for key, value in read_config_file(config).items():
            if canonical_key(key) not in known:
                close = difflib.get_close_matches(canonical_key(key), sorted(known), n=1)
                hint = f"did you mean {close[0]!r}?" if close else "see tiledmlp train --help"
                raise UsageError(f"--config {config}: unknown key {key!r}; {hint}")
            values[canonical_key(key)] = value
    values.update({canonical_key(k): v for k, v in given.items()})
    return values


def resume_command(argv: list[str], checkpoint: str) -> str:
    """The whole command that continues an interrupted run: this one's arguments, with
    --resume-from-checkpoint CHECKPOINT instead of any given before (shell-quoted)."""
    kept: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--resume-from-checkpoint":
            skip = True
            continue
        if token.startswith("--resume-from-checkpoint="):
            continue
        kept.append(token)
    return shlex.join(["tiledmlp", *kept, "--resume-from-checkpoint", checkpoint])


def _print_summary(s: dict[str, Any], argv: list[str]) -> None:
    tiled = (
        "tiled MLPs" + (" + tiled loss" if s["tiled_loss"] else "")
        if s["use_tiled_mlp"]
        else "untiled"
    ) + (" + activation offloading" if s["activation_offloading"] else "")
    tiles_text = _tiles_text(s["tiles_per_mlp"], "MLP") + _tiles_text(
        s.get("tiles_per_norm", {}), "norm"
    )
    resumed = (
        f" (resumed from step {s['resumed_from_step']})"
        if s["resumed_from_step"] is not None
        else ""
    )
    if s["steps"]:
        steps = f"{s['steps']} step{'s' if s['steps'] != 1 else ''}"
        show(
            f"trained {s['model']} ({tiled}{tiles_text}, {s['engine']}, {s['dtype']}, lr "
            f"{s['learning_rate']:g}) for {steps} of {s['seq_len']} tokens{resumed}: loss "
            f"{s['first_loss']:.4f} -> {s['last_loss']:.4f}, {s['tokens_per_s']:,.0f} tokens/s, "
            f"peak {s['peak_mib']:,.0f} MiB ({s['peak_kind']})"
        )
    else:
        show(f"nothing to train: already at step {s['global_step']} of {s['max_steps']}")
    data = s.get("data")
    if data is not None:
        from tiledmlp.train.summary import data_line

        show(data_line(data, s["max_steps"]))
    if s.get("curve") is not None:
        show(f"curve: {s['curve']}")
    elif s.get("curve_note") is not None:
        show(s["curve_note"])
    if s["eval_loss"] is not None:
        show(f"eval loss {s['eval_loss']:.4f}")
    if s["interrupted"]:
        if s["checkpoint"] is not None:
            show(
                f"interrupted at step {s['global_step']}; saved {s['checkpoint']}; continue with: "
                f"{resume_command(argv, s['checkpoint'])}"
            )
        else:
            show(f"interrupted at step {s['global_step']}; nothing saved (no --output-dir)")
    elif s["output_dir"] is not None:
        show(f"saved to {s['output_dir']}")
    else:
        show("nothing saved: add --output-dir DIR to keep the trained model")


def _tiles_text(counts: dict[str, int], what: str) -> str:
    """', 4 tiles per MLP' (or a range, '2-4 tiles per MLP'); '' when nothing was tiled."""
    tiles = sorted(set(counts.values()))
    if not tiles:
        return ""
    n = str(tiles[0]) if len(tiles) == 1 else f"{tiles[0]}-{tiles[-1]}"
    return f", {n} tile{'s' if tiles[-1] != 1 else ''} per {what}"
