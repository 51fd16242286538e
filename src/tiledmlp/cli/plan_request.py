"""`tiledmlp plan`'s request as the planner takes it: the model `tiledmlp train --model` builds
and the StepSpec its pre-flight plans for the same flags (train/step_request.py), placed as
plan's flags say.

Invariant: `plan` and `train`'s pre-flight plan the same step for the same flags.
"""

from __future__ import annotations

from typing import Any

from tiledmlp.cli.common import UsageError
from tiledmlp.cli.plan_args import PlanArgs

__all__ = ["model_config_of", "model_request_of", "rows_of", "run_options", "step_of"]


def model_request_of(args: PlanArgs) -> Any:
    """The model `tiledmlp train --model` trains at --seq-len (train/step_request.py), or None."""
    from tiledmlp.train.step_request import model_request

    return model_request(str(args.model), args.seq_len)


def run_options(args: PlanArgs) -> Any:
    """The TrainOptions of `tiledmlp train` with plan's flags that matter to memory."""
    from pathlib import Path

    from tiledmlp.train.options import options_from

    model = str(args.model)
    if Path(model).is_dir():  # plan reads its config.json alone (train would want weights)
        model = str(Path(model) / "config.json")
    values: dict[str, Any] = {
        "model": model,
        "seq_len": args.seq_len,
        "dtype": args.dtype,
        "gradient_checkpointing": args.gradient_checkpointing,
        "num_tiles": str(args.num_tiles),
        "preflight": False,
    }
    if args.attention_kernel.name != "auto":  # a named kernel is train's option too
        values["attention_kernel"] = args.attention_kernel.name
    if args.sequence_parallel_size > 1:
        values["sequence_parallel_size"] = args.sequence_parallel_size
    if args.every_n_layers > 1:  # train's check: it needs --gradient-checkpointing
        values["every_n_layers"] = args.every_n_layers
    try:
        return options_from(values)
    except ValueError as e:
        raise UsageError(str(e)) from None


def step_of(args: PlanArgs) -> Any:
    """The StepSpec that `tiledmlp train`'s pre-flight plans for the same flags: the request
    train/step_request.py builds from them, placed as plan's flags say."""
    import dataclasses

    from tiledmlp.train.step_request import Placement, Unplanned, step_request

    where = Placement(
        device_type=args.device,
        engine=args.engine,
        optimizer=args.optimizer,
        offload_params=args.offload_params,
        expandable_segments=args.expandable_segments,
    )
    opts = run_options(args)
    try:
        step = step_request(opts, where).step
    except Unplanned as e:
        raise UsageError(str(e)) from None
    # the tile policy as plan was given it (train parses the same text into the same policy)
    return dataclasses.replace(step, tiles=args.num_tiles)


def model_config_of(args: PlanArgs) -> Any:
    """The transformers config of --model: a preset as `tiledmlp train` builds it (its byte
    tokenizer's vocabulary), a config.json as written.

    Raises:
        ValueError: neither a preset nor a readable config (load_config's one line).
    """
    from tiledmlp.plan.layer import load_config

    config = load_config(str(args.model))  # refuses a name that is neither, in one line
    model = model_request_of(args)
    if model is not None and model.preset is not None:  # the model train builds
        from tiledmlp.models.build import llama_config

        return llama_config(**model.preset)
    return config


def rows_of(args: PlanArgs, stacks: tuple[str, ...]) -> tuple[str, ...]:
    """The plan's rows for `stacks` (config/stacks.py's StackRow names), planned over a step
    checkpointing every layer without transformers' offload: each stack; with --every-n-layers
    N > 1, each stack every N-th layer; with --transformers-offload, each stack that does not
    offload with tiledmlp's offloader (where it does, that one owns the job: the stack's own
    row), with transformers' offload (and every N-th layer)."""
    from tiledmlp.config.stacks import STACK_PATCHES, StackRow

    everies = (1, args.every_n_layers) if args.every_n_layers > 1 else (1,)
    rows = []
    for stack in stacks:
        patch = STACK_PATCHES[stack]
        offloads: tuple[bool, ...] = (False,)
        if args.transformers_offload and not (patch is not None and patch.activation_offloading):
            offloads = (False, True)
        rows += [StackRow(stack, n, o).name for o in offloads for n in everies]
    return tuple(rows)
