"""`tiledmlp env`: versions and devices, for bug reports."""

from __future__ import annotations

import argparse
from typing import Any

from tiledmlp.allocator import allocator_setting, describe
from tiledmlp.cli.common import UsageError
from tiledmlp.cli.output import show

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Adds `env` to the subcommands."""
    p = sub.add_parser(
        "env",
        help="versions and devices, for bug reports",
        description="Prints versions of Python, torch and optional packages, and devices. "
        "With --compile-kernels, compiles every variant of the fused GLU kernels for the given "
        "CUDA targets instead (no GPU needed).",
    )
    p.add_argument(
        "--compile-kernels",
        metavar="TARGETS",
        default=None,
        help="compile every fused-kernel variant for these CUDA targets with the installed "
        "Triton, e.g. sm_80,sm_90; prints one line, or each variant that failed (exit 1)",
    )


def run(args: argparse.Namespace) -> int:
    """Runs `tiledmlp env`."""
    if getattr(args, "compile_kernels", None) is not None:
        return _compile_kernels(args.compile_kernels)
    import importlib.metadata as md
    import platform

    import torch

    import tiledmlp

    lines = [
        f"tiledmlp {tiledmlp.__version__}",
        f"python {platform.python_version()} ({platform.platform()})",
        f"torch {torch.__version__}",
    ]
    for pkg in (
        "transformers", "accelerate", "peft", "trl", "datasets", "deepspeed", "triton",
        "matplotlib",
    ):  # fmt: skip
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
    lines.append(f"cuda allocator {describe(allocator_setting())}")
    show("\n".join(lines))
    return 0


def _compile_kernels(targets: str) -> int:
    """`tiledmlp env --compile-kernels TARGETS`: 0 when every variant compiled, 1 otherwise."""
    import sys

    from tiledmlp.ops.mlp.glu.compile import compile_variants, parse_targets

    archs = parse_targets(targets)
    try:
        report = compile_variants(archs)
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    if report.failed:
        for line in report.failed:
            print(f"failed: {line}", file=sys.stderr)
        print(
            f"{len(report.failed)} of {report.compiled + len(report.failed)} kernel variants "
            f"failed to compile with Triton {report.triton_version}",
            file=sys.stderr,
        )
        return 1
    show(report.summary())
    return 0
