"""`tiledmlp check`: one training step of the user's model, unpatched and patched as asked, from
the same weights and batch, compared loss by loss and gradient by gradient (train/check_run.py
runs it, tiledmlp.check compares); a one-screen verdict.

The options are `tiledmlp train`'s (the same flags, declared once in cli/train.py, and the same
--config FILE keys), with the check's own defaults: --seq-len 256 and --gradient-accumulation-steps
2. Exit status: 0 pass, 1 fail, 2 bad input (one line).

Invariant: `--json` prints one JSON object (CheckResult.as_dict) on the last stdout line, on rank
0 only; every rank exits with the same status.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from tiledmlp.cli.output import show
from tiledmlp.cli.train import (
    _add_distributed_flags,
    _add_tiling_flags,
    _Adder,
    _Groups,
    add_model_flags,
    option_values,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Adds `check` to the subcommands (options default to 'not given', as train's)."""
    c = sub.add_parser(
        "check",
        argument_default=argparse.SUPPRESS,
        help="check the tiling on your model, dtype and engine: one training step unpatched and "
        "patched, every gradient compared",
        description=(
            "Runs one training step (gradient accumulation over 2 micro-batches of random "
            "token ids) of the model twice from the same weights, unpatched and patched as "
            "asked, and a float64 reference, and compares the loss and every parameter's "
            "gradient: the tiled step's error against the reference may be at most twice the "
            "untiled step's (plus rounding). Takes tiledmlp train's options (--config FILE "
            "too); under torchrun it runs DDP or FSDP2 (--fsdp full_shard). Exit status 0 pass, "
            "1 fail, 2 bad input."
        ),
    )
    c.add_argument("--config", type=Path, metavar="FILE", help="YAML or JSON file of tiledmlp "
                   "train's options (flags override it)")  # fmt: skip
    groups = _Groups(
        model=_Adder(c.add_argument_group("model")),
        data=_Adder(c.add_argument_group("the step")),
        tiling=_Adder(c.add_argument_group("tiling")),
        long=_Adder(c.add_argument_group("long context")),
        dist=_Adder(c.add_argument_group("distributed (under torchrun)")),
        training=_Adder(c),
        output=_Adder(c),
        preflight=_Adder(c),  # check plans nothing: no pre-flight flags
        hidden=_Adder(c),
    )
    add_model_flags(groups.model)
    step = groups.data
    step("--seq-len", help="tokens per sequence (default: 256, short: the tiles' logic, not the "
         "length, is what is checked)")  # fmt: skip
    step("--per-device-train-batch-size", help="sequences per micro-batch and process "
         "(default: 1)")  # fmt: skip
    groups.hidden("--batch-size", dest="per_device_train_batch_size", help=argparse.SUPPRESS)
    step("--gradient-accumulation-steps", help="micro-batches per step, at least 2 (default: 2)")
    _add_tiling_flags(groups)
    _add_distributed_flags(groups)
    c.add_argument("--json", action="store_true", default=False,
                   help="print the verdict as one JSON object on stdout")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Runs `tiledmlp check`: 0 pass, 1 fail."""
    from tiledmlp.train.check_run import CHECK_MICRO_BATCHES, CHECK_SEQ_LEN
    from tiledmlp.train.options import options_from

    values = option_values(args)
    seq_len_given = "seq_len" in values
    values.setdefault("seq_len", CHECK_SEQ_LEN)
    values.setdefault("gradient_accumulation_steps", CHECK_MICRO_BATCHES)
    opts = options_from(values)
    from tiledmlp.train.check_run import run_check  # after the options: imports take seconds

    result = run_check(opts, seq_len_given=seq_len_given)
    if int(os.environ.get("RANK", "0")) == 0:
        show(json.dumps(result.as_dict()) if args.json else result.text())
    return 0 if result.passed else 1
