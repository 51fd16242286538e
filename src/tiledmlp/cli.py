"""Command-line interface: `tiledmlp train`, `tiledmlp bench` and `tiledmlp env`.

Sits on top of everything; nothing imports it. Errors in user input end with a one-line message
and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

logger = logging.getLogger("tiledmlp")


class UsageError(Exception):
    """A bad flag value: reported in one line, exit status 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _tiles(text: str) -> int | str:
    from tiledmlp.patching.args import parse_tiles

    try:
        return parse_tiles(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, 'auto' or 'arctic', got {text!r}"
        ) from None


def _seq_lens(text: str) -> tuple[int, ...]:
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(
            "expected comma-separated sequence lengths, e.g. 1024,4096"
        )
    return tuple(_positive_int(p.strip()) for p in parts)


_DTYPES = ("float32", "bfloat16", "float16")
_CPU_SEQ_LENS = (1024, 2048, 4096, 8192)
_GPU_SEQ_LENS = (2048, 4096, 8192, 16384, 32768, 65536, 131072)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiledmlp",
        description="Tiled MLPs for long-sequence training: benchmark and inspect.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = sub.add_parser(
        "bench",
        help="the tiled-MLP table: time and peak memory of regular vs tiled MLP, and a plot",
        description=(
            "Measures a SwiGLU MLP's forward + backward for a sweep of sequence lengths, regular "
            "(untiled) vs tiled (and DeepSpeed's TiledMLP when installed): median time of "
            "repeated steps, tensor-level peak memory, FLOPs; on the CPU each measurement runs "
            "in a fresh process. Writes bench.jsonl (one record per length and variant), "
            "bench.md (Seq Length | Regular (ms) | Tiled (ms) | Speed (+%%) | Regular (MB) | "
            "Tiled (MB) | Memory (-%%)) and bench.png (memory and time against length)."
        ),
    )
    bench.add_argument(
        "--hidden",
        type=_positive_int,
        default=None,
        help="hidden size (default: 4096 on an accelerator, 512 on CPU)",
    )
    bench.add_argument(
        "--intermediate",
        type=_positive_int,
        default=None,
        help="intermediate size (default: 12288 on an accelerator, 1536 on CPU)",
    )
    bench.add_argument(
        "--seq-lens",
        type=_seq_lens,
        default=None,
        help="comma-separated tokens per sequence (default: 2048..131072 on an accelerator, "
        f"{','.join(map(str, _CPU_SEQ_LENS))} on CPU)",
    )
    bench.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="dtype of weights and activations (default: bfloat16 on an accelerator, float32 on "
        "CPU)",
    )
    bench.add_argument(
        "--num-tiles",
        type=_tiles,
        default="arctic",
        help="tiles for the tiled variants: an int, 'auto' or 'arctic' (default: "
        "arctic, ceil(tokens/hidden); DeepSpeed gets the same count, or the "
        "arctic count when this is 'auto')",
    )
    bench.add_argument(
        "--deepspeed",
        choices=("auto", "on", "off"),
        default="auto",
        help="include DeepSpeed's TiledMLP: auto (if installed), on, off",
    )
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        help="timed repeats per variant; the median is reported (default: 3)",
    )
    bench.add_argument(
        "--warmup", type=int, default=1, help="untimed runs per variant (default: 1)"
    )
    bench.add_argument(
        "--device",
        default=None,
        help="cpu, cuda, npu, ... (default: the first accelerator found, else cpu)",
    )
    bench.add_argument(
        "--isolate",
        choices=("auto", "on", "off"),
        default="auto",
        help="run each measurement in a fresh process: auto (on for CPU), on, off",
    )
    bench.add_argument(
        "--no-plot", action="store_true", help="do not write bench.png (needs matplotlib)"
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("bench-out"),
        help="folder for bench.jsonl, bench.md and bench.png (default: ./bench-out)",
    )

    _add_train(sub)
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
        type=_positive_int,
        default=None,
        help="hidden size (default: 4096; not with --model)",
    )
    pl.add_argument(
        "--intermediate",
        type=_positive_int,
        default=None,
        help="intermediate size (default: 14336, Llama-3-8B; not with --model)",
    )
    pl.add_argument(
        "--seq-len", type=_positive_int, default=131072, help="tokens (default: 131072)"
    )
    pl.add_argument(
        "--dtype", choices=_DTYPES, default="bfloat16", help="dtype (default: bfloat16)"
    )
    pl.add_argument(
        "--num-tiles",
        type=_tiles,
        default="auto",
        help="tile policy to estimate: an int, 'auto' or 'arctic' (default: auto)",
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
        help="with --model: device memory in GiB; report each stack's longest sequence that "
        "fits (max_seq_len, a multiple of 1024)",
    )
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    sub.add_parser(
        "env",
        help="versions and devices, for bug reports",
        description="Prints versions of Python, torch and optional packages, and devices.",
    )
    return parser


