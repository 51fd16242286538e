"""`tiledmlp bench`: regular vs tiled (vs DeepSpeed's TiledMLP) MLP time and memory over a
sweep of sequence lengths; a table, JSON lines and a plot.

Invariant: on the CPU each measurement runs in a fresh process unless --isolate off.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tiledmlp.cli.common import DTYPE_CHOICES, UsageError, dtype_name, positive_int, seq_lens
from tiledmlp.cli.flags import add_typed_flag
from tiledmlp.cli.output import show
from tiledmlp.extras import install_command
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.ops.tiling.values import check_int

__all__ = ["add_parser", "run"]

_CPU_SEQ_LENS = (1024, 2048, 4096, 8192)
_GPU_SEQ_LENS = (2048, 4096, 8192, 16384, 32768, 65536, 131072)


def add_parser(sub: Any) -> None:
    """Adds `bench` to the subcommands."""
    bench = sub.add_parser(
        "bench",
        help="the tiled-MLP table: time and peak memory of regular vs tiled MLP, and a plot",
        description=(
            "Measures a SwiGLU MLP's forward + backward for a sweep of sequence lengths, regular "
            "(untiled) vs tiled (and DeepSpeed's TiledMLP when installed): median time of "
            "repeated steps, tensor-level peak memory, FLOPs; on the CPU each measurement runs "
            "in a fresh process. Writes bench.jsonl (one record per length and variant), "
            "bench.md (Seq Length | Regular (ms) | Tiled (ms) | Speed (+%%) | Regular (MB) | "
            "Tiled (MB) | Memory (-%%)) and bench.png (memory and time against length); prints "
            "and records the machine's load average before and after, and says when other work "
            "made the machine busy."
        ),
    )
    _add_shape_flags(bench)
    _add_variant_flags(bench)
    _add_run_flags(bench)


def _add_shape_flags(bench: argparse.ArgumentParser) -> None:
    """The MLP and the sweep: sizes, lengths, dtype, tiles."""
    bench.add_argument(
        "--hidden",
        type=positive_int,
        default=None,
        help="hidden size (default: 4096 on an accelerator, 512 on CPU)",
    )
    bench.add_argument(
        "--intermediate",
        type=positive_int,
        default=None,
        help="intermediate size (default: 12288 on an accelerator, 1536 on CPU)",
    )
    bench.add_argument(
        "--seq-lens",
        type=seq_lens,
        default=None,
        help="comma-separated tokens per sequence (default: 2048..131072 on an accelerator, "
        f"{','.join(map(str, _CPU_SEQ_LENS))} on CPU)",
    )
    bench.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=None,
        help="dtype of weights and activations (default: bfloat16 on an accelerator, float32 on "
        "CPU)",
    )
    from tiledmlp.config.patch import PatchConfig

    # the key, its parser and metavar from the schema; the help says bench's own default
    add_typed_flag(
        bench,
        PatchConfig,
        "num_tiles",
        default=TilePolicy("arctic"),
        help="tiles for the tiled variants: an int, 'auto' or 'arctic' (default: "
        "arctic, ceil(tokens/hidden); DeepSpeed gets the same count, or the "
        "arctic count when this is 'auto')",
    )


def _add_variant_flags(bench: argparse.ArgumentParser) -> None:
    """The optional columns."""
    bench.add_argument(
        "--deepspeed",
        choices=("auto", "on", "off"),
        default="auto",
        help="include DeepSpeed's TiledMLP: auto (if installed), on, off",
    )
    bench.add_argument(
        "--liger",
        choices=("auto", "on", "off"),
        default="auto",
        help="include Liger-Kernel's tiled SwiGLU (apply_tiled_mlp + LigerSiLUMulFunction, the "
        "same tile count as DeepSpeed): auto (if installed and on a GPU), on, off",
    )


def _add_run_flags(bench: argparse.ArgumentParser) -> None:
    """How the measurements run and where they go."""
    bench.add_argument(
        "--repeats",
        type=positive_int,
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
        "--memory-snapshot",
        metavar="FILE",
        default=None,
        help="CUDA only: also record the allocator's history over one tiled step at the "
        "longest sequence and write it to FILE (open it at https://pytorch.org/memory_viz)",
    )
    bench.add_argument(
        "--no-plot",
        action="store_true",
        help="do not draw bench.png (without matplotlib it is left out, with a note)",
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("bench-out"),
        help="folder for bench.jsonl, bench.md and bench.png (default: ./bench-out)",
    )


def run(args: argparse.Namespace) -> int:
    """Runs `tiledmlp bench`."""
    cfg = _config(args)
    use_ds, use_liger, ds_ok = _engines(args, cfg.device)
    plot = _note_left_out(args, ds_ok)
    _note_replaced(args.out)
    from tiledmlp.bench.load import machine_load

    before = machine_load()  # other work only: the sweep has not started
    records = _sweep(args, cfg, use_ds, use_liger)
    load = _load(before, machine_load(), records)
    table, written = _write_report(args, cfg, records, plot, load)
    show(table, end="")
    show(load)
    show(f"wrote {', '.join(map(str, written))}")
    return 0


def _config(args: argparse.Namespace) -> Any:
    """The sweep's BenchConfig: the flags, with the device's defaults for those not given."""
    import torch

    from tiledmlp.bench.device import resolve_device
    from tiledmlp.bench.harness import BenchConfig

    device = resolve_device(args.device)
    accel = device.type != "cpu"
    check_int("--warmup", args.warmup, minimum=0)
    cfg = BenchConfig(
        hidden=args.hidden or (4096 if accel else 512),
        intermediate=args.intermediate or (12288 if accel else 1536),
        seq_lens=args.seq_lens or (_GPU_SEQ_LENS if accel else _CPU_SEQ_LENS),
        dtype=getattr(torch, dtype_name(args.dtype or ("bfloat16" if accel else "float32"))),
        device=device,
        repeats=args.repeats,
        warmup=args.warmup,
        isolate=args.isolate == "on" or (args.isolate == "auto" and not accel),
    )
    if args.memory_snapshot is not None and device.type != "cuda":
        raise UsageError(
            f"--memory-snapshot records the CUDA allocator's history; the device is {device}: "
            "run it on a GPU"
        )
    return cfg


def _engines(args: argparse.Namespace, device: Any) -> tuple[bool, bool, bool]:
    """(use DeepSpeed's column, use Liger's column, DeepSpeed importable); "on" for a part
    that cannot run is refused."""
    from tiledmlp.bench.variants import deepspeed_available, liger_available

    ds_ok = args.deepspeed != "off" and deepspeed_available()
    use_ds = args.deepspeed == "on" or (args.deepspeed == "auto" and ds_ok)
    if args.deepspeed == "on" and not ds_ok:
        raise UsageError(
            "--deepspeed on, but deepspeed is not importable; install it with "
            f"{install_command('deepspeed')} (DS_BUILD_OPS=0 to skip compiling its ops)"
        )
    liger_ok = args.liger != "off" and device.type != "cpu" and liger_available()
    use_liger = args.liger == "on" or (args.liger == "auto" and liger_ok)
    if args.liger == "on" and not liger_ok:
        raise UsageError(
            "--liger on, but liger-kernel's tiled MLP is not importable on this device (it "
            "needs Triton and a GPU); pip install liger-kernel on a GPU machine"
        )
    return use_ds, use_liger, ds_ok


def _note_left_out(args: argparse.Namespace, ds_ok: bool) -> bool:
    """Says once, before the sweep, which optional parts are missing and left out; returns
    whether the plot is drawn."""
    from tiledmlp.bench.plot import matplotlib_available

    plot = not args.no_plot and matplotlib_available()
    left_out = [
        *(["the DeepSpeed column (deepspeed is not installed)"] if args.deepspeed == "auto"
          and not ds_ok else []),
        *(["the plot (matplotlib is not installed)"] if not args.no_plot and not plot else []),
    ]  # fmt: skip
    if left_out:
        extras = [
            e for e, part in (("deepspeed", "DeepSpeed"), ("bench", "plot"))
            if any(part in x for x in left_out)
        ]  # fmt: skip
        print(
            f"tiledmlp bench: note: leaving out {' and '.join(left_out)}; "
            f"{install_command(*extras)} adds {'them' if len(left_out) > 1 else 'it'}",
            file=sys.stderr,
            flush=True,
        )
    return plot


def _note_replaced(out: Path) -> None:
    """Says, before the sweep, that an earlier run's results in `out` are about to be replaced."""
    earlier = [n for n in ("bench.jsonl", "bench.md", "bench.png") if (out / n).is_file()]
    if earlier:
        print(
            f"tiledmlp bench: note: replacing the earlier results in {out}/ ({', '.join(earlier)});"
            " --out DIR writes elsewhere",
            file=sys.stderr,
            flush=True,
        )


