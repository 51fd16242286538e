"""`tiledmlp plan`: peak memory of an MLP, a decoder layer and a whole training step, untiled
and tiled, estimated on fake tensors (nothing allocated, no GPU needed).

Invariant: the estimate depends only on shapes, dtypes and flags, never on this machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from typing import Any

from tiledmlp.cli.common import UsageError
from tiledmlp.cli.flags import add_config_flags
from tiledmlp.cli.output import StderrHandler, show
from tiledmlp.cli.plan_args import PlanArgs
from tiledmlp.cli.plan_kernels import plan_with_kernels
from tiledmlp.cli.plan_report import show_text
from tiledmlp.cli.plan_request import model_config_of, model_request_of, rows_of, step_of
from tiledmlp.config.gpus import GPUS
from tiledmlp.ops.tiling.values import check_positive_number

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Adds `plan` to the subcommands."""
    pl = sub.add_parser(
        "plan",
        help="estimate peak memory untiled vs tiled (an MLP, a decoder layer, a whole training "
        "step), without a GPU",
        description=(
            "Estimates peak device memory on fake tensors (nothing is allocated, nothing "
            "downloaded): of one SwiGLU MLP's forward + backward, untiled and tiled; with "
            "--model, also of one decoder layer and of a whole training step (forward, loss, "
            "backward, optimizer step) for each stack: untiled, tiled_mlp, tiled_mlp_loss, "
            "tiled_mlp_loss_offload, tiled_mlp_loss_offload_norms and tiled_layer; --engine "
            "zero3 or fsdp2 "
            "shards weights, gradients and optimizer states over the GPUs, --offload-params "
            "keeps them on the host. With --memory-gb, the longest sequence each stack fits (minutes for a large model: progress on stderr). "
            "With --budget-gb, the fewest tiles with which the MLP alone fits."
        ),
    )
    groups = ("what to plan", "tiling", "the whole training step (with --model)",
              "the run's features (tiledmlp train's flags; with --model)", "output")  # fmt: skip
    where = {title: pl.add_argument_group(title) for title in groups}
    # every flag from PlanArgs' schema
    add_config_flags(where, PlanArgs)


def _progress_on_stderr() -> None:
    """The planner's progress (logged at INFO by plan/model.py) as `tiledmlp plan: ...` lines on
    stderr, with or without -v: a whole-model plan with --memory-gb takes minutes."""
    log = logging.getLogger("tiledmlp.plan")
    if not any(getattr(h, "_tiledmlp_plan", False) for h in log.handlers):
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("tiledmlp plan: %(message)s"))
        handler._tiledmlp_plan = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def run(parsed: argparse.Namespace) -> int:
    """Runs `tiledmlp plan`: from the cache when the same question was answered before
    (plan/cache.py: no model is built, transformers is not imported), else planned and kept."""
    _progress_on_stderr()
    args = PlanArgs.of(parsed)  # the request, typed once; nothing below writes to it
    _check_flags(args)
    key = None if args.measure else _cache_key(args)  # a measurement is never reused
    from tiledmlp.plan import cache

    found = None if key is None else cache.load(key)
    if found is None:
        found = _plan(args)
        if key is not None:
            cache.store(key, found)
    result, hidden, intermediate = found["result"], found["hidden"], found["intermediate"]
    if "model_name" in result:  # the same configuration may be reached by another name
        result["model_name"] = args.model
    line = None
    if args.model is not None:
        from tiledmlp.cli.plan_advice import replanner
        from tiledmlp.cli.plan_bottom_line import bottom_line

        line = bottom_line(args, result["model"], replanner())
    if args.json:
        show(json.dumps(result if line is None else {**result, "bottom_line": line}))
        return 0
    show_text(args, result, hidden, intermediate, whole_model=config_given(args))
    if line is not None:
        from tiledmlp.cli.plan_bottom_line import show_bottom_line

        show_bottom_line(args, line)
    return 0