def _bool(text: str) -> bool:
    from tiledmlp.patching.args import parse_bool

    try:
        return parse_bool(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}") from None


def _add_train(sub: Any) -> None:
    from tiledmlp.train.presets import PRESETS

    t = sub.add_parser(
        "train",
        help="fine-tune a causal LM at long context with tiled MLPs (the main job)",
        description=(
            "Trains a causal LM on packed token sequences with tiled MLPs and the tiled loss. "
            "Default: the 'tiny' preset (random init from a config) on the Python standard "
            "library's own source code, byte-level tokens, nothing downloaded. Under torchrun it "
            "runs DDP (default), FSDP2 or DeepSpeed."
        ),
    )
    t.add_argument(
        "--model",
        default="tiny",
        help=f"a preset ({', '.join(sorted(PRESETS))}) or a local model directory (default: tiny)",
    )
    t.add_argument(
        "--data",
        type=Path,
        default=None,
        help="a local .txt or .jsonl (field 'text') file (default: the Python stdlib source)",
    )
    t.add_argument(
        "--seq-len", type=_positive_int, default=2048, help="tokens per sequence (default: 2048)"
    )
    t.add_argument(
        "--batch-size",
        type=_positive_int,
        default=1,
        help="sequences per step and rank (default: 1)",
    )
    t.add_argument("--steps", type=_positive_int, default=12, help="optimizer steps (default: 12)")
    t.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default: 2e-3)")
    t.add_argument(
        "--use_tiled_mlp",
        type=_bool,
        default=True,
        metavar="true|false",
        help="tile the MLPs (and the loss) (default: true)",
    )
    t.add_argument(
        "--tiled_mlp_num_shards",
        type=_tiles,
        default=None,
        metavar="N",
        help="tiles per MLP, the seeds' name for --num-tiles",
    )
    t.add_argument(
        "--num-tiles",
        type=_tiles,
        default="auto",
        help="tiles per MLP: an int, 'auto' or 'arctic' (default: auto)",
    )
    t.add_argument(
        "--tiled-loss",
        type=_bool,
        default=True,
        metavar="true|false",
        help="compute the loss with tiled_cross_entropy when tiling (default: true)",
    )
    t.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="the model's own (non-reentrant) gradient checkpointing",
    )
    t.add_argument(
        "--activation-offloading",
        action="store_true",
        help="keep the checkpointed layers' inputs in host memory between forward and "
        "recompute (needs --gradient-checkpointing)",
    )
    t.add_argument(
        "--tiled-norms",
        action="store_true",
        help="also tile the LayerNorm/RMSNorm layers (their float32 intermediates one tile at "
        "a time; with --use_tiled_mlp)",
    )
    t.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights and activations (default: float32)",
    )
    t.add_argument(
        "--engine",
        choices=("auto", "single", "ddp", "fsdp2", "deepspeed"),
        default="auto",
        help="auto: single process, or DDP under torchrun (default: auto)",
    )
    t.add_argument(
        "--deepspeed-config",
        type=Path,
        default=None,
        help="DeepSpeed JSON config (--engine deepspeed)",
    )
    t.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="save_pretrained the trained model and summary.json here",
    )
    t.add_argument("--seed", type=int, default=0, help="model init seed (default: 0)")
    t.add_argument(
        "--max-data-bytes",
        type=_positive_int,
        default=4_000_000,
        help="read at most about this much text (default: 4000000)",
    )
    t.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _cmd_train(args: argparse.Namespace) -> int:
    from tiledmlp.train.loop import TrainConfig, run

    if args.tiled_mlp_num_shards is not None and args.num_tiles != "auto":
        raise UsageError("give --tiled_mlp_num_shards or --num-tiles, not both")
    if args.deepspeed_config is not None and not args.deepspeed_config.is_file():
        raise UsageError(f"--deepspeed-config: {args.deepspeed_config} is not a file")
    cfg = TrainConfig(
        model=args.model,
        data=args.data,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        steps=args.steps,
        lr=args.lr,
        use_tiled_mlp=args.use_tiled_mlp,
        num_tiles=args.tiled_mlp_num_shards
        if args.tiled_mlp_num_shards is not None
        else args.num_tiles,
        tiled_loss=args.tiled_loss,
        gradient_checkpointing=args.gradient_checkpointing,
        activation_offloading=args.activation_offloading,
        tiled_norms=args.tiled_norms,
        dtype=args.dtype,
        engine=args.engine,
        deepspeed_config=args.deepspeed_config,
        output_dir=args.output_dir,
        seed=args.seed,
        max_data_bytes=args.max_data_bytes,
    )
    summary = run(cfg)
    if int(__import__("os").environ.get("RANK", "0")) != 0:
        return 0
    if args.json:
        print(json.dumps(summary))
    else:
        tiled = (
            "tiled MLPs" + (" + tiled loss" if summary["tiled_loss"] else "")
            if cfg.use_tiled_mlp
            else "untiled"
        ) + (" + activation offloading" if cfg.activation_offloading else "")
        print(
            f"trained {summary['model']} ({tiled}, {summary['engine']}, {summary['dtype']}) for "
            f"{summary['steps']} steps of {summary['seq_len']} tokens: loss {summary['first_loss']:.4f} -> "
            f"{summary['last_loss']:.4f}, {summary['tokens_per_s']:,.0f} tokens/s, peak "
            f"{summary['peak_mib']:,.0f} MiB ({summary['peak_kind']})"
        )
        if cfg.output_dir is not None:
            print(f"saved to {cfg.output_dir}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from tiledmlp.plan.mlp import plan_mlp

    if args.budget_gb is not None and args.budget_gb <= 0:
        raise UsageError(f"--budget-gb must be positive, got {args.budget_gb}")
    if args.memory_gb is not None and args.memory_gb <= 0:
        raise UsageError(f"--memory-gb must be positive, got {args.memory_gb}")
    whole = (
        ("--gradient-checkpointing", args.gradient_checkpointing),
        (
            "--optimizer",
            args.optimizer != "none",
        ),
        ("--memory-gb", args.memory_gb is not None),
    )
    if args.model is None and any(on for _, on in whole):
        names = " and ".join(n for n, on in whole if on)
        raise UsageError(f"{names} plan a whole model: add --model NAME_OR_PATH")
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
    )
    if config is not None:
        from tiledmlp.plan.layer import plan_layer

        layer = plan_layer(config, seq_len=args.seq_len, dtype=dtype, num_tiles=args.num_tiles)
        from tiledmlp.plan.model import plan_model

        stacks = plan_model(
            config,
            seq_len=args.seq_len,
            dtype=dtype,
            checkpointing=args.gradient_checkpointing,
            optimizer=args.optimizer,
            num_tiles=args.num_tiles,
            budget_bytes=None if args.memory_gb is None else int(args.memory_gb * 2**30),
        )
        result.update(
            model_name=args.model,
            model=stacks,
            optimizer=args.optimizer,
            gradient_checkpointing=args.gradient_checkpointing,
            memory_gb=args.memory_gb,
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
            + "), peak device MiB:"
        )
        for stack, entry in result["model"].items():
            parts = ", ".join(f"{k} {v:,.0f}" for k, v in entry["breakdown_mib"].items() if v)
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


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from tiledmlp.bench.device import resolve_device
    from tiledmlp.bench.harness import BenchConfig, run_sweep
    from tiledmlp.bench.plot import plot_records
    from tiledmlp.bench.report import markdown_table
    from tiledmlp.bench.variants import deepspeed_available, make_variant
    from tiledmlp.ops.tiles import arctic_num_tiles

    device = resolve_device(args.device)
    accel = device.type != "cpu"
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    cfg = BenchConfig(
        hidden=args.hidden or (4096 if accel else 512),
        intermediate=args.intermediate or (12288 if accel else 1536),
        seq_lens=args.seq_lens or (_GPU_SEQ_LENS if accel else _CPU_SEQ_LENS),
        dtype=getattr(torch, args.dtype or ("bfloat16" if accel else "float32")),
        device=device,
        repeats=args.repeats,
        warmup=args.warmup,
        isolate=args.isolate == "on" or (args.isolate == "auto" and not accel),
    )
    ds_ok = args.deepspeed != "off" and deepspeed_available()
    use_ds = args.deepspeed == "on" or (args.deepspeed == "auto" and ds_ok)
    if args.deepspeed == "on" and not ds_ok:
        raise UsageError(
            "--deepspeed on, but deepspeed is not importable; pip install 'tiledmlp[deepspeed]'"
        )

    def variants(seq: int) -> list:
        chosen = [make_variant("untiled"), make_variant("tiled", args.num_tiles)]
        if use_ds:
            n = (
                args.num_tiles
                if isinstance(args.num_tiles, int)
                else arctic_num_tiles(seq, cfg.hidden)
            )
            chosen.append(make_variant("deepspeed", n))
        return chosen

    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "bench.jsonl"
    with jsonl.open("w") as f:

        def emit(record: dict) -> None:
            f.write(json.dumps(record) + "\n")
            f.flush()
            print(
                f"  {record['seq_len']:>7} tokens  {record['variant']:<9} "
                f"{record['time_ms']:>10.1f} ms {record['peak_mib']:>10.1f} MB",
                file=sys.stderr,
                flush=True,
            )

        records = run_sweep(cfg, variants, emit)
    dtype = str(cfg.dtype).removeprefix("torch.")
    title = (
        f"SwiGLU MLP hidden {cfg.hidden}, intermediate {cfg.intermediate}, {dtype}, "
        f"{records[0]['device_name']}, tiles {args.num_tiles}"
    )
    table = markdown_table(records)
    (args.out / "bench.md").write_text(
        f"{title}, torch {torch.__version__}"
        f"{', each measurement in a fresh process' if cfg.isolate else ''}\n\n{table}\n"
        "Speed (+%): tiled time against regular (positive = slower). Memory (-%): tiled peak "
        "against regular (positive = less). MB = 2**20 bytes, tensor-level peak.\n"
    )
    written = [jsonl, args.out / "bench.md"]
    if not args.no_plot:
        written.append(plot_records(records, args.out / "bench.png", title))
    print(table, end="")
    print(f"wrote {', '.join(map(str, written))}")
    return 0


def _cmd_env(_args: argparse.Namespace) -> int:
    import importlib.metadata as md
    import platform

    import torch

    import tiledmlp

    lines = [
        f"tiledmlp {tiledmlp.__version__}",
        f"python {platform.python_version()} ({platform.platform()})",
        f"torch {torch.__version__}",
    ]
    for pkg in ("transformers", "accelerate", "peft", "deepspeed"):
        try:
            lines.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            lines.append(f"{pkg} not installed")
    lines.append(f"cpu threads {torch.get_num_threads()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {props.name} {props.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("cuda not available")
    print("\n".join(lines))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tiledmlp` console command."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "bench":
            return _cmd_bench(args)
        if args.command == "train":
            return _cmd_train(args)
        if args.command == "plan":
            return _cmd_plan(args)
        return _cmd_env(args)
    except (UsageError, ValueError) as e:
        print(f"tiledmlp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
