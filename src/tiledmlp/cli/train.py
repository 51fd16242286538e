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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiledmlp.cli.common import UsageError
from tiledmlp.cli.flags import RUN_GROUPS, add_run_flags
from tiledmlp.cli.output import show

if TYPE_CHECKING:
    from tiledmlp.train.launch import Launch
    from tiledmlp.train.options import TrainOptions

__all__ = ["add_parser", "option_values", "run"]

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
    where = {section: t.add_argument_group(title) for section, title in RUN_GROUPS.items()}
    from tiledmlp.train.defaults import DEFAULT_PATCH

    # every option of the run from its schema (TrainOptions' and PatchConfig's fields); other
    # spellings accepted, listed in the epilog, not in the help
    add_run_flags(where, t, patch_defaults=DEFAULT_PATCH, after={"preflight": _no_preflight})
    where["output"].add_argument("--json", action="store_true", default=False,
                                 help="print the summary as one JSON object on stdout")  # fmt: skip


def _no_preflight(group: Any) -> None:
    group.add_argument("--no-preflight", dest="preflight", action="store_const", const=False,
                       help="skip the pre-flight (= --preflight false)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Runs `tiledmlp train`."""
    from tiledmlp.train.options import options_from

    values = option_values(args)
    opts = options_from(values)
    # Imported after the options are checked: a bad option is reported before the Trainer's
    # imports (transformers, accelerate) take seconds.
    from tiledmlp.train.run import run as train

    summary = train(opts, given=values, before_load=_before_load)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.json:
        show(json.dumps(summary))
    else:
        _print_summary(summary, getattr(args, "argv", []))
    return 130 if summary["interrupted"] else 0


def _before_load(opts: TrainOptions, launch: Launch) -> None:
    """The run's logging for its engine, then the pre-flight (cli/preflight.py), once every
    input is checked and before the model is loaded."""
    from tiledmlp.cli.preflight import preflight

    if launch.engine != "deepspeed":
        # the Trainer imports DeepSpeed whenever it is installed, which on a machine without a
        # GPU logs a guess about DeepSpeed's own device that says nothing about this run
        from tiledmlp.integrations.deepspeed import quiet_accelerator_guess

        quiet_accelerator_guess()
    preflight(opts, launch)


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
    # the picture last: the line a user looks for once the run ends
    if s.get("curve") is not None:
        show(f"curve: {s['curve']}")
    elif s.get("curve_note") is not None:
        show(s["curve_note"])


def _tiles_text(counts: dict[str, int], what: str) -> str:
    """', 4 tiles per MLP' (or a range, '2-4 tiles per MLP'); '' when nothing was tiled."""
    tiles = sorted(set(counts.values()))
    if not tiles:
        return ""
    n = str(tiles[0]) if len(tiles) == 1 else f"{tiles[0]}-{tiles[-1]}"
    return f", {n} tile{'s' if tiles[-1] != 1 else ''} per {what}"