def config_given(args: PlanArgs) -> bool:
    """Whether the whole model is planned (--model)."""
    return args.model is not None


_NOT_ASKED = ("json", "verbose", "command", "argv", "gpu")  # flags that do not change the plan


def _cache_key(args: PlanArgs) -> str | None:
    """The plan's cache key: the model's configuration as written and every flag that changes
    the answer; None when the model's configuration cannot be read (load_config says why)."""
    from tiledmlp.plan.cache import cache_key

    fields: dict[str, Any] = {"mlp": True}
    if args.model is not None:
        model = model_request_of(args)
        if model is None:
            return None
        fields = model.fields
    options = {k: v for k, v in sorted(args.asked().items()) if k not in _NOT_ASKED}
    options.pop("model", None)  # the configuration, not the name, decides the answer
    return cache_key("plan", fields, options)


def _plan(args: PlanArgs) -> dict[str, Any]:
    """The plan's result (the JSON's keys) with the MLP's shape, planned."""
    import torch

    from tiledmlp.plan.mlp import plan_mlp

    dtype = getattr(torch, args.dtype)
    config, hidden, intermediate = _shape(args)
    result = plan_mlp(
        hidden=hidden,
        intermediate=intermediate,
        seq_len=args.seq_len,
        dtype=dtype,
        tiles=args.num_tiles,
        budget_bytes=None if args.budget_gb is None else int(args.budget_gb * 2**30),
        device_type=args.device,
    )
    if config is not None:
        result.update(_plan_model(args, config, dtype))
    return {"result": result, "hidden": hidden, "intermediate": intermediate}


def _check_flags(args: PlanArgs) -> None:
    """Refuses flag values and combinations `plan` cannot use."""
    for flag, value in (("--budget-gb", args.budget_gb), ("--memory-gb", args.memory_gb)):
        if value is not None:
            check_positive_number(flag, value)
    whole = (
        ("--gradient-checkpointing", args.gradient_checkpointing),
        ("--optimizer", args.optimizer != "adamw" and not args.offload_params),
        ("the feature flags", args.run_stack is not None),
        ("--memory-gb", args.memory_gb is not None),
        ("--sequence-parallel-size", args.sequence_parallel_size != 1),
        ("--engine", args.engine != "ddp"),
        ("--stacks", args.stacks is not None),
        ("--gpu", args.gpu is not None),
        ("--offload-params", args.offload_params),
        ("--expandable-segments", args.expandable_segments is not True),
        ("--measure", args.measure),
        ("--every-n-layers", args.every_n_layers != 1),
        ("--transformers-offload", args.transformers_offload),
        ("--recipe", args.recipe is not None),
    )
    if args.model is None and any(on for _, on in whole):
        names = " and ".join(n for n, on in whole if on)
        raise UsageError(f"{names} plan a whole model: add --model NAME_OR_PATH")
    if args.gpu is not None and args.memory_gb is not None:
        raise UsageError(
            f"give --gpu or --memory-gb, not both: --gpu {args.gpu} is a card of "
            f"{GPUS[args.gpu].gib:.1f} GiB"
        )
    if args.measure and not args.gradient_checkpointing:
        raise UsageError(
            "--measure runs the model's checkpointed step: add --gradient-checkpointing"
        )
    if args.measure and args.num_tiles.rule != "auto":
        raise UsageError(
            "--measure runs the model as patch_model's default tile policy ('auto') tiles it: "
            "drop --num-tiles and --tile-budget-gb"
        )
    if args.measure and (args.every_n_layers != 1 or args.transformers_offload):
        raise UsageError(
            "--measure runs each stack checkpointing every layer on the device: drop "
            "--every-n-layers and --transformers-offload"
        )
    if args.measure and (args.sequence_parallel_size != 1 or args.engine != "ddp"):
        raise UsageError(
            "--measure runs one GPU's step without sharding: drop --sequence-parallel-size "
            "and --engine"
        )
    if args.measure and args.device == "cuda":
        import torch

        if not torch.cuda.is_available():  # before any planning: the measure needs the card
            raise UsageError(
                "--measure on cuda needs a visible GPU; add --device cpu to measure on the CPU"
            )
    from tiledmlp.plan.engines import check_engine

    try:
        check_engine(args.engine, offload_params=args.offload_params, optimizer=args.optimizer)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _shape(args: PlanArgs) -> tuple[Any, int, int]:
    """(the model's config or None, hidden, intermediate) from --model or --hidden and
    --intermediate."""
    config = None
    if args.model is None:
        hidden = 4096 if args.hidden is None else args.hidden
        intermediate = 14336 if args.intermediate is None else args.intermediate
    else:
        from tiledmlp.plan.layer import mlp_shape

        given = [f for f, v in (("--hidden", args.hidden), ("--intermediate", args.intermediate))
                 if v is not None]  # fmt: skip
        if given:
            raise UsageError(
                f"give --model or {' and '.join(given)}, not both: with --model the MLP shape "
                "comes from the model's config"
            )
        config = model_config_of(args)
        hidden, intermediate = mlp_shape(config)
    return config, hidden, intermediate


