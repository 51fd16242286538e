"""Command-line interface: `tiledmlp bench` and `tiledmlp env`.

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
    if text in ("auto", "arctic"):
        return text
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
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


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiledmlp",
        description="Tiled MLPs for long-sequence training: benchmark and inspect.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = sub.add_parser(
        "bench",
        help="time, peak memory and FLOPs of untiled vs tiled MLP (and DeepSpeed's TiledMLP)",
        description=(
            "Measures a SwiGLU MLP's forward + backward for a sweep of sequence lengths: median "
            "time of interleaved repeats, tensor-level peak memory, FLOPs. Writes JSON lines and "
            "a Markdown table."
        ),
    )
    bench.add_argument(
        "--hidden",
        type=_positive_int,
        default=None,
        help="hidden size (default: 4096 on CUDA, 512 on CPU)",
    )
    bench.add_argument(
        "--intermediate",
        type=_positive_int,
        default=None,
        help="intermediate size (default: 12288 on CUDA, 1536 on CPU)",
    )
    bench.add_argument(
        "--seq-lens",
        type=_seq_lens,
        default=None,
        help="comma-separated tokens per sequence (default: 2048..131072 on CUDA, "
        "1024,2048,4096,8192 on CPU)",
    )
    bench.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="dtype of weights and activations (default: bfloat16 on CUDA, float32 on CPU)",
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
        choices=("cpu", "cuda"),
        default=None,
        help="where to run (default: cuda if available, else cpu)",
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("bench-out"),
        help="folder for bench.jsonl and bench.md (default: ./bench-out)",
    )

    sub.add_parser(
        "env",
        help="versions and devices, for bug reports",
        description="Prints versions of Python, torch and optional packages, and devices.",
    )
    return parser


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from tiledmlp.bench.harness import BenchConfig, run_sweep
    from tiledmlp.bench.report import markdown_table
    from tiledmlp.bench.variants import deepspeed_available, make_variant
    from tiledmlp.ops.tiles import arctic_num_tiles

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--device cuda was given but no CUDA device is available; use --device cpu"
        )
    gpu = device.type == "cuda"
    cfg = BenchConfig(
        hidden=args.hidden or (4096 if gpu else 512),
        intermediate=args.intermediate or (12288 if gpu else 1536),
        seq_lens=args.seq_lens
        or ((2048, 4096, 8192, 16384, 32768, 65536, 131072) if gpu else (1024, 2048, 4096, 8192)),
        dtype=getattr(torch, args.dtype or ("bfloat16" if gpu else "float32")),
        device=device,
        repeats=args.repeats,
        warmup=args.warmup,
    )
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    use_ds = args.deepspeed == "on" or (args.deepspeed == "auto" and deepspeed_available())
    if args.deepspeed == "on" and not deepspeed_available():
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
            logger.info(
                "seq %d %s: %.1f ms, %.1f MiB",
                record["seq_len"],
                record["variant"],
                record["time_ms"],
                record["peak_mib"],
            )

        records = run_sweep(cfg, variants, emit)
    table = markdown_table(records)
    (args.out / "bench.md").write_text(
        f"SwiGLU MLP hidden {cfg.hidden}, intermediate {cfg.intermediate}, "
        f"{str(cfg.dtype).removeprefix('torch.')}, {records[0]['device_name']}, "
        f"torch {torch.__version__}, tiles {args.num_tiles}\n\n{table}"
    )
    print(table, end="")
    print(f"wrote {jsonl} and {args.out / 'bench.md'}")
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
        return _cmd_env(args)
    except (UsageError, ValueError) as e:
        print(f"tiledmlp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
