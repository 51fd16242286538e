"""`tiledmlp plan`: peak memory of an MLP, a decoder layer and a whole training step, untiled
and tiled, estimated on fake tensors (nothing allocated, no GPU needed).

Invariant: the estimate depends only on shapes, dtypes and flags, never on this machine.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tiledmlp.cli.common import DTYPE_CHOICES, UsageError, dtype_name, positive_int, tiles

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Adds `plan` to the subcommands."""
    pl = sub.add_parser(
        "plan",
        help="estimate MLP (and decoder layer) peak memory untiled vs tiled, without a GPU",
        description=(
            "Estimates the peak memory of a SwiGLU MLP's forward + backward (weights, grads, "
            "input, output and their gradients included) on fake tensors: nothing is allocated. "
            "With --model, also of one decoder layer of that model (SDPA attention, O(seq) "
            "memory like flash attention), with its MLP untiled and tiled. With --budget-gb, "
            "recommends the fewest tiles (powers of two) that fit."
        ),
    )
    pl.add_argument(
        "--model",
        default=None,
        metavar="NAME_OR_PATH",
        help="a preset (llama3-8b, small, tiny) or a Hugging Face config.json (or a directory "
        "holding one): take the MLP shape from it and also estimate one decoder layer; "
        "nothing is downloaded",
    )
    pl.add_argument(
        "--hidden",
        type=positive_int,
        default=None,
        help="hidden size (default: 4096; not with --model)",
    )
    pl.add_argument(
        "--intermediate",
        type=positive_int,
        default=None,
        help="intermediate size (default: 14336, Llama-3-8B; not with --model)",
    )
    pl.add_argument("--seq-len", type=positive_int, default=131072, help="tokens (default: 131072)")
    pl.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default="bfloat16", help="dtype (default: bfloat16)"
    )
    pl.add_argument(
        "--num-tiles",
        type=tiles,
        default="auto",
        help="tile policy to estimate: an int, 'auto' or 'arctic' (default: auto)",
    )
    pl.add_argument(
        "--tile-budget-gb",
        type=float,
        default=None,
        metavar="GB",
        help="estimate the memory-target policy: each MLP's working memory within GB GiB (the "
        "same as --num-tiles target:<GB>)",
    )
    pl.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="the device to plan for: 'auto' picks fewer, larger tiles on a GPU than on the "
        "CPU (default: cuda)",
    )
    pl.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="memory budget in GiB: recommend the fewest tiles with which the MLP alone fits "
        "(also with --model: the recommendation is for the MLP, not the layer)",
    )
    pl.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="with --model: the whole-model step uses the model's own non-reentrant "
        "checkpointing (the offloading stack always does)",
    )
    pl.add_argument(
        "--optimizer",
        choices=("none", "adamw", "cpu-offload"),
        default="none",
        help="with --model: optimizer state on the device: none, adamw (two states per "
        "parameter, in its dtype), cpu-offload (states on the host) (default: none)",
    )
    pl.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="with --model: the card's memory in GiB (e.g. 79.2 for an H100 80GB, as torch "
        "reports it); report each stack's longest sequence whose step, with the device "
        "overhead (CUDA context, cuBLAS workspaces, attention backward buffers, allocator; "
        "zero with --device cpu), fits (max_seq_len, a multiple of 1024)",
    )
    pl.add_argument(
        "--sequence-parallel-size",
        type=positive_int,
        default=1,
        metavar="P",
        help="with --model: the sequence split over P GPUs (Ulysses); figures per GPU, "
        "max_seq_len for the whole sequence (default: 1)",
    )
    pl.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Runs `tiledmlp plan`."""
    import torch

    from tiledmlp.plan.mlp import plan_mlp

    if args.budget_gb is not None and args.budget_gb <= 0:
        raise UsageError(f"--budget-gb must be positive, got {args.budget_gb}")
    if args.memory_gb is not None and args.memory_gb <= 0:
        raise UsageError(f"--memory-gb must be positive, got {args.memory_gb}")
    if args.tile_budget_gb is not None:
        from tiledmlp.patching.args import parse_budget_gb

        try:
            target = parse_budget_gb(args.tile_budget_gb, "--tile-budget-gb")
        except ValueError as e:
            raise UsageError(str(e)) from None
        if args.num_tiles not in ("auto", target):
            raise UsageError(
                f"give --num-tiles {args.num_tiles} or --tile-budget-gb {args.tile_budget_gb}, "
                "not both"
            )
        args.num_tiles = target
    whole = (
        ("--gradient-checkpointing", args.gradient_checkpointing),
        (
            "--optimizer",
            args.optimizer != "none",
        ),
        ("--memory-gb", args.memory_gb is not None),
        ("--sequence-parallel-size", args.sequence_parallel_size != 1),
    )
    if args.model is None and any(on for _, on in whole):
        names = " and ".join(n for n, on in whole if on)
        raise UsageError(f"{names} plan a whole model: add --model NAME_OR_PATH")
    args.dtype = dtype_name(args.dtype)
    dtype = getattr(torch, args.dtype)
    config = None
    if args.model is None:
        hidden = 4096 if args.hidden is None else args.hidden
        intermediate = 14336 if args.intermediate is None else args.intermediate
    else:
        from tiledmlp.plan.layer import load_config, mlp_shape

        given = [f for f, v in (("--hidden", args.hidden), ("--intermediate", args.intermediate))
                 if v is not None]  # fmt: skip
        if given:
            raise UsageError(
                f"give --model or {' and '.join(given)}, not both: with --model the MLP shape "
                "comes from the model's config"
            )
        config = load_config(args.model)
        hidden, intermediate = mlp_shape(config)
    result = plan_mlp(
        hidden=hidden,
        intermediate=intermediate,
        seq_len=args.seq_len,
        dtype=dtype,
        num_tiles=args.num_tiles,
        budget_bytes=None if args.budget_gb is None else int(args.budget_gb * 2**30),
        device_type=args.device,
    )
    if config is not None:
        from tiledmlp.plan.layer import plan_layer

        layer = plan_layer(
            config,
            seq_len=args.seq_len,
            dtype=dtype,
            num_tiles=args.num_tiles,
            device_type=args.device,
        )
        from tiledmlp.plan.model import plan_model

        stacks = plan_model(
            config,
            seq_len=args.seq_len,
            dtype=dtype,
            checkpointing=args.gradient_checkpointing,
            optimizer=args.optimizer,
            num_tiles=args.num_tiles,
            budget_bytes=None if args.memory_gb is None else int(args.memory_gb * 2**30),
            device_type=args.device,
            sequence_parallel_size=args.sequence_parallel_size,
        )
        result.update(
            model_name=args.model,
            model=stacks,
            optimizer=args.optimizer,
            gradient_checkpointing=args.gradient_checkpointing,
            memory_gb=args.memory_gb,
            device=args.device,
            sequence_parallel_size=args.sequence_parallel_size,
            model_type=layer["model_type"],
            layer_tiles=layer["tiles"],
            layer_regular_mib=layer["regular_mib"],
            layer_tiled_mib=layer["tiled_mib"],
            layer_saving=layer["saving"],
        )
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"SwiGLU MLP hidden {hidden}, intermediate {intermediate}, {args.seq_len} tokens, "
        f"{args.dtype}: untiled {result['regular_mib']:,.1f} MiB, tiled ({args.num_tiles}: "
        f"{result['tiles']} tiles) {result['tiled_mib']:,.1f} MiB ({100 * result['saving']:.1f}% less)"
    )
    if config is not None:
        print(
            f"one decoder layer of {args.model} ({result['model_type']}, SDPA attention): "
            f"untiled {result['layer_regular_mib']:,.1f} MiB, MLP tiled ({args.num_tiles}: "
            f"{result['layer_tiles']} tiles) {result['layer_tiled_mib']:,.1f} MiB "
            f"({100 * result['layer_saving']:.1f}% less)"
        )
        print(
            f"one training step of the whole model ({args.optimizer} optimizer"
            + (", checkpointing" if args.gradient_checkpointing else "")
            + (
                f", the sequence split over {args.sequence_parallel_size} GPUs"
                if args.sequence_parallel_size > 1
                else ""
            )
            + "), peak device MiB"
            + (" per GPU:" if args.sequence_parallel_size > 1 else ":")
        )
        for stack, entry in result["model"].items():
            parts = ", ".join(f"{k} {v:,.0f}" for k, v in entry["breakdown_mib"].items() if v)
            if entry["device_overhead_mib"]:
                parts += f"; + device overhead {entry['device_overhead_mib']:,.0f}"
            fits = (
                f"; fits {args.memory_gb} GiB up to {entry['max_seq_len']:,} tokens"
                if "max_seq_len" in entry
                else ""
            )
            print(f"  {stack:24s} {entry['peak_mib']:>12,.0f}  ({parts}){fits}")
    if args.budget_gb is not None:
        k = result["recommended_num_tiles"]
        if k is None:
            print(
                f"no tile count fits {args.budget_gb} GiB (the weights, input and gradients alone may not)"
            )
        elif k == 0:
            print(f"fits {args.budget_gb} GiB untiled")
        else:
            print(
                f"fits {args.budget_gb} GiB with --num-tiles {k} ({result['recommended_mib']:,.1f} MiB)"
            )
    return 0