def _sweep(args: argparse.Namespace, cfg: Any, use_ds: bool, use_liger: bool) -> list[dict]:
    """Runs the sweep, one JSON record per line into OUT/bench.jsonl and a progress line per
    measurement on stderr; returns the records."""
    from tiledmlp.bench.harness import run_sweep
    from tiledmlp.bench.variants import make_variant
    from tiledmlp.ops.tiling.tiles import arctic_num_tiles

    def variants(seq: int) -> list:
        # a variant crosses into its measuring process as a job spelling (int or text)
        chosen = [make_variant("untiled"), make_variant("tiled", args.num_tiles.num_tiles)]
        n = (
            int(policy.amount)
            if (policy := args.num_tiles).rule == "count"
            else arctic_num_tiles(seq, cfg.hidden)
        )
        if use_ds:
            chosen.append(make_variant("deepspeed", n))
        if use_liger:
            chosen.append(make_variant("liger", n))
        return chosen

    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "bench.jsonl").open("w") as f:

        def emit(record: dict) -> None:
            f.write(json.dumps(record) + "\n")
            f.flush()
            print(
                f"  {record['seq_len']:>7} tokens  {record['variant']:<9} "
                f"{record['time_ms']:>10.1f} ms {record['peak_mib']:>10.1f} MB",
                file=sys.stderr,
                flush=True,
            )

        return run_sweep(cfg, variants, emit)


