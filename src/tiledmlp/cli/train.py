"""`tiledmlp train`: fine-tune a causal LM at long context on the Hugging Face Trainer with tiled
MLPs and the tiled loss (train/trainer.py does the work).

Options come from defaults, then `--config FILE` (YAML or JSON, the same keys), then the command
line, each overriding the one before. Flags carry the TrainingArguments names; today's short
names (--steps, --lr, --batch-size, --deepspeed-config) and ms-swift / axolotl / unsloth flags (--use_tiled_mlp,
--tiled_mlp_num_shards, --tiled_mlp) are accepted too.

Invariant: `--json` prints one JSON object on the last stdout line; its keys (losses, first_loss,
last_loss, dtype, tokens_per_s, peak_mib, ...) are a contract.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from tiledmlp.cli.common import UsageError, bool_value

__all__ = ["add_parser", "run"]

_NOT_OPTIONS = ("config", "json", "verbose", "command")


def add_parser(sub: Any) -> None:
    """Adds `train` to the subcommands (every option defaults to 'not given', so that a config
    file's value is overridden only by a flag that was typed)."""
    from tiledmlp.train.options import DTYPES, ENGINES, SCHEDULES
    from tiledmlp.train.presets import PRESETS

    t = sub.add_parser(
        "train",
        argument_default=argparse.SUPPRESS,
        help="fine-tune a causal LM at long context with tiled MLPs (the main job)",
        description=(
            "Trains a causal LM on packed token sequences with tiled MLPs and the tiled loss, on "
            "the Hugging Face Trainer. Default: the 'tiny' preset (random init from a config) on "
            "the Python standard library's own source code, byte-level tokens, nothing "
            "downloaded. Under torchrun it runs DDP, FSDP2 (--fsdp) or DeepSpeed (--deepspeed). "
            "Flags take dashes or underscores (--max-steps or --max_steps); --config FILE "
            "(YAML/JSON) holds the same keys, flags override it."
        ),
    )
    flag = _Adder(t)
    flag("--config", type=Path, metavar="FILE", help="YAML or JSON file of these options")
    flag("--model", help=f"a preset ({', '.join(sorted(PRESETS))}) or a local model directory, "
         "e.g. a previous --output-dir (default: tiny)")  # fmt: skip
    flag("--data", metavar="FILE", help="a local .txt, .jsonl ('text' field) or .csv ('text' "
         "column) file (default: the Python stdlib source)")  # fmt: skip
    flag("--seq-len", help="tokens per sequence (default: 2048)")
    flag("--per-device-train-batch-size", "--batch-size", dest="per_device_train_batch_size",
         help="sequences per micro-batch and process (default: 1)")  # fmt: skip
    flag("--max-steps", "--steps", dest="max_steps", help="optimizer steps (default: 12)")
    flag("--learning-rate", "--lr", dest="learning_rate", help="peak AdamW learning rate "
         "(default: presets 2e-3 x 256 / hidden_size, e.g. tiny 2e-3, llama3-8b 1.25e-4; "
         "model directories 2e-5)")  # fmt: skip
    flag("--lr-scheduler-type", choices=SCHEDULES, help="learning-rate schedule (default: linear)")
    flag("--warmup-steps", help="linear warmup steps (default: 0)")
    flag("--weight-decay", help="AdamW weight decay (default: 0)")
    flag("--gradient-accumulation-steps", help="micro-batches per optimizer step (default: 1)")
    flag("--max-grad-norm", help="gradient clipping norm, 0 for none (default: 1.0)")
    flag("--logging-steps", help="log the loss every N steps (default: 1)")
    flag("--report-to", help="none, tensorboard, wandb, ... comma-separated (default: none)")
    flag("--eval-steps", help="evaluate on held-out sequences every N steps (default: never)")
    flag("--eval-sequences", help="held-out sequences for evaluation (default: 4)")
    flag("--save-steps", help="save OUTPUT_DIR/checkpoint-N every N steps (default: never)")
    flag("--save-total-limit", help="keep at most this many checkpoints (default: all)")
    flag("--output-dir", metavar="DIR", help="save the trained model, its tokenizer, "
         "summary.json and metrics.jsonl here (a directory that works as --model)")  # fmt: skip
    flag("--resume-from-checkpoint", metavar="DIR|latest", help="continue from "
         "OUTPUT_DIR/checkpoint-N, or the newest one with 'latest'")  # fmt: skip
    flag("--use-tiled-mlp", metavar="true|false", help="tile the MLPs (and the loss) "
         "(default: true; ms-swift's name)")  # fmt: skip
    flag("--tiled-mlp", metavar="true|false|MODE", help="axolotl's and unsloth's name: true, "
         "false, or a tile mode ('arctic', 'target:<GB>', N)")  # fmt: skip
    flag("--tiled-mlp-num-shards", metavar="N", help="tiles per MLP (ms-swift's and axolotl's "
         "name for --num-tiles)")  # fmt: skip
    flag("--num-tiles", help="tiles per MLP: an int, 'auto', 'arctic' or 'target:<GB>' "
         "(default: auto)")  # fmt: skip
    flag("--tile-budget-gb", metavar="GB", help="each MLP's working-memory budget in GiB: the "
         "fewest tiles that fit it (the same as --num-tiles target:<GB>)")  # fmt: skip
    flag("--tiled-loss", metavar="true|false", help="compute the loss with tiled_cross_entropy "
         "when tiling (default: true)")  # fmt: skip
    flag("--sequence-parallel-size", metavar="P", help="split each sequence over P ranks "
         "(Ulysses sequence parallelism, under torchrun; P divides the world, the heads and "
         "--seq-len) (default: 1)")  # fmt: skip
    switch = _Switch(t)
    switch("--gradient-checkpointing", help="the model's own (non-reentrant) checkpointing")
    switch("--activation-offloading", help="keep the checkpointed layers' inputs in host memory "
           "between forward and recompute (needs --gradient-checkpointing)")  # fmt: skip
    switch("--tiled-norms", help="also tile the LayerNorm/RMSNorm layers (with tiled MLPs)")
    flag("--kernels", metavar="true|false", help="use the fused Triton elementwise kernels for "
         "gated MLPs on CUDA (default: true; false: PyTorch only)")  # fmt: skip
    flag("--dtype", metavar="|".join(DTYPES), help="weights and activations: float32/fp32, "
         "bfloat16/bf16 (pure bf16 weights; DeepSpeed keeps fp32 masters), float16/fp16 (mixed "
         "precision with loss scaling, CUDA only) (default: float32)")  # fmt: skip
    flag("--engine", choices=ENGINES, help="auto: DeepSpeed with --deepspeed, FSDP2 with --fsdp, "
         "DDP under torchrun with several processes, else one process (default: auto)")  # fmt: skip
    flag("--deepspeed", "--deepspeed-config", dest="deepspeed", metavar="CONFIG",
         help="DeepSpeed JSON config; 'auto' values are filled by the Trainer")  # fmt: skip
    flag("--fsdp", metavar="full_shard", help="FSDP2 under torchrun, one unit per decoder layer "
         "(the Trainer's --fsdp; on CPU-only machines tiledmlp shards the model itself)")  # fmt: skip
    flag("--fsdp-config", metavar="FILE", help="JSON of the Trainer's fsdp_config keys, over "
         "tiledmlp's (fsdp_version 2, the decoder layer class to wrap); GPUs only")  # fmt: skip
    flag("--seed", help="model init and data order seed (default: 0)")
    flag("--max-data-bytes", help="read at most about this much text (default: 4000000)")
    t.add_argument("--json", action="store_true", default=False,
                   help="print the summary as one JSON object")  # fmt: skip


class _Adder:
    """add_argument for a valued option: kept as text, converted by train/options.py."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def __call__(self, *names: str, **kwargs: Any) -> None:
        self.parser.add_argument(*names, **kwargs)


class _Switch(_Adder):
    """A boolean flag: alone it means true; `--flag false` overrides a config file's true."""

    def __call__(self, *names: str, **kwargs: Any) -> None:
        self.parser.add_argument(
            *names, nargs="?", const=True, type=bool_value, metavar="true|false", **kwargs
        )


def run(args: argparse.Namespace) -> int:
    """Runs `tiledmlp train`."""
    from tiledmlp.train.options import (
        canonical_key,
        known_keys,
        options_from,
        read_config_file,
    )
    from tiledmlp.train.trainer import run as train

    given = {k: v for k, v in vars(args).items() if k not in _NOT_OPTIONS}
    values: dict[str, Any] = {}
    config = getattr(args, "config", None)
    if config is not None:
        known = known_keys()
        for key, value in read_config_file(config).items():
            if canonical_key(key) not in known:
                raise UsageError(
                    f"--config {config}: unknown key {key!r}; known: {', '.join(sorted(known))}"
                )
            values[canonical_key(key)] = value
    values.update({canonical_key(k): v for k, v in given.items()})
    opts = options_from(values)
    summary = train(opts)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.json:
        print(json.dumps(summary))
    else:
        _print(summary)
    return 130 if summary["interrupted"] else 0


def _print(s: dict[str, Any]) -> None:
    tiled = (
        "tiled MLPs" + (" + tiled loss" if s["tiled_loss"] else "")
        if s["use_tiled_mlp"]
        else "untiled"
    ) + (" + activation offloading" if s["activation_offloading"] else "")
    tiles = sorted(set(s["tiles_per_mlp"].values()))
    tiles_text = (
        f", {tiles[0] if len(tiles) == 1 else f'{tiles[0]}-{tiles[-1]}'} tile(s) per MLP"
        if tiles
        else ""
    )
    if s["steps"]:
        print(
            f"trained {s['model']} ({tiled}{tiles_text}, {s['engine']}, {s['dtype']}, lr "
            f"{s['learning_rate']:g}) for {s['steps']} steps of {s['seq_len']} tokens: loss "
            f"{s['first_loss']:.4f} -> {s['last_loss']:.4f}, {s['tokens_per_s']:,.0f} tokens/s, "
            f"peak {s['peak_mib']:,.0f} MiB ({s['peak_kind']})"
        )
    else:
        print(f"nothing to train: already at step {s['global_step']} of {s['max_steps']}")
    if s["eval_loss"] is not None:
        print(f"eval loss {s['eval_loss']:.4f}")
    if s["interrupted"]:
        if s["checkpoint"] is not None:
            print(
                f"interrupted at step {s['global_step']}; saved {s['checkpoint']}; continue with "
                f"--resume-from-checkpoint {s['checkpoint']}"
            )
        else:
            print(f"interrupted at step {s['global_step']}; nothing saved (no --output-dir)")
    elif s["output_dir"] is not None:
        print(f"saved to {s['output_dir']}")
