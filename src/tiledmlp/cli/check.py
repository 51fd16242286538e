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

from tiledmlp.cli.flags import RUN_GROUPS, add_field_flags, add_run_flags
from tiledmlp.cli.output import show
from tiledmlp.cli.train import option_values

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
    model = c.add_argument_group("model")
    step = c.add_argument_group("the step")
    where = {s: c.add_argument_group(RUN_GROUPS[s]) for s in ("tiling", "long context",
                                                                "distributed")}  # fmt: skip
    from tiledmlp.train.options import DEFAULT_PATCH

    # train's flags, from the schema: the model, the tiling and the engines (the check plans
    # nothing, reads no data and saves nothing: no data, training, output or pre-flight flags)
    add_run_flags({"model": model}, c, skip=("patch",))
    add_field_flags(step, c, "seq_len", help="tokens per sequence (default: 256, short: the "
                    "tiles' logic, not the length, is what is checked)")  # fmt: skip
    add_field_flags(step, c, "per_device_train_batch_size")
    add_field_flags(step, c, "gradient_accumulation_steps", help="micro-batches per step, at "
                    "least 2 (default: 2)")  # fmt: skip
    add_run_flags(where, c, patch_defaults=DEFAULT_PATCH)
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