def _load(before: float | None, after: float | None, records: list[dict]) -> str:
    """The load line (bench/load.py) of a sweep: the load before and after, the CPUs, the
    threads the measurements ran."""
    import os

    from tiledmlp.bench.load import load_line

    return load_line(before, after, os.cpu_count() or 1, int(records[0]["threads"]))


def _write_report(
    args: argparse.Namespace, cfg: Any, records: list[dict], plot: bool, load: str
) -> tuple[str, list[Path]]:
    """Writes OUT/bench.md (and the memory snapshot and plot when asked); returns the table and
    the files written."""
    import torch

    from tiledmlp.bench.plot import plot_records
    from tiledmlp.bench.report import markdown_table

    dtype = str(cfg.dtype).removeprefix("torch.")
    title = (
        f"SwiGLU MLP hidden {cfg.hidden}, intermediate {cfg.intermediate}, {dtype}, "
        f"{records[0]['device_name']}, tiles {args.num_tiles}"
    )
    table = markdown_table(records)
    (args.out / "bench.md").write_text(
        f"{title}, torch {torch.__version__}"
        f"{', each measurement in a fresh process' if cfg.isolate else ''}\n\n{load}\n\n{table}\n"
        "Time, tiled vs regular: the tiled time against regular (slower or faster). Memory, "
        "tiled vs regular: the tiled peak against regular (less or more). MB = 2**20 bytes, tensor-level peak.\n"
    )
    written = [args.out / "bench.jsonl", args.out / "bench.md"]
    if args.memory_snapshot is not None:
        from tiledmlp.bench.measure import Job, memory_snapshot

        job = Job(
            hidden=cfg.hidden,
            intermediate=cfg.intermediate,
            seq_len=max(cfg.seq_lens),
            dtype=dtype,
            device=str(cfg.device),
            variant="tiled",
            num_tiles=args.num_tiles.num_tiles,
        )
        written.append(Path(memory_snapshot(job, str(args.memory_snapshot))))
    if plot:
        written.append(plot_records(records, args.out / "bench.png", title))
    return table, written