def _plan_model(args: PlanArgs, config: Any, dtype: Any) -> dict[str, Any]:
    """The decoder layer's and the whole model's figures (the keys --model adds to the JSON)."""
    import dataclasses

    from tiledmlp.plan.layer import RoutedExperts, plan_layer

    # the rows set every_n_layers and transformers' offload over a step that sets neither
    step = dataclasses.replace(step_of(args), every_n_layers=1, transformers_offload=False)
    try:
        layer = plan_layer(config, step)
    except RoutedExperts:  # one layer's figures are for dense MLPs; the step plans the experts
        model_type = getattr(config.get_text_config(), "model_type", "")
        layer = {"model_type": model_type, "tiles": None, "regular_mib": None,
                 "tiled_mib": None, "saving": None}  # fmt: skip
    from tiledmlp.plan.model import STACKS, plan_model

    known_peaks: dict[str, dict[int, int]] = {}
    options = dict(
        step=step,
        budget_bytes=None if args.memory_gb is None else int(args.memory_gb * 2**30),
        processes=None,  # the stacks in parallel, one process per CPU (plan/forked.py)
        stacks=rows_of(args, STACKS if args.stacks is None else args.stacks),
    )
    if args.measure:  # the estimates by length go on to the measurement's fit
        planner: Any = functools.partial(plan_model, known_peaks=known_peaks)
    else:  # each stack from the cache where an earlier plan or pre-flight of this model made it
        from tiledmlp.plan.cached import plan_stacks

        model = model_request_of(args)
        planner = functools.partial(plan_stacks, fields=None if model is None else model.fields)
    # the attention kernel's buffers: --attention-kernel (cli/plan_kernels.py)
    request: Any = args  # read by attribute, as the flags are named
    stacks = plan_with_kernels(planner, config, request, dtype.itemsize, options)
    if args.measure:
        from tiledmlp.cli.plan_measure import measure_stacks

        measure_stacks(args, config, dtype, stacks, known_peaks)
    from tiledmlp.plan.engines import GPUS_PER_NODE

    return dict(
        model_name=args.model,
        model=stacks,
        optimizer=args.optimizer,
        gradient_checkpointing=args.gradient_checkpointing,
        every_n_layers=args.every_n_layers,
        transformers_offload=args.transformers_offload,
        recipe=args.recipe,
        memory_gb=args.memory_gb,
        device=args.device,
        sequence_parallel_size=args.sequence_parallel_size,
        engine=args.engine,
        offload_params=args.offload_params,
        expandable_segments=args.expandable_segments,
        gpus_per_node=min(args.sequence_parallel_size, GPUS_PER_NODE),
        model_type=layer["model_type"],
        layer_tiles=layer["tiles"],
        layer_regular_mib=layer["regular_mib"],
        layer_tiled_mib=layer["tiled_mib"],
        layer_saving=layer["saving"],
    )
